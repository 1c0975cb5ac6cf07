"""The leader over a 3-stage ring: `ar` and `chunk` equal single-device decoding; failures end requests cleanly."""

import asyncio
import threading

import pytest
import torch

from flowspec_p2p.decoding.ar import AR
from flowspec_p2p.decoding.chunk import CHUNK, make_chunk
from flowspec_p2p.decoding.context import Pipeline
from flowspec_p2p.decoding.leader import Leader
from flowspec_p2p.decoding.loopback import LoopbackRing
from flowspec_p2p.decoding.settings import LeaderSettings
from flowspec_p2p.errors import Busy, InvalidRequest, NotReady, PeerGone, StageFailed
from flowspec_p2p.ledger import Ledger
from flowspec_p2p.model.sampling import SamplingParams
from flowspec_p2p.pipeline.transport import QueueSender
from flowspec_p2p.speculative.drafter import HeadDrafter, OracleDrafter, TreeShape
from flowspec_p2p.speculative.head import DraftHead

from ..ring_fixtures import F64, tiny_parts

GREEDY = SamplingParams()
NO_STOP = frozenset()


@pytest.fixture(scope="module")
def parts(tiny_llama):
    return tiny_parts(tiny_llama)


@pytest.fixture(scope="module")
def random_head(parts):
    torch.manual_seed(0)
    head = DraftHead(parts.whole.cfg).to(F64)
    head.block.reset_parameters(0.1)
    return head


def make_leader(parts, drafter=None, **settings):
    settings = {"max_context": 160, "prefill_chunk": 4, "step_timeout_s": 10.0, **settings}
    return Leader(parts.head, None, drafter=drafter, modes=[AR, CHUNK], settings=LeaderSettings(**settings))


async def run(leader, prompt, n, mode=None, params=GREEDY, stop_ids=NO_STOP):
    stats = Ledger(mode="?")
    out = []
    async for chunk in leader.generate(prompt, params=params, max_tokens=n, stop_ids=stop_ids, mode=mode,
                                       stats=stats):
        assert chunk
        out += chunk
    return out, stats


PROMPT = [5, 17, 33, 8, 61, 9, 12, 40, 3, 77, 21]


@pytest.mark.parametrize(("hops", "plain", "local_first", "chunk"), [
    ("ws", False, False, 4),  # stage 1 embeds, stage 3 norms; real websockets
    ("ws", True, False, 5),  # the leader embeds (hidden on the wire) and norms the returned hidden states
    ("memory", False, True, 64),  # stage 1 runs inside the leader; the prompt in one prefill chunk
])
async def test_greedy_ar_through_three_stages_equals_single_device(parts, hops, plain, local_first, chunk):
    leader = make_leader(parts, prefill_chunk=chunk)
    shards = parts.stages_plain if plain else parts.stages
    async with LoopbackRing(shards, leader, hops=hops, local_first=local_first, wire_dtype=F64) as ring:
        out, stats = await run(leader, PROMPT, 40, mode="ar")
        assert leader.pipeline.takes == ("hidden" if plain else "tokens")
        assert out == parts.reference(PROMPT, 40)
        assert (stats.mode, stats.new_tokens, stats.steps, stats.tau) == ("ar", 40, 40, 1.0)
        assert stats.prefill_s > 0
        assert stats.decode_s > 0
        out2, _ = await run(leader, PROMPT[:5], 10, mode="ar")  # a second request reuses the ring
        assert out2 == parts.reference(PROMPT[:5], 10)
        assert all(w.snapshot()["errors"] == 0 for w in ring.workers)


async def test_seeded_sampling_through_the_ring_equals_single_device_sampling(parts):
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, seed=7)
    leader = make_leader(parts)
    async with LoopbackRing(parts.stages, leader, hops="memory", wire_dtype=F64):
        out, _ = await run(leader, PROMPT, 30, mode="ar", params=params)
    assert out == parts.reference(PROMPT, 30, params)


@pytest.mark.parametrize(("drafter_kind", "hops"), [("oracle", "memory"), ("head", "ws"), ("head", "memory")])
async def test_greedy_chunk_pp_equals_single_device(parts, random_head, drafter_kind, hops):
    drafter = OracleDrafter(parts.whole) if drafter_kind == "oracle" else HeadDrafter(random_head, parts.whole)
    leader = make_leader(parts, drafter)
    async with LoopbackRing(parts.stages, leader, hops=hops, wire_dtype=F64) as ring:
        out, stats = await run(leader, PROMPT, 40, mode="chunk")
        assert out == parts.reference(PROMPT, 40)
        assert stats.mode == "chunk"
        assert stats.new_tokens == 40
        if drafter_kind == "oracle":  # the oracle's drafts are always accepted: several tokens per round
            assert stats.tau > 2
        assert stats.extra["segments"] == 4
        out2, _ = await run(leader, PROMPT[:3], 4, mode="ar")  # FIFO: every earlier prune has been applied
        assert out2 == parts.reference(PROMPT[:3], 4)
        assert all(w.snapshot()["errors"] == 0 for w in ring.workers)
        assert all(w.snapshot()["prunes"] == stats.steps - 1 for w in ring.workers)


