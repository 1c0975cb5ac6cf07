"""Agents in one process on the loopback interface (port 0, tiny float64 model): they find each other, plan,
fetch their layers from the leader and serve over TLS; a second leader and strangers without the cluster key are
refused; the open mode (--insecure) still serves."""

import asyncio

import pytest

from flowspec_p2p import env
from flowspec_p2p.agent import Agent
from flowspec_p2p.cluster.keys import ClusterKey
from flowspec_p2p.config import load
from flowspec_p2p.decoding.flowspec import FlowSpecConfig
from flowspec_p2p.errors import ConfigError
from flowspec_p2p.model import native_shard

from .agent_fixtures import complete, make_fixture, parts_fixture, quick_timing_fixture, running, serving, until
from .gguf_fixtures import write_random_gguf
from .ring_fixtures import ByteTokenizer

__all__ = ["make_fixture", "parts_fixture", "quick_timing_fixture"]


async def test_three_agents_find_each_other_fetch_their_layers_and_serve(make, parts):
    leader = Agent(make("lead", leader=True, planning={"context": 128, "stages": 3, "leader_layers": "always"},
                        decoding="ar"), tokenizer=ByteTokenizer())
    a, b = Agent(make("a")), Agent(make("b"))
    async with running(leader, a, b):
        await until(serving(leader, 2))
        assert leader.leader.default_mode() == "ar"  # --decoding
        assert len(leader.coordinator.plan.stages) == 3
        assert {s.agent_id for s in leader.coordinator.plan.stages} == {leader.id, a.id, b.id}
        prompt = ByteTokenizer().encode("abc hello")
        data = await complete(leader, [1, *prompt], n=12)
        ref = parts.reference(prompt, 12)
        assert data["choices"][0]["text"] == ByteTokenizer().decode(ref)
        assert data["stats"]["new_tokens"] == 12
        # no --max-requests: the plan holds KV for as many requests as memory allows, and admits that many
        assert leader.coordinator.update.max_requests == leader.leader.admission.limit == 8
        # three stations on one host can work at once only as far as its cores go (the micro-batches follow)
        assert leader.leader.pipeline.parallel == min(3, env.physical_cores())
        # every stage's KV capacity covers the context and a draft tree's pending nodes beyond it
        settings = leader.leader.settings
        assert leader.coordinator.update.context == settings.max_context + settings.tree_margin
        assert a.stage_host.active.worker.core.capacity == settings.stage_capacity
        view = leader.coordinator.view()
        assert [m["role"] for m in view["members"]] == ["leader", "member", "member"]
        assert {st["agent_id"] for st in view["stages"]} == {leader.id, a.id, b.id}
        member_statuses = [leader.coordinator.statuses[x.id] for x in (a, b)]
        assert all(st.source in ("fetched", "cache") for st in member_statuses)  # no model copy on members


@pytest.mark.skipif(not native_shard.available(), reason="the native engine is unavailable here")
async def test_every_stage_runs_the_engine_the_leaders_plan_names(make, tmp_path):
    """A float32 GGUF, which a member left on ``auto`` would run on the native engine: the leader chose the torch
    engine, its plans say so, and the member's stage runs the torch engine too."""
    model = write_random_gguf(tmp_path / "m.gguf", "Q8_0")
    planning = {"context": 64, "stages": 2, "leader_layers": "always"}
    leader = Agent(make("lead", leader=True, model=model, dtype="float32", wire_dtype="float32", engine="torch",
                        planning=planning, decoding="ar", max_requests=3), tokenizer=ByteTokenizer())
    member = Agent(make("m", dtype="float32", wire_dtype="float32", engine="auto"))
    async with running(leader, member):
        await until(serving(leader, 1))
        assert leader.coordinator.update.engine == "torch"
        assert leader.coordinator.update.max_requests == leader.leader.admission.limit == 3  # --max-requests
        assert member.stage_host.active.shard.engine.name == "torch"
        assert leader.stage_host.active.shard.engine.name == "torch"
        data = await complete(leader, [1, 5, 9], n=4)
        assert data["stats"]["new_tokens"] == 4


