"""Every agent serves its own stage's /metrics (to holders of the cluster key only, like the rest of its server),
and the leader's dashboard gathers every stage's busy intervals from the members (agents in one process on the
loopback interface, the tiny model)."""

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from flowspec_p2p.agent import Agent
from flowspec_p2p.cluster.identity import Identity, client_context
from flowspec_p2p.cluster.pinning import AuthClient

from ..agent_fixtures import complete, make_fixture, parts_fixture, quick_timing_fixture, running, serving, until
from ..ring_fixtures import ByteTokenizer

__all__ = ["make_fixture", "parts_fixture", "quick_timing_fixture"]

def samples(text: str) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


async def test_each_member_serves_its_stage_metrics_and_the_dashboard_sees_every_stage_busy(make):
    plan = {"context": 128, "stages": 3, "leader_layers": "always"}
    leader = Agent(make("lead", leader=True, planning=plan, decoding="ar"), tokenizer=ByteTokenizer())
    a, b = Agent(make("a")), Agent(make("b"))
    async with running(leader, a, b):
        await until(serving(leader, 2))
        data = await complete(leader, [1, *ByteTokenizer().encode("abc hello")], n=10)
        assert data["usage"]["completion_tokens"] == 10
        stranger = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=client_context()))
        holder = AuthClient(leader.security.key, Identity.generate()).open()
        async with stranger, holder:
            scraped = {}
            for agent in (a, b, leader):
                async with stranger.get(agent.info.url + "/metrics") as r:
                    assert r.status == 401
                async with holder.get(agent.info.url + "/metrics") as r:
                    assert r.status == 200
                    scraped[agent] = samples(await r.text())
        for agent, m in scraped.items():
            stage = agent.stage_host.active.worker.core.index
            assert m[("flowspec_stage_index", ())] == stage
            assert m[("flowspec_stage_frames_in_total", ())] >= 10  # prefill + 9 steps + release, at least
            assert m[("flowspec_stage_frames_out_total", ())] == m[("flowspec_stage_frames_in_total", ())]
            assert m[("flowspec_stage_compute_seconds_total", ())] > 0
            assert m[("flowspec_stage_forwards_total", ())] >= 10
            assert m[("flowspec_stage_cache_bytes", ())] >= 0
            assert m[("flowspec_agent_info", (("agent", agent.id), ("cluster", agent.cfg.cluster),
                                              ("name", agent.info.name), ("role", agent.info.role)))] == 1
            if agent is not leader:  # the others send to their successor over a websocket
                assert m[("flowspec_stage_link_sent_bytes_total", ())] > 0
        async with aiohttp.ClientSession() as s, s.get(leader.api_url + "/dashboard/state") as r:
            state = await r.json()
        stages = state["timeline"]["stages"]
        assert [st["agent_id"] for st in stages] == [n.agent_id for n in leader.coordinator.update.ring]
        assert all(len(st["intervals"]) >= 10 for st in stages), stages  # fetched from each member, authenticated
        assert [m["id"] for m in state["cluster"]["members"]] == [leader.id, *sorted((a.id, b.id))]
        assert state["cluster"]["recoveries"][-1]["stages"][0]["agent_id"] == leader.coordinator.plan.agents[0]


async def test_stage_counters_add_up_over_the_epochs_an_agent_served(tmp_path):
    import asyncio
    from types import SimpleNamespace

    from flowspec_p2p.cluster.stage_host import Active, StageHost

    def worker(frames: int, sent: int):
        return SimpleNamespace(core=SimpleNamespace(counters={"forwards": frames, "tokens": 2 * frames}, requests={},
                                                    index=2),
                               counters={"frames_in": frames, "frames_out": frames, "compute_s": 0.5},
                               successor=SimpleNamespace(counters=SimpleNamespace(bytes=sent)),
                               inbox=asyncio.Queue())

    async def done():
        pass

    host = StageHost(agent_id="a", cluster="c", ring=None, session=None, cache_dir=tmp_path)
    for epoch, (frames, sent) in enumerate([(10, 1000), (4, 300)], 1):
        task = asyncio.get_running_loop().create_task(done())
        await task
        host.active = Active(epoch, None, None, worker(frames, sent), task)
        if epoch == 1:
            await host._retire(host.active)  # what activate() does with the old epoch's worker
    totals = host.totals()
    assert (totals["frames_in"], totals["forwards"], totals["tokens"]) == (14, 14, 28)
    assert (totals["sent_bytes"], totals["compute_s"], totals["stage"], totals["cache_bytes"]) == (1300, 1.0, 2, 0)
