"""FlowSpec through 3- and 4-stage in-process rings: greedy output equals single-device autoregressive decoding
token for token (float64) with perfect, random and partial drafts; the bookkeeping takes every path (continue,
restart, dead segments); sampling keeps the target's distribution."""

import asyncio
import math

import pytest
import torch

from flowspec_p2p.decoding.ar import AR
from flowspec_p2p.decoding.flowspec import FlowSpecConfig, FlowSpecGrowth, make_flowspec
from flowspec_p2p.decoding.flowstate import Calibration, FlowState, StageCost, best_segment, linear_cost
from flowspec_p2p.decoding.flowstats import FlowStats, WalkClock
from flowspec_p2p.decoding.leader import Leader
from flowspec_p2p.decoding.loopback import LoopbackRing
from flowspec_p2p.decoding.pipedec import PipeDecConfig, make_pipedec
from flowspec_p2p.decoding.settings import LeaderSettings
from flowspec_p2p.ledger import Ledger
from flowspec_p2p.model.sampling import SamplingParams
from flowspec_p2p.model.torch_shard import TorchShard
from flowspec_p2p.model.weights import open_source
from flowspec_p2p.speculative.drafter import HeadDrafter, OracleDrafter, TreeShape
from flowspec_p2p.speculative.head import DraftHead
from flowspec_p2p.speculative.tree import DraftTree
from flowspec_p2p.speculative.verify import Verdict
from flowspec_p2p.types import LayerRange

from ..fake_ring import sync_pipeline
from ..ring_fixtures import F64, tiny_parts

GREEDY = SamplingParams()
PROMPTS = [[5, 17, 33, 8, 61, 9, 12, 40, 3, 77, 21], [1, 50, 51, 52, 9], [1, 88, 4, 4, 4, 4, 30, 31, 90]]


@pytest.fixture(scope="module")
def parts(tiny_llama):
    return tiny_parts(tiny_llama)


@pytest.fixture(scope="module")
def four_stages(tiny_llama):
    src = open_source(tiny_llama)
    return [TorchShard.from_source(src, LayerRange(start=i, end=i + 1), embed=i == 0, head=i == 3, dtype=F64).eval()
            for i in range(4)]


def noisy_copy(shard: TorchShard, scale: float, seed: int) -> TorchShard:
    """The target with noise on its layers: its argmax agrees with the target's only part of the time."""
    g = torch.Generator().manual_seed(seed)
    noisy = TorchShard(shard.cfg, shard.layers, embed=True, head=True, dtype=F64)
    noisy.load_state_dict(shard.state_dict())
    noisy.head_t = shard.head_t
    with torch.no_grad():
        for b in noisy.blocks:
            for w in (b.wqkv, b.w13, b.w2, b.wo):
                w.add_(torch.randn(w.shape, generator=g, dtype=F64) * scale)
    return noisy.eval()


def drafter_for(kind, parts):
    if kind == "perfect":
        return OracleDrafter(parts.whole)
    if kind == "partial":
        return OracleDrafter(noisy_copy(parts.whole, 0.08, seed=3))
    torch.manual_seed(0)
    head = DraftHead(parts.whole.cfg).to(F64)
    head.block.reset_parameters(0.1)
    return HeadDrafter(head, parts.head)


async def run(leader, prompt, n, params=GREEDY, stop_ids=frozenset()):
    stats = Ledger(mode="?")
    out = []
    async for chunk in leader.generate(prompt, params=params, max_tokens=n, stop_ids=stop_ids, mode="flowspec",
                                       stats=stats):
        assert chunk
        out += chunk
    return out, stats