async def test_chunk_pp_with_more_segments_than_nodes_and_a_stop_token(parts):
    leader = Leader(parts.head, None, drafter=OracleDrafter(parts.whole), settings=LeaderSettings(max_context=160),
                    modes=[AR, make_chunk(TreeShape(total_tokens=3, depth=2, top_k=2), segments=8)])
    prompt = [5, 6, 7, 8, 9, 10, 11]
    ref = parts.reference(prompt, 40, stop_ids=frozenset({2}))
    assert ref[-1] == 2, "the tiny model should emit EOS within 40 tokens for this prompt"
    async with LoopbackRing(parts.stages, leader, hops="memory", wire_dtype=F64):
        out, _ = await run(leader, prompt, 40, mode="chunk", stop_ids=frozenset({2}))
    assert out == ref


async def test_modes_are_validated_and_the_default_is_the_fastest_available(parts, random_head):
    plain = make_leader(parts)
    assert plain.available_modes() == ["ar", "auto"]
    assert plain.default_mode() == "auto"
    with pytest.raises(InvalidRequest, match="needs a draft head"):
        plain.check(5, 5, "chunk")
    with pytest.raises(InvalidRequest, match="unknown decoding mode"):
        plain.check(5, 5, "warp")
    spec = make_leader(parts, HeadDrafter(random_head, parts.whole))
    assert spec.default_mode() == "auto"
    assert make_leader(parts, HeadDrafter(random_head, parts.whole),
                       mode_preference=("flowspec", "chunk", "ar")).default_mode() == "chunk"
    assert make_leader(parts, HeadDrafter(random_head, parts.whole), default_mode="ar").default_mode() == "ar"


@pytest.mark.parametrize(("stage", "reason"), [
    (1, "pipeline link out stage1 down"),  # the leader's own link to stage 1 breaks
    (2, "stage 3 lost its link from stage2"),  # stage 3 reports its broken inbound link downstream
    (3, "pipeline link in stage3 down"),  # the return link into the leader breaks
])
async def test_a_stage_vanishing_mid_request_fails_it_with_peer_gone(parts, stage, reason):
    """... once no new pipeline comes within resume_timeout_s (no re-plan here)."""
    leader = make_leader(parts, step_timeout_s=5.0, resume_timeout_s=0.2)
    async with LoopbackRing(parts.stages, leader, hops="ws", wire_dtype=F64) as ring:
        gen = leader.generate(PROMPT, params=GREEDY, max_tokens=100, stop_ids=NO_STOP, mode="ar")
        await anext(gen)
        await ring.stop_stage(stage)
        async def drain():
            async with asyncio.timeout(4):
                async for _ in gen:
                    pass

        with pytest.raises(PeerGone, match=reason):
            await drain()
        assert leader.counters["failed"] == 1
        assert leader.counters["resumed"] == 0


async def test_a_silent_stage_fails_the_request_after_the_step_timeout(parts):
    leader = make_leader(parts, step_timeout_s=0.3, resume_attempts=0)
    release = threading.Event()
    async with LoopbackRing(parts.stages, leader, hops="memory", wire_dtype=F64) as ring:
        core = ring.workers[1].core
        real = core.handle
        core.handle = lambda *a: (release.wait(5), real(*a))[1]  # hangs (in the worker thread)
        try:
            with pytest.raises(PeerGone, match=r"no reply from the pipeline within 0\.3 s"):
                async with asyncio.timeout(3):
                    await run(leader, PROMPT, 5, mode="ar")
        finally:
            release.set()


async def test_a_stage_error_fails_the_request_with_its_reason(parts):
    leader = make_leader(parts, max_context=400)
    async with LoopbackRing(parts.stages, leader, hops="memory", wire_dtype=F64, capacity=20):
        with pytest.raises(StageFailed, match="exceeds this stage's KV capacity"):
            await run(leader, PROMPT, 30, mode="ar")
        out, _ = await run(leader, PROMPT[:3], 5, mode="ar")  # the ring still serves
        assert out == parts.reference(PROMPT[:3], 5)


