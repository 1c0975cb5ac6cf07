"""The planner: memory is never exceeded, every layer is assigned exactly once, plans are deterministic, it is
heterogeneity-aware, and golden plans under plans/ still come out the same."""

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowspec_p2p.cluster import planner, plans
from flowspec_p2p.cluster.planner import plan
from flowspec_p2p.cluster.plans import Device, ModelSizes, PlanOptions, diff, render
from flowspec_p2p.errors import PlanInfeasible

MB = 1024 * 1024
PLANS = Path(__file__).resolve().parents[2] / "plans"


def smol(context: int = 2048, layers: int = 30) -> ModelSizes:
    """SmolLM2-135M's sizes (float32 at run time)."""
    layer = 3_540_096
    return ModelSizes(name="smol", num_layers=layers, layer_bytes=(layer * 4,) * layers, embed_bytes=49152 * 576 * 4,
                     head_bytes=(49152 * 576 + 576) * 4, norm_bytes=576 * 4, draft_bytes=4_203_072 * 4,
                     kv_bytes_per_token=1536,
                     hidden_size=576, vocab_size=49152, context=context, layer_flops=2.0 * layer,
                     head_flops=2.0 * 576 * 49152, draft_flops=2.0 * 4_203_072)


def dev(i: int, mem_mb: float, gflops: float, leader: bool = False, **kw) -> Device:
    return Device(id=f"d{i}", memory_bytes=int(mem_mb * MB), gflops=gflops, leader=leader, **kw)


def check_invariants(p, devices, model):
    by_id = {d.id: d for d in devices}
    covered = []
    for i, s in enumerate(p.stages):
        assert s.memory_bytes <= by_id[s.agent_id].memory_bytes
        assert len(s.layers) >= 1
        assert s.embed == (i == 0)
        assert s.head == (i == len(p.stages) - 1)
        covered += list(s.layers.indices())
    assert covered == list(range(model.num_layers))  # each layer exactly once, in order
    assert len(set(p.agents)) == len(p.agents)
    assert p.leader_memory_bytes <= by_id[p.leader_id].memory_bytes


device_lists = st.lists(
    st.tuples(st.floats(120, 4000), st.floats(1, 200), st.floats(1, 1000), st.floats(0, 5)), min_size=1, max_size=6
)


@settings(max_examples=150, deadline=None)
@given(device_lists, st.integers(1, 40), st.sampled_from([1, 16]), st.sampled_from(["auto", "never", "always"]))
def test_plans_respect_memory_and_assign_every_layer_once(specs, layers, tokens, leader_layers):
    devices = [dev(i, m, g, leader=i == 0, link_mbps=bw, latency_ms=lat) for i, (m, g, bw, lat) in enumerate(specs)]
    model = smol(context=512, layers=layers)
    opts = PlanOptions(tokens_per_step=tokens, leader_layers=leader_layers)
    try:
        p = plan(devices, model, opts)
    except PlanInfeasible:
        return
    check_invariants(p, devices, model)
    assert plan(list(reversed(devices)), model, opts) == p  # deterministic, whatever the input order
    assert {e.agent_id for e in p.excluded} | set(p.agents) | {p.leader_id} == {d.id for d in devices}


def test_a_fast_leader_with_room_runs_alone():
    devices = [dev(0, 4000, 200, leader=True), dev(1, 4000, 5), dev(2, 4000, 5)]
    p = plan(devices, smol())
    assert p.agents == ("d0",)
    assert {e.agent_id for e in p.excluded} == {"d1", "d2"}
    assert "would slow the pipeline" in p.excluded[0].reason


def test_faster_devices_get_more_layers():
    devices = [dev(0, 1000, 20, leader=True), dev(1, 1000, 40), dev(2, 1000, 10)]
    p = plan(devices, smol(), PlanOptions(stages=3))
    sizes = {s.agent_id: len(s.layers) for s in p.stages}
    assert sizes["d1"] > sizes["d2"]
    busy = [s.busy_ms for s in p.stages]
    assert max(busy) / min(busy) < 1.6  # balanced, not equal layer counts


def test_a_device_without_room_for_one_layer_is_left_out_with_the_reason():
    devices = [dev(0, 1000, 20, leader=True), dev(1, 1000, 20), dev(2, 10, 500)]
    p = plan(devices, smol())
    assert "d2" not in p.agents
    assert p.excluded[0].reason.startswith("memory")


def test_memory_forces_a_split():
    devices = [dev(0, 400, 50, leader=True), dev(1, 450, 10)]
    p = plan(devices, smol(context=256))
    assert len(p.stages) == 2
    check_invariants(p, devices, smol(context=256))


def test_too_little_memory_in_all_is_infeasible():
    with pytest.raises(PlanInfeasible, match="does not fit"):
        plan([dev(0, 260, 20, leader=True), dev(1, 100, 20)], smol())


def test_forced_stage_count_and_leader_without_layers_as_in_flowspec():
    devices = [dev(i, 1000, 20, leader=i == 0) for i in range(5)]
    p = plan(devices, smol(), PlanOptions(stages=4, leader_layers="never"))
    assert len(p.stages) == 4
    assert p.stage_of("d0") is None
    assert [len(s.layers) for s in p.stages] in ([8, 8, 7, 7], [8, 8, 8, 6])


def test_diff_names_releases_moves_and_assignments():
    a = plan([dev(i, 1000, 20, leader=i == 0) for i in range(3)], smol(), PlanOptions(stages=3))
    b = plan([dev(i, 1000, 20, leader=i == 0) for i in range(2)], smol(), PlanOptions(stages=2))
    kinds = {(c.kind, c.agent_id) for c in diff(a, b)}
    assert ("release", "d2") in kinds
    assert ("move", "d1") in kinds
    back = {(c.kind, c.agent_id) for c in diff(b, a)}
    assert ("assign", "d2") in back
    assert diff(a, a) == []