CONFIGS = {
    "default": FlowSpecConfig(),
    "reference-like": FlowSpecConfig(expand=TreeShape(total_tokens=32, depth=6, top_k=4, order="score"),
                                     segment_cap=6, redraft_below=0, adaptive=False),
    "tiny-segments": FlowSpecConfig(init=TreeShape(total_tokens=10, depth=4, top_k=3, order="score"),
                                    expand=TreeShape(total_tokens=6, depth=3, top_k=2, order="score"), segment_cap=2),
    "wide": FlowSpecConfig(init=TreeShape(total_tokens=24, depth=6, top_k=5, order="score"),
                           expand=TreeShape(total_tokens=12, depth=6, top_k=4, order="score"), segment_cap=5,
                           in_flight=6, max_unsent=10),
}


@pytest.mark.parametrize(("drafter_kind", "n_stages", "config"), [
    *[(d, n, "default") for d in ("perfect", "random", "partial") for n in (3, 4)],
    *[(d, n, c) for d, n, c in [("perfect", 4, "tiny-segments"), ("partial", 3, "tiny-segments"),
                                ("partial", 4, "wide"), ("random", 3, "wide"),
                                ("partial", 4, "reference-like"), ("perfect", 3, "reference-like")]],
])
async def test_greedy_flowspec_equals_single_device_autoregressive(parts, four_stages, drafter_kind, n_stages,
                                                                   config):
    stages = parts.stages if n_stages == 3 else four_stages
    leader = Leader(parts.head, None, drafter=drafter_for(drafter_kind, parts), modes=[AR, make_flowspec(
        CONFIGS[config])], settings=LeaderSettings(max_context=200, prefill_chunk=4, step_timeout_s=20.0))
    totals = {"continues": 0, "restarts": 0, "walks": 0}
    pipeline, cores = sync_pipeline(stages, leader, F64)
    async with asyncio.TaskGroup() as tg:
        demux = tg.create_task(leader.run())
        await leader.set_pipeline(pipeline)
        for prompt in PROMPTS:
            out, stats = await run(leader, prompt, 48)
            assert out == parts.reference(prompt, 48), (drafter_kind, prompt)
            assert stats.new_tokens == 48
            for k in totals:
                totals[k] += stats.extra[k]
            x = stats.extra  # every walk but the last is followed by one, timed by its outcome (WalkClock)
            assert sum(x.get(f"{k}_gaps", 0) for k in ("continue", "continue_unsent", "restart")) == x["walks"] - 1
            assert x["continues_unsent"] <= x["continues"]
            assert 0 < x["trips"] <= x["segments"]
        demux.cancel()
    assert all(c.counters["errors"] == 0 for c in cores)
    assert all(not c.requests for c in cores), "every request released on every stage"
    if drafter_kind == "perfect":  # the tree always holds the target's choice, unless it ran out of depth
        assert totals["restarts"] <= totals["walks"] // 4
    else:
        assert totals["restarts"] > 0
    if drafter_kind != "random":
        assert totals["continues"] > 0


class RecordingDrafter:
    """A drafter that logs the depth of every tree it yields, level by level, into ``events``."""

    def __init__(self, base, events):
        self.base, self.events = base, events

    def draft_levels(self, shape, partial=True):
        for tree in self.base.draft_levels(shape, partial):
            self.events.append(("level", int(tree.depth.max())))
            yield tree

    def fork(self):  # a request's own drafter, logging into the same events
        return RecordingDrafter(self.base.fork(), self.events)

    def __getattr__(self, name):
        return getattr(self.base, name)


async def recorded_run(parts, events: list, config: FlowSpecConfig, n: int = 24):
    """One greedy request for PROMPTS[0] through the synchronous 3-stage ring, the partial drafter logging each
    drafted level into ``events``. -> (tokens, stats)"""
    leader = Leader(parts.head, None, drafter=RecordingDrafter(drafter_for("partial", parts), events),
                    modes=[make_flowspec(config)], settings=LeaderSettings(max_context=200, prefill_chunk=4))
    pipeline, _ = sync_pipeline(parts.stages, leader, F64)
    async with asyncio.TaskGroup() as tg:
        demux = tg.create_task(leader.run())
        await leader.set_pipeline(pipeline)
        out = await run(leader, PROMPTS[0], n)
        demux.cancel()
    return out