async def test_requests_wait_for_a_pipeline_then_get_not_ready(parts):
    leader = make_leader(parts, ready_timeout_s=0.05)
    run_task = asyncio.get_running_loop().create_task(leader.run())
    try:
        with pytest.raises(NotReady):
            await run(leader, PROMPT, 3, mode="ar")
        assert leader.counters["not_ready"] == 1
    finally:
        run_task.cancel()
        await asyncio.gather(run_task, return_exceptions=True)


async def test_requests_in_flight_are_bounded_and_so_is_the_queue(parts):
    leader = make_leader(parts, max_requests=2, max_waiting=1, queue_timeout_s=0.2)
    async with LoopbackRing(parts.stages, leader, hops="memory", wire_dtype=F64):
        first = leader.generate(PROMPT, params=GREEDY, max_tokens=50, stop_ids=NO_STOP, mode="ar")
        second = leader.generate(PROMPT[:4], params=GREEDY, max_tokens=50, stop_ids=NO_STOP, mode="ar")
        await anext(first)  # both hold a turn while suspended
        await anext(second)
        assert leader.snapshot()["admission"]["in_flight"] == 2
        waiting = asyncio.get_running_loop().create_task(run(leader, PROMPT, 3, mode="ar"))
        await asyncio.sleep(0.02)
        with pytest.raises(Busy, match="already waiting"):
            await run(leader, PROMPT, 3, mode="ar")
        with pytest.raises(Busy, match=r"waited 0\.2 s"):
            await waiting
        await first.aclose()  # the client went away: the turn passes on and the stages are released
        out, _ = await run(leader, PROMPT, 3, mode="ar")
        assert out == parts.reference(PROMPT, 3)
        await second.aclose()
        assert leader.snapshot()["admission"]["in_flight"] == 0


async def test_replanning_fails_the_request_in_flight_and_later_requests_use_the_new_pipeline(parts):
    """With resumption off (``resume_attempts`` 0): the request in flight fails."""
    leader = make_leader(parts, ready_timeout_s=5.0, resume_attempts=0)
    async with LoopbackRing(parts.stages, leader, hops="memory", wire_dtype=F64) as ring:
        gen = leader.generate(PROMPT, params=GREEDY, max_tokens=50, stop_ids=NO_STOP, mode="ar")
        await anext(gen)
        pipeline = leader.pipeline
        await leader.set_pipeline(None)
        with pytest.raises(PeerGone, match="re-planning"):
            await anext(gen)
        assert pipeline.sender.closed
        later = asyncio.get_running_loop().create_task(run(leader, PROMPT, 5, mode="ar"))
        await asyncio.sleep(0.05)
        assert not later.done()  # waits for a pipeline
        await leader.set_pipeline(Pipeline(QueueSender(ring.workers[0].inbox, "stage1"), epoch=1, stages=3))
        out, _ = await later
        assert out == parts.reference(PROMPT, 5)


def resume_modes(parts, random_head):
    from flowspec_p2p.decoding.flowspec import make_flowspec
    from flowspec_p2p.decoding.pipedec import make_pipedec

    return [AR, CHUNK, make_pipedec(), make_flowspec()], HeadDrafter(random_head, parts.head)


SEEDED_T1 = SamplingParams(temperature=1.0, seed=11)


@pytest.mark.parametrize("params", [GREEDY, SEEDED_T1], ids=["greedy", "seeded-t1"])
@pytest.mark.parametrize("mode", ["ar", "chunk", "pipedec", "flowspec"])
async def test_a_request_whose_pipeline_is_replanned_resumes_on_the_next_one_losslessly(parts, random_head, mode,
                                                                                        params):
    """A re-plan mid-request (a device left): the request waits for the next pipeline and continues from the tokens
    it committed; the output equals single-device decoding token for token (float64), in every mode: greedy, and
    seeded at T=1 too, since a sampled token depends only on (seed, position)."""
    modes, drafter = resume_modes(parts, random_head)
    leader = Leader(parts.head, None, drafter=drafter, modes=modes, settings=LeaderSettings(
        max_context=160, prefill_chunk=4, step_timeout_s=10.0, resume_timeout_s=5.0))
    n = 40
    async with LoopbackRing(parts.stages, leader, hops="memory", wire_dtype=F64) as ring:
        stats = Ledger(mode="?")
        gen = leader.generate(PROMPT, params=params, max_tokens=n, stop_ids=NO_STOP, mode=mode, stats=stats)
        out = list(await anext(gen))
        out += await anext(gen)
        await leader.set_pipeline(None)  # the coordinator re-plans: the request's pipeline is gone
        nxt = asyncio.get_running_loop().create_task(anext(gen))
        await asyncio.sleep(0.05)
        assert not nxt.done()  # waits for the next pipeline
        before = len(out)
        await leader.set_pipeline(Pipeline(QueueSender(ring.workers[0].inbox, "stage1"), epoch=1, stages=3))
        out += await nxt
        async for chunk in gen:
            out += chunk
    assert out == parts.reference(PROMPT, n, params)
    assert 0 < before < n
    assert stats.new_tokens == n
    assert stats.extra["resumed"] == 1
    assert stats.prompt_tokens == len(PROMPT)
    assert leader.counters["resumed"] == 1
    assert leader.counters["completed"] == 1