def test_render_is_readable():
    devices = [dev(0, 1000, 20, leader=True), dev(1, 1000, 20), dev(2, 10, 20)]
    text = render(plan(devices, smol()), devices)
    assert "leader d0" in text
    assert "[0, " in text
    assert "left out d2" in text


def test_search_is_bounded_beyond_the_exhaustive_limit(monkeypatch):
    monkeypatch.setattr(planner, "EXHAUSTIVE_MAX_DEVICES", 3)
    devices = [dev(i, 1000, 10 + i, leader=i == 0) for i in range(6)]
    p = plan(devices, smol())
    check_invariants(p, devices, smol())


@pytest.mark.parametrize("path", sorted(PLANS.glob("*.json")), ids=lambda p: p.stem)
def test_golden_plans_are_unchanged(path):
    golden = json.loads(path.read_text())
    devices = [Device.model_validate_json(json.dumps(d)) for d in golden["devices"]]  # as JSON, as written
    model = ModelSizes.model_validate_json(json.dumps(golden["model"]))
    opts = PlanOptions.model_validate(golden["options"])
    assert plan(devices, model, opts).model_dump(mode="json") == golden["plan"]
    assert render(plan(devices, model, opts), devices) == golden["rendering"]


def test_a_tied_leader_needs_no_embedding_bytes_beside_its_head():
    untied = smol()
    tied = untied.model_copy(update={"tied_embeddings": True})
    costs_u, costs_t = planner._Costs(untied, PlanOptions()), planner._Costs(tied, PlanOptions())
    assert costs_u.leader_extra_bytes() - costs_t.leader_extra_bytes() == untied.embed_bytes
    stage = dev(1, 1000, 10)  # a stage that embeds still holds its own table
    assert costs_t.fixed_bytes(stage, embed=True, head=False) == costs_u.fixed_bytes(stage, embed=True, head=False)


def test_the_plan_holds_kv_for_as_many_requests_as_memory_allows():
    """Unconfigured, the leader plans for DEFAULT_MAX_REQUESTS requests in flight, fewer where the devices' memory
    cannot hold their KV beside the layers; configured, that many or no plan."""
    model = smol()
    kv_one = model.kv_bytes_per_token * model.context * model.num_layers  # one request's KV over every layer
    roomy = [dev(0, 4000, 10, leader=True)]
    p, n = planner.plan_requests(roomy, model)
    assert n == planner.DEFAULT_MAX_REQUESTS
    check_invariants(p, roomy, model)
    weights = sum(model.layer_bytes) + model.embed_bytes + model.head_bytes + model.draft_bytes
    tight = [dev(0, (weights + 3.5 * kv_one) / MB + 20, 10, leader=True)]  # room for three requests' KV
    p, n = planner.plan_requests(tight, model)
    assert n == 3
    assert planner.plan_requests(tight, model, requests=2)[1] == 2
    with pytest.raises(PlanInfeasible):
        planner.plan_requests(tight, model, requests=8)


def test_the_headroom_is_left_free_and_stated_and_each_agents_runtime_added_to_its_expected_rss():
    model = smol(context=256)
    c = planner._Costs(model, PlanOptions())
    need = c.leader_extra_bytes() + c.act + sum(model.layer_bytes) + model.num_layers * c.kv_per_layer
    exact = Device(id="d0", memory_bytes=need, runtime_bytes=300 * MB, gflops=10, leader=True)
    p = plan([exact], model, PlanOptions(headroom=0.0))
    assert p.stages[0].memory_bytes == need
    assert p.stages[0].expected_rss == need + 300 * MB  # what the agent's resident set should be
    with pytest.raises(PlanInfeasible, match="short by"):
        plan([exact], model)  # the default 5% headroom does not fit
    roomy = exact.model_copy(update={"memory_bytes": int(need / 0.95) + MB, "runtime_bytes": None})
    p = plan([roomy], model)
    assert (p.headroom, p.kv_requests) == (0.05, 1)
    assert p.stages[0].runtime_bytes == plans.DEFAULT_RUNTIME_BYTES  # a device that does not say
    assert "5% of each offer left free" in render(p, [roomy])


def test_no_plan_says_by_how_much_memory_falls_short_and_that_much_more_fits():
    model = smol(context=2048)
    devices = [dev(i, 100 + 20 * i, 10, leader=i == 0) for i in range(3)]
    with pytest.raises(PlanInfeasible, match=r"^short by \d+ MB: ") as e:
        plan(devices, model)
    short, needs = planner.shortfall(devices, model, PlanOptions())
    assert e.value.short_bytes == short == sum(needs.values()) > 0
    assert f"short by {-(-short // MB)} MB" in str(e.value)
    more = [d.model_copy(update={"memory_bytes": d.memory_bytes + needs.get(d.id, 0)}) for d in devices]
    check_invariants(plan(more, model), more, model)  # exactly that much more fits
    less = [d.model_copy(update={"memory_bytes": d.memory_bytes + max(0, needs.get(d.id, 0) - 2 * MB)})
            for d in devices]
    with pytest.raises(PlanInfeasible):
        plan(less, model)
    with pytest.raises(PlanInfeasible, match=r"^short by \d+ MB: the leader d0 needs .*the closest plan needs") as e:
        planner.plan_requests([dev(0, 50, 10, leader=True)], model)
    assert e.value.short_bytes > 0