async def test_a_bare_root_goes_out_alone_and_every_drafted_level_goes_out_before_the_next_is_drafted(
        parts, monkeypatch):
    """The first token, and every fresh root after a restart, go down the ring before the leader drafts; each
    drafted level (one draft-head forward) goes out (when worth its stage time: here always) before the next
    level is drafted, so a root's children follow it at once."""
    events: list = []
    claim = FlowState.next_segment

    def next_segment(self, size):
        tag, a, b = claim(self, size)
        events.append(("send", a, b))
        return tag, a, b

    monkeypatch.setattr(FlowState, "next_segment", next_segment)
    # the synchronous ring returns every segment at once, which would stop each draft after its first level
    # (the next test): here the drafts run to their full depth
    monkeypatch.setattr(FlowState, "live_returned", lambda self, returned: False)
    out, stats = await recorded_run(parts, events, FlowSpecConfig(min_value=0.0))  # children always worth sending
    assert out == parts.reference(PROMPTS[0], 24)
    assert stats.extra["restarts"] > 0
    assert events[:2] == [("send", 0, 1), ("level", 1)], events[:4]
    assert events[2][:2] == ("send", 1), events[:4]
    bare = [i for i, e in enumerate(events) if e[0] == "send" and e[1:] == (0, 1)]
    assert len(bare) >= stats.extra["restarts"]
    for i in bare:  # a bare root's children go out before its next level is drafted
        j = next((k for k in range(i + 1, len(events)) if events[k][0] == "level"), None)
        if j is not None and events[j][1] == 1 and j + 1 < len(events) and events[j + 1][0] != "level":
            assert events[j + 1][0] == "send", events[i : j + 3]
    deeper = [i for i, e in enumerate(events) if e[0] == "level" and e[1] > 1]
    assert deeper, "some drafts went deeper than one level"
    for i in deeper:  # the shallower level before it went out first (a draft's last tree may repeat its depth)
        prev = events[i - 1]
        assert prev[0] == "send" or (prev[0] == "level" and prev[1] >= events[i][1]), events[i - 3 : i + 1]


async def test_a_returned_live_segment_stops_the_draft_for_its_walk(parts):
    """With every segment back at once (a synchronous ring), each draft stops after its first level: the walk of
    the returned root comes before deeper drafting. The output is still the target's."""
    events: list = []
    out, _ = await recorded_run(parts, events, FlowSpecConfig(min_value=0.0, redraft_below=0))
    assert out == parts.reference(PROMPTS[0], 24)
    levels = [e[1] for e in events if e[0] == "level"]
    assert levels
    assert max(levels) == 1, levels


@pytest.mark.parametrize("hops", ["memory", "ws"])
async def test_flowspec_over_the_async_ring_equals_single_device(parts, hops):
    """The same through real stage workers (threads, queues, and websockets on port 0)."""
    leader = Leader(parts.head, None, drafter=drafter_for("partial", parts), modes=[make_flowspec(CONFIGS["wide"])],
                    settings=LeaderSettings(max_context=200, prefill_chunk=4, step_timeout_s=20.0))
    async with LoopbackRing(parts.stages, leader, hops=hops, wire_dtype=F64) as ring:
        out, stats = await run(leader, PROMPTS[0], 40)
        assert out == parts.reference(PROMPTS[0], 40)
        assert stats.extra["prunes"] > 0
        assert all(w.snapshot()["errors"] == 0 for w in ring.workers)
        # every stage reported its busy time per segment, and the leader measured its stage cost from them
        assert stats.extra["stage_ms"]
        assert all(t > 0 for t in stats.extra["stage_ms"].values())