async def test_a_second_leader_ends_neither_and_each_logs_the_others_claim(make, caplog):
    """Another leader's claim (older or younger) never ends a leader (issue 33: a holder of the key could make
    one); each logs it, and members follow their leader by identity (tests/cluster/test_security.py)."""
    first = Agent(make("one", leader=True), tokenizer=ByteTokenizer())
    async with running(first) as tasks:
        await until(lambda: first.started.is_set())
        second = Agent(make("two", leader=True), tokenizer=ByteTokenizer())
        tasks[second] = asyncio.create_task(second.run())
        await until(lambda: second.started.is_set())
        await until(lambda: f"claims to lead: agent {first.id}" in caplog.text
                    and f"claims to lead: agent {second.id}" in caplog.text)
        assert not any(t.done() for t in tasks.values())
        second.stop()


async def test_strangers_with_another_key_a_wrong_secret_or_none_cannot_join(make, parts):
    """--secret maps onto a cluster key (derived from it): agents sharing it join; a wrong secret, another cluster
    key, or an open (--insecure) agent are refused, however they reach the leader."""
    leader = Agent(make("lead", leader=True, secret="correct horse battery"), tokenizer=ByteTokenizer())
    async with running(leader):
        await until(lambda: leader.info is not None and leader.started.is_set())
        assert leader.info.url.startswith("https://")
        peer = f"127.0.0.1:{leader.info.port}"
        stranger = Agent(make("x", secret="wrong horse battery", peers=(peer,), mdns=False))
        other_key = Agent(make("k", cluster_key=ClusterKey.generate().text, peers=(peer,)))
        nobody = Agent(make("y", insecure=True, peers=(peer,), mdns=False))
        friend = Agent(make("f", secret="correct horse battery", peers=(peer,), mdns=False))
        async with running(stranger, other_key, nobody, friend):
            await until(serving(leader, 1))  # ring links and weight fetches are authenticated too
            assert friend.id in leader.coordinator.plan.agents
            prompt = ByteTokenizer().encode("secret")
            data = await complete(leader, [1, *prompt], 6)
            assert data["choices"][0]["text"] == ByteTokenizer().decode(parts.reference(prompt, 6))
            await asyncio.sleep(0.5)
            for x in (stranger, other_key, nobody):
                assert x.member.leader is None
        for x in (stranger, other_key, nobody):
            assert x.id not in leader.coordinator.membership.members


async def test_the_open_mode_serves_over_plain_http(make, parts, caplog):
    leader = Agent(make("lead", leader=True, insecure=True), tokenizer=ByteTokenizer())
    member = Agent(make("m", insecure=True))
    async with running(leader, member):
        await until(serving(leader, 1))
        assert leader.info.url.startswith("http://")
        assert not leader.info.identity
        prompt = ByteTokenizer().encode("open")
        data = await complete(leader, [1, *prompt], 6)
        assert data["choices"][0]["text"] == ByteTokenizer().decode(parts.reference(prompt, 6))
    assert sum("OPEN cluster" in r.message for r in caplog.records) == 2  # a warning at every start


async def test_a_member_without_a_key_refuses_to_start_and_says_how_to_get_one(make):
    with pytest.raises(ConfigError, match="FLOWSPEC_CLUSTER_KEY"):
        await Agent(make("m", cluster_key=None, insecure=False)).run()