async def test_every_mode_gives_the_same_seeded_text(parts, random_head):
    """Sampling at T=1 with a seed: the token at each position comes from one uniform of (seed, position), so AR and
    every speculative mode, whatever tree they draft, give the single-device text."""
    modes, drafter = resume_modes(parts, random_head)
    leader = Leader(parts.head, None, drafter=drafter, modes=modes, settings=LeaderSettings(
        max_context=160, prefill_chunk=4, step_timeout_s=10.0))
    async with LoopbackRing(parts.stages, leader, hops="memory", wire_dtype=F64):
        outs = {m: (await run(leader, PROMPT, 30, mode=m, params=SEEDED_T1))[0]
                for m in ("ar", "chunk", "pipedec", "flowspec")}
    ref = parts.reference(PROMPT, 30, SEEDED_T1)
    assert all(o == ref for o in outs.values()), outs
    other = parts.reference(PROMPT, 30, SEEDED_T1.model_copy(update={"seed": 12}))
    assert other != ref


async def test_resumption_gives_up_after_resume_attempts(parts):
    leader = make_leader(parts, resume_attempts=1, resume_timeout_s=5.0)
    async with LoopbackRing(parts.stages, leader, hops="memory", wire_dtype=F64) as ring:
        gen = leader.generate(PROMPT, params=GREEDY, max_tokens=60, stop_ids=NO_STOP, mode="ar")
        await anext(gen)
        for epoch in (1, 2):
            await leader.set_pipeline(None)
            task = asyncio.get_running_loop().create_task(anext(gen))
            await asyncio.sleep(0.05)
            await leader.set_pipeline(Pipeline(QueueSender(ring.workers[0].inbox, "stage1"), epoch=epoch, stages=3))
            if epoch == 1:
                await task  # resumed once
        with pytest.raises(PeerGone, match="re-planning"):
            await task
    assert (leader.counters["resumed"], leader.counters["failed"]) == (1, 1)


def test_an_unseeded_sampled_request_gets_one_seed_for_all_its_attempts():
    from flowspec_p2p.decoding.leader import _job_params

    seeded = SamplingParams(temperature=1.0, seed=7)
    assert _job_params(seeded) is seeded
    assert _job_params(GREEDY) is GREEDY
    assert _job_params(SamplingParams(temperature=1.0)).seed is not None


async def test_a_request_waiting_to_resume_can_be_cancelled(parts):
    leader = make_leader(parts, resume_timeout_s=5.0)
    async with LoopbackRing(parts.stages, leader, hops="memory", wire_dtype=F64) as ring:
        gen = leader.generate(PROMPT, params=GREEDY, max_tokens=60, stop_ids=NO_STOP, mode="ar")
        await anext(gen)
        await leader.set_pipeline(None)
        task = asyncio.get_running_loop().create_task(anext(gen))
        await asyncio.sleep(0.05)
        task.cancel()  # the client left while the request waited for the next pipeline
        with pytest.raises(asyncio.CancelledError):
            await task
        assert leader.counters["cancelled"] == 1
        await leader.set_pipeline(Pipeline(QueueSender(ring.workers[0].inbox, "stage1"), epoch=1, stages=3))
        out, _ = await run(leader, PROMPT, 5, mode="ar")  # the turn was released
        assert out == parts.reference(PROMPT, 5)