async def test_stop_token_and_budget_end_the_reply_exactly(parts):
    leader = Leader(parts.head, None, drafter=OracleDrafter(parts.whole), modes=[make_flowspec()],
                    settings=LeaderSettings(max_context=200, prefill_chunk=4))
    async with LoopbackRing(parts.stages, leader, hops="memory", wire_dtype=F64):
        for prompt in PROMPTS:
            ref = parts.reference(prompt, 60)
            stop = frozenset({ref[7]})  # a token the reply reaches: it must end right there
            out, _ = await run(leader, prompt, 60, stop_ids=stop)
            assert out == parts.reference(prompt, 60, stop_ids=stop)
            assert out[-1] in stop
            for n in (1, 2, 5):
                assert (await run(leader, prompt, n))[0] == ref[:n]


@pytest.mark.parametrize(("drafter_kind", "n_stages", "width"),
                         [("perfect", 3, 2), ("partial", 4, 3), ("random", 3, 2)])
async def test_greedy_pipedec_equals_single_device_autoregressive(parts, four_stages, drafter_kind, n_stages, width):
    """PipeDec (one tree level per pipeline step) shares FlowSpec's machinery and is lossless too."""
    stages = parts.stages if n_stages == 3 else four_stages
    leader = Leader(parts.head, None, drafter=drafter_for(drafter_kind, parts),
                    modes=[make_pipedec(PipeDecConfig(width=width, max_depth=6))],
                    settings=LeaderSettings(max_context=200, prefill_chunk=4, step_timeout_s=20.0))
    pipeline, cores = sync_pipeline(stages, leader, F64)
    async with asyncio.TaskGroup() as tg:
        demux = tg.create_task(leader.run())
        await leader.set_pipeline(pipeline)
        for prompt in PROMPTS[:2]:
            out = []
            stats = Ledger(mode="?")
            async for chunk in leader.generate(prompt, params=GREEDY, max_tokens=40, stop_ids=frozenset(),
                                               mode="pipedec", stats=stats):
                out += chunk
            assert out == parts.reference(prompt, 40), (drafter_kind, prompt)
            assert stats.extra["walks"] > 0
        demux.cancel()
    assert all(c.counters["errors"] == 0 for c in cores)


def test_best_segment_trades_expected_acceptance_against_row_cost():
    # a certain root and near-certain children: worth sending together even at CPU row cost
    assert best_segment([1.0, 0.9, 0.8, 0.7], linear_cost(0.45), cap=4) == 4
    # a weak draft: the root alone (its extra rows cost more stage time than they are expected to return)
    assert best_segment([1.0, 0.1, 0.05], linear_cost(0.45), cap=4) == 1
    # free rows (a GPU): take everything up to the cap; the cap and the unsent count bound it
    assert best_segment([1.0, 0.1, 0.05, 0.01, 0.01], linear_cost(0.0), cap=4) == 4
    assert best_segment([0.3, 0.2], linear_cost(0.0), cap=8) == 2
    assert best_segment([], linear_cost(0.45), cap=4) == 0
    assert best_segment([1.0, 0.5], lambda k: float("nan"), cap=4) == 1  # broken estimates never stall the ring
    # the break-even row: adding p is worth it iff p > row_cost * (current mean per unit cost)
    assert best_segment([1.0, 0.46], linear_cost(0.45), cap=2) == 2
    assert best_segment([1.0, 0.44], linear_cost(0.45), cap=2) == 1


def test_stage_cost_is_measured_from_the_slowest_stage_and_falls_back_to_the_prior():
    cost = StageCost(row_cost=0.5, min_samples=3)
    assert cost.cost_fn()(3) == pytest.approx(2.0)  # nothing measured: the prior 1 + 0.5 (k - 1)
    for t in (0.010, 0.011, 0.012):
        cost.observe(1, [0.002, t, 0.004])  # the slowest stage's seconds count
    cost.observe(0, [1.0])  # a segment whose rows all died costs nothing to learn from
    cost.observe(4, [])  # a ring whose stages report nothing
    cost.observe(4, [float("nan")])  # nonsense is ignored
    assert cost.cost_fn()(2) == pytest.approx(1.5)  # one row measured, two not yet: prior slope
    for t in (0.016, 0.0165, 0.017):
        cost.observe(4, [t])
    fn = cost.cost_fn()
    assert fn(1) == 1.0
    assert fn(4) == pytest.approx(0.0165 / 0.011)
    assert fn(2) == pytest.approx(1.0 + (0.0165 / 0.011 - 1.0) / 3)  # interpolated between measured sizes
    assert fn(6) == pytest.approx(0.0165 / 0.011 + 2 * 0.5)  # beyond: the prior's slope
    # measured cheap rows make a bigger segment pay where the prior would not
    probs = [1.0, 0.3, 0.25, 0.2]
    assert best_segment(probs, linear_cost(0.5), cap=4) == 1
    assert best_segment(probs, fn, cap=4) == 4
    for _ in range(20):  # a sliding window: the stages got slower per row
        cost.observe(4, [0.044])
    assert cost.cost_fn()(4) == pytest.approx(4.0)