def test_config_layers_profile_flags_and_environment(tmp_path):
    profile = tmp_path / "edge.toml"
    profile.write_text('cluster = "home"\nname = "pi"\n[profile]\nmemory_mb = 512\n[emulation]\nslowdown = 2.0\n')
    cfg = load(profile, {"port": 4000, "emulation": {"link_mbps": 50.0}, "name": None},
               env={"FLOWSPEC_SECRET": "from-the-environment", "FLOWSPEC_STATE_DIR": str(tmp_path / "s")})
    assert (cfg.cluster, cfg.name, cfg.port, cfg.profile.memory_mb) == ("home", "pi", 4000, 512)
    assert (cfg.emulation.slowdown, cfg.emulation.link_mbps) == (2.0, 50.0)
    assert cfg.secret.get_secret_value() == "from-the-environment"
    assert "from-the-environment" not in repr(cfg)
    assert cfg.state_dir == tmp_path / "s"
    with pytest.raises(ConfigError, match="HOST:PORT"):
        load(None, {"peers": ["nohost"]}, env={})
    with pytest.raises(ConfigError, match="cluster name"):
        load(None, {"cluster": "bad name!"}, env={})
    assert load(None, {"decoding": "ar"}, env={}).decoding == "ar"
    with pytest.raises(ConfigError, match="decoding"):
        load(None, {"decoding": "fastest"}, env={})
    assert load(None, {"flowspec": {"segment_cap": 1}}, env={}).flowspec == FlowSpecConfig(segment_cap=1)
    key = ClusterKey.generate().text
    assert load(None, {}, env={"FLOWSPEC_CLUSTER_KEY": key, "FLOWSPEC_SECRET": "x" * 8}).cluster_key is not None
    assert load(None, {}, env={"FLOWSPEC_CLUSTER_KEY": key, "FLOWSPEC_SECRET": "x" * 8}).secret is None
    for flags in ({"insecure": True}, {"cluster_key_file": "k.key"}, {"secret": "a passphrase"}):  # flags win
        assert load(None, flags, env={"FLOWSPEC_CLUSTER_KEY": key}).cluster_key is None
    with pytest.raises(ConfigError, match="give one of"):
        load(None, {"insecure": True, "secret": "a passphrase"}, env={})
    assert load(None, {}, env={"FLOWSPEC_API_KEY": "k" * 12}).api_key_text == "k" * 12
    with pytest.raises(ConfigError, match=r"flowspec\.in_flight"):
        load(None, {"flowspec": {"in_flight": 0}}, env={})
    assert load(None, {"cache_max_gb": 2.5}, env={}).cache_max_gb == 2.5
    assert load(None, {}, env={}).engine == "auto"
    assert load(None, {}, env={"FLOWSPEC_ENGINE": "torch"}).engine == "torch"  # a fill-in ...
    assert load(None, {"engine": "native"}, env={"FLOWSPEC_ENGINE": "torch"}).engine == "native"  # ... flags win
    with pytest.raises(ConfigError, match="engine"):
        load(None, {"engine": "cuda"}, env={})
    with pytest.raises(ConfigError, match="cache_max_gb"):
        load(None, {"cache_max_gb": 0}, env={})
    from flowspec_p2p.cli import build_parser
    from flowspec_p2p.commands.agent import config_from_args

    args = build_parser().parse_args(["agent", "--cluster", "home", "--cache-max-gb", "1.5", "--engine", "torch"])
    assert config_from_args(args).cache_max_gb == 1.5
    assert config_from_args(args).engine == "torch"


def test_the_leader_runs_flowspec_with_the_configured_settings_and_the_others_as_shipped():
    from flowspec_p2p.cli import build_parser
    from flowspec_p2p.cluster.leading import modes as _modes
    from flowspec_p2p.commands.agent import config_from_args
    from flowspec_p2p.decoding.flowspec import FlowSpecConfig
    from flowspec_p2p.decoding.registry import builtin_modes

    args = build_parser().parse_args(["agent", "--leader", "--flowspec-config", '{"segment_cap": 1, "in_flight": 8}'])
    cfg = config_from_args(args)
    assert cfg.flowspec == FlowSpecConfig(segment_cap=1, in_flight=8)
    modes = {m.name: m for m in _modes(cfg.flowspec)}
    shipped = {m.name: m for m in builtin_modes()}
    assert modes.keys() == shipped.keys()
    tuned = modes["flowspec"].run.keywords["config"]
    assert (tuned.segment_cap, tuned.in_flight, tuned.min_value) == (1, 8, FlowSpecConfig().min_value)
    assert all(modes[n] is shipped[n] for n in shipped if n != "flowspec")
    assert {m.name: m for m in _modes(FlowSpecConfig())}["flowspec"] is shipped["flowspec"]
    with pytest.raises(ConfigError, match="not JSON"):
        config_from_args(build_parser().parse_args(["agent", "--flowspec-config", "{segment_cap: 1}"]))


def test_the_example_agent_profiles_load():
    from pathlib import Path

    profiles = sorted((Path(__file__).resolve().parent.parent / "agents").glob("*.toml"))
    assert len(profiles) >= 3
    leaders = [load(p, env={}).leader for p in profiles]
    assert sum(leaders) == 1