async def test_auto_runs_each_mode_then_the_fastest_and_equals_ar(parts):
    """auto on a leader offering ar and flowspec (perfect draft): each untried mode first, then the one measured
    fastest; every reply equals single-device AR, and its stats say which mode ran and why."""
    from flowspec_p2p.decoding.flowspec import FLOWSPEC
    from flowspec_p2p.model.generate import ARDecoder, generate_ids

    leader = Leader(parts.head, None, drafter=OracleDrafter(parts.whole), modes=[AR, FLOWSPEC],
                    settings=LeaderSettings(max_context=160, prefill_chunk=4, step_timeout_s=10.0,
                                            auto={"min_tokens": 8, "recheck": 2}))
    ref, _ = generate_ids(ARDecoder(parts.whole), PROMPT, GREEDY, 24)
    assert leader.default_mode() == "auto"
    chose = []
    async with LoopbackRing(parts.stages, leader, hops="memory", wire_dtype=F64):
        for _ in range(6):
            out, stats = await run(leader, PROMPT, 24)
            assert out == ref
            assert stats.mode == "auto"
            chose.append((stats.extra["auto"]["chose"], stats.extra["auto"]["reason"]))
    assert chose[:2] == [("flowspec", "untried"), ("ar", "untried")]
    assert {reason for _, reason in chose[2:]} <= {"fastest", "recheck"}
    rates = leader.snapshot()["auto"]
    (key,) = rates
    assert all(m["samples"] >= 1 for m in rates[key].values())
    fastest = max(rates[key], key=lambda m: rates[key][m]["tokens_per_s"])
    assert sum(m == fastest for m, _ in chose[2:]) >= 2


def test_a_request_that_gets_back_more_than_it_sent_fails_instead_of_growing_its_queue(parts):
    from flowspec_p2p.decoding.context import RETURN_SLACK, ModeContext
    from flowspec_p2p.pipeline.messages import Release as Rel
    from flowspec_p2p.pipeline.transport import Frame

    leader = make_leader(parts)
    ctx = ModeContext(leader.parts, Pipeline(QueueSender(asyncio.Queue(), "s1"), epoch=0, stages=1), "r", [1, 2],
                      GREEDY, 4, frozenset(), Ledger(mode="ar"))
    for _ in range(RETURN_SLACK + 5):
        ctx.deliver(Frame(Rel(request_id="r", seq=0), {}, "last"))
    assert isinstance(ctx.error, StageFailed)
    assert ctx.queue.qsize() == 1 + RETURN_SLACK + 1  # frames up to the limit (nothing sent: 1 + slack), the failure


async def test_a_request_reaching_its_deadline_ends_with_what_it_decided_and_frees_every_stage(parts):
    import time

    leader = make_leader(parts, max_requests=1, max_waiting=2, prompt_cache=False)
    async with LoopbackRing(parts.stages, leader, hops="memory", wire_dtype=F64) as ring:
        core = ring.workers[1].core
        real = core.handle
        core.handle = lambda *a, **k: (time.sleep(0.02), real(*a, **k))[1]  # a slow device: < 50 tokens a second
        stats = Ledger(mode="?")
        out = []
        gen = leader.generate(PROMPT, params=GREEDY, max_tokens=100, stop_ids=NO_STOP, mode="ar", stats=stats,
                              deadline=time.monotonic() + 0.5)
        waiter = asyncio.get_running_loop().create_task(anext(leader.generate(
            PROMPT, params=GREEDY, max_tokens=3, stop_ids=NO_STOP, mode="ar", deadline=time.monotonic() + 0.2)))
        async with asyncio.timeout(5):
            async for chunk in gen:
                out += chunk
        assert 0 < len(out) < 100
        assert out == parts.reference(PROMPT, len(out))  # what it decided by then, unchanged
        assert stats.deadline_reached
        assert stats.outcome == "completed"
        with pytest.raises(Busy):  # its deadline passed while it waited for the one turn
            await waiter
        await asyncio.sleep(0.1)  # the Release travels the ring
        assert all(not w.core.requests for w in ring.workers)
        assert leader.snapshot()["admission"]["in_flight"] == 0
        core.handle = real
        done, _ = await run(leader, PROMPT, 3, mode="ar")
        assert done == parts.reference(PROMPT, 3)


async def test_auto_learns_a_burst_of_requests_under_the_load_they_decoded_at(parts):
    """Four requests started together: the first sees none of the others as it starts, but all four decode four at a
    time, so auto's rate of that time is kept under the load bucket 3-4 (not 1 and 2)."""
    leader = make_leader(parts, max_requests=4, auto={"min_tokens": 8})
    async with LoopbackRing(parts.stages, leader, hops="memory", wire_dtype=F64):
        for _ in range(2):
            outs = await asyncio.gather(*(run(leader, PROMPT[: 6 + i], 24, mode="auto") for i in range(4)))
            assert [o for o, _ in outs] == [parts.reference(PROMPT[: 6 + i], 24) for i in range(4)]
    seconds = {key: m["ar"]["seconds"] for key, m in leader.snapshot()["auto"].items()}
    busiest = max(seconds, key=seconds.get)
    assert busiest.endswith("load 3-4")
    assert seconds[busiest] > 2 * sum(v for k, v in seconds.items() if k != busiest)