def test_calibration_learns_per_level_acceptance_from_walks():
    # root -> a (0.8) -> b (0.5 of a's path); root -> c (0.1)
    tree = DraftTree.from_lists([5, 6, 7, 8], [-1, 0, 1, 0],
                                scores=[0.0, math.log(0.8), math.log(0.8) + math.log(0.5), math.log(0.1)])
    cal = Calibration()
    assert cal.probs(tree, 0, 4) == pytest.approx([1.0, 0.8, 0.4, 0.1])
    # the target's next token at the root was none of its drafted children (mass 0.9): a miss
    cal.update(tree, Verdict(accepted=[0], token=99, next_child=None))
    r = 1.0 / 1.9
    assert cal.ratio == pytest.approx(r)
    assert cal.probs(tree, 1, 4) == pytest.approx([0.8 * r, 0.4 * r * r, 0.1 * r])
    assert cal.probs(tree, 0, 1) == [1.0]  # the root is always decided
    # root -> a accepted, then the next token is a's drafted child b (not yet verified): two hits
    cal.update(tree, Verdict(accepted=[0, 1], token=7, next_child=2))
    assert cal.hits == 3.0
    assert cal.mass == pytest.approx(1.0 + 0.9 + 0.9 + 0.5)
    # an accepted stop token ends the reply: no event at it
    cal.update(tree, Verdict(accepted=[0, 1], token=None, next_child=None))
    assert cal.hits == 4.0
    assert cal.mass == pytest.approx(1.0 + 0.9 + 0.9 + 0.5 + 0.9)
    for _ in range(50):  # keeps hitting: estimates scale up, capped at 1
        cal.update(tree, Verdict(accepted=[0, 1], token=7, next_child=2))
    assert cal.probs(tree, 1, 2) == [1.0]



def test_expansion_depth_follows_the_measured_hit_rate():
    tree = DraftTree.from_lists([5, 6, 7], [-1, 0, 1], scores=[0.0, math.log(0.5), math.log(0.25)])
    cal = Calibration()
    assert cal.useful_depth(0.15, 4) == 4  # no evidence yet: the full depth
    miss = Verdict(accepted=[0], token=99, next_child=None)  # the root's next token was not drafted
    hit = Verdict(accepted=[0, 1], token=7, next_child=2)  # two levels right
    for _ in range(3):
        cal.update(tree, hit)
        cal.update(tree, miss)
    assert cal.hit_rate == pytest.approx(7 / 10)
    assert cal.useful_depth(0.15, 4) == 4  # 0.7^5 < 0.15 <= 0.7^4... capped at 4 anyway
    for _ in range(6):
        cal.update(tree, miss)
    assert cal.hit_rate == pytest.approx(7 / 16)  # 0.44: a path of 2 levels still pays (0.19), 3 not (0.08)
    assert cal.useful_depth(0.15, 4) == 2
    for _ in range(40):
        cal.update(tree, miss)
    assert cal.useful_depth(0.15, 4) == 1  # never below one level
    assert cal.useful_depth(0.0, 4) == 4  # 0 turns it off


def test_a_walk_is_a_continue_to_a_sent_child_a_continue_to_an_unsent_one_or_a_restart():
    tree = DraftTree.from_lists([5, 6, 7], [-1, 0, 0], scores=[0.0, -0.5, -1.0])
    for child, token, outcome in ((1, 6, "continue"), (2, 7, "continue_unsent"), (None, 9, "restart")):
        state, stats = FlowState(tree=tree, committed=10), FlowStats()
        state.next_segment(2)  # root and node 1 went out; node 2 did not
        state.feats = [torch.zeros(4)]
        stats.walked()
        state.apply(Verdict([0], token, child))
        stats.applied(state.outcome)
        assert state.outcome == outcome
        assert state.tree.token_list[0] == token
        assert (stats.counters["continues"], stats.counters["continues_unsent"], stats.counters["restarts"]) == (
            int(outcome != "restart"), int(outcome == "continue_unsent"), int(outcome == "restart"))
    clock = WalkClock()
    for t, outcome in ((0.0, "continue"), (0.1, "restart"), (0.4, "continue"), (0.45, None)):  # the last ends
        clock.walked(t)
        if outcome:
            clock.outcome(outcome)
    assert clock.sums == {"continue_gap_s": pytest.approx(0.15), "continue_gaps": 2,
                          "restart_gap_s": pytest.approx(0.3), "restart_gaps": 1}


def test_flowspec_growth_sends_a_weak_segment_only_into_an_empty_ring():
    # root, a likely child (0.9), then two unlikely grandchildren (0.05 each of the child's path)
    tree = DraftTree.from_lists([5, 6, 7, 8], [-1, 0, 1, 1],
                                scores=[0.0, math.log(0.9), math.log(0.9 * 0.05), math.log(0.9 * 0.05)])
    growth = FlowSpecGrowth(FlowSpecConfig(segment_cap=4, row_cost=0.45, min_value=0.5))
    state = FlowState(tree=tree, committed=10)
    assert growth.segment(state, live=0) == 2  # root + likely child; the grandchildren would not pay their rows
    state.next_segment(2)
    assert growth.segment(state, live=1) == 0  # 0.045 expected tokens: not worth delaying the next root
    assert growth.segment(state, live=0) == 2  # an idle ring takes them anyway (equal odds: both rows pay)
    eager = FlowSpecGrowth(FlowSpecConfig(segment_cap=4, min_value=0.0))
    assert eager.segment(state, live=3) == 2
    fixed = FlowSpecGrowth(FlowSpecConfig(segment_cap=4, adaptive=False))
    assert fixed.segment(state, live=3) == 2  # the rest of the tree, up to the cap


def test_expansion_width_follows_where_the_targets_choices_rank():
    # root with four children by score: the target keeps choosing the second best
    tree = DraftTree.from_lists([5, 6, 7, 8, 9], [-1, 0, 0, 0, 0],
                                scores=[0.0, math.log(0.4), math.log(0.3), math.log(0.2), math.log(0.1)])
    cal = Calibration()
    second = Verdict(accepted=[0, 2], token=3, next_child=None)
    assert cal.useful_top_k(0.9, 4) == 4  # no evidence yet: the full width
    for _ in range(10):
        cal.update(tree, second)
    assert cal.useful_top_k(0.9, 4) == 2  # ranks 0 and 1 hold every hit
    for _ in range(10):
        cal.update(tree, Verdict(accepted=[0, 4], token=3, next_child=None))  # now the fourth
    assert cal.useful_top_k(0.9, 4) == 4
    assert cal.useful_top_k(0.5, 4) == 2
    assert cal.useful_top_k(0.0, 4) == 4  # 0 turns it off
    # hits at nodes drafted narrower than max_k do not count: they cannot show what a narrow draft missed
    narrow = Calibration()
    small = DraftTree.from_lists([5, 6, 7], [-1, 0, 0], scores=[0.0, math.log(0.6), math.log(0.3)])
    for _ in range(20):
        narrow.update(small, Verdict(accepted=[0, 1], token=3, next_child=None))
    assert narrow.useful_top_k(0.9, 4) == 4
