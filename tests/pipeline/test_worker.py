"""The async stage worker: in-order application, off-loop compute, slowdown emulation, timelines, link loss."""

import asyncio
import time

import pytest
import torch

from flowspec_p2p.pipeline import worker as worker_mod
from flowspec_p2p.pipeline.emulation import ComputeEmulation, EmulatedDevice
from flowspec_p2p.pipeline.messages import Forward, Prune, Release, StageError
from flowspec_p2p.pipeline.stage import StageCore
from flowspec_p2p.pipeline.transport import Frame, LinkDown, QueueSender
from flowspec_p2p.pipeline.worker import StageWorker

from ..ring_fixtures import F64, tiny_parts


@pytest.fixture(scope="module")
def shard(tiny_llama):
    return tiny_parts(tiny_llama).stages[1]  # layers [1, 3): hidden in, hidden out


def hidden(m):
    return {"hidden": torch.randn(m, 64, dtype=F64)}


def fwd(rid, seq, m, first=0, commit=True, start=0):
    parents = list(range(first - 1, first + m - 1)) if commit else [-1] * m
    return Forward(request_id=rid, seq=seq, first=first, parents=parents,
                   positions=list(range(start, start + m)) if commit else [start] * m, commit=commit)


class Running:
    """A worker whose successor is an in-memory queue, run as a task for the test's duration."""

    def __init__(self, shard, successor=None, **kw):
        self.out = asyncio.Queue()
        self.successor = successor or QueueSender(self.out, "next")
        self.worker = StageWorker(StageCore(shard, index=2, capacity=64, wire_dtype=F64), self.successor, **kw)

    async def __aenter__(self):
        self.task = asyncio.get_running_loop().create_task(self.worker.run())
        return self

    async def __aexit__(self, *exc):
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)

    def put(self, msg, tensors=None, link=1):
        self.worker.inbox.put_nowait(Frame(msg, tensors or {}, "prev", link, time.time()))

    async def get(self):
        async with asyncio.timeout(30):  # an emulated 200x-slower device on a busy host takes seconds
            return (await self.out.get()).msg


async def test_messages_are_applied_in_order_and_passed_on(shard):
    async with Running(shard) as r:
        r.put(fwd("a", 0, 5), hidden(5))
        r.put(Forward(request_id="a", seq=1, first=0, parents=[-1, -1], positions=[5, 5]), hidden(2))
        r.put(Prune(request_id="a", seq=2, accept=1, keep=[1]))
        r.put(Release(request_id="a", seq=3))
        kinds = [(m.kind, m.seq) for m in [await r.get() for _ in range(4)]]
        assert kinds == [("forward", 0), ("forward", 1), ("prune", 2), ("release", 3)]
        snap = r.worker.snapshot()
        # the prune was queued behind the second forward: look-ahead skipped the row it discards (node 0)
        assert (snap["forwards"], snap["tokens"], snap["prunes"], snap["frames_out"]) == (2, 6, 1, 4)
        assert snap["skipped"] == 1
        assert snap["open_requests"] == 0
        assert snap["successor"] == "next"


async def test_compute_slowdown_stretches_each_forward_and_is_recorded_in_the_timeline(shard):
    async with Running(shard, device=EmulatedDevice(ComputeEmulation(slowdown=4.0, basis="measured"))) as r:
        for seq in range(3):
            r.put(fwd("a", seq, 4, start=4 * seq), hidden(4))
        for _ in range(3):
            await r.get()
        timeline = r.worker.timeline()
        assert len(timeline) == 3
        for b in timeline:
            assert b["end"] - b["start"] >= 4.0 * b["compute_s"] - 1e-4
            assert b["end"] - b["start"] <= 4.0 * b["compute_s"] + 0.1
            assert b["request_id"] == "a"
            assert b["nodes"] == 4
        assert [b["start"] for b in timeline] == sorted(b["start"] for b in timeline)
        assert timeline[1]["start"] >= timeline[0]["end"] - 1e-3  # the next forward waits for the slow device
        snap = r.worker.snapshot()
        assert snap["busy_s"] >= 4 * snap["compute_s"] - 1e-3
        assert r.worker.timeline(since=timeline[1]["end"]) == timeline[2:]


async def test_device_time_is_the_slowdown_times_the_fastest_forward_of_that_size(shard):
    async with Running(shard, device=EmulatedDevice(ComputeEmulation(slowdown=4.0))) as r:
        for seq in range(4):
            r.put(fwd("a", seq, 4, start=4 * seq), hidden(4))
        for _ in range(4):
            out = await r.get()
            assert len(out.stage_s) == 1  # the worker reports its busy time in the returned Forward
        timeline = r.worker.timeline()
        fastest = timeline[0]["compute_s"]
        for i, b in enumerate(timeline):
            fastest = min(fastest, b["compute_s"])
            assert b["end"] - b["start"] >= max(b["compute_s"], 4.0 * fastest) - 1e-4
            assert b["end"] - b["start"] <= max(b["compute_s"], 4.0 * fastest) + 0.1, i


async def test_the_timeline_is_a_bounded_ring_buffer(shard, monkeypatch):
    monkeypatch.setattr(worker_mod, "TIMELINE_LENGTH", 2)
    async with Running(shard) as r:
        for seq in range(4):
            r.put(fwd("a", seq, 1, start=seq), hidden(1))
        for _ in range(4):
            await r.get()
        assert len(r.worker.timeline()) == 2


async def test_the_event_loop_stays_responsive_while_a_stage_computes(shard):
    async with Running(shard) as r:
        real = r.worker.core.handle
        r.worker.core.handle = lambda *a: (time.sleep(0.4), real(*a))[1]  # a slow forward (GIL released)
        r.put(fwd("a", 0, 2), hidden(2))
        t0 = time.perf_counter()
        for _ in range(10):
            await asyncio.sleep(0.01)
        assert time.perf_counter() - t0 < 0.3  # ticks went on during the forward
        assert (await r.get()).kind == "forward"


async def test_a_lost_inbound_link_fails_only_the_requests_that_came_through_it(shard):
    async with Running(shard) as r:
        r.put(fwd("a", 0, 3), hidden(3), link=1)
        r.put(fwd("b", 0, 3), hidden(3), link=2)
        await r.get()
        await r.get()
        r.worker.inbox.put_nowait(LinkDown("prev", "closed by prev (code 1006)", "in", link=1, epoch=0))
        err = await r.get()
        assert isinstance(err, StageError)
        assert err.request_id == "a"
        assert err.seq == 1
        assert err.reason == "link_lost"
        assert "code 1006" in err.message
        assert set(r.worker.core.requests) == {"b"}
        r.put(fwd("b", 1, 1, start=3), hidden(1), link=2)  # the other request goes on
        assert (await r.get()).kind == "forward"


async def test_stopping_the_worker_closes_its_successor(shard):
    async with Running(shard) as r:
        await asyncio.sleep(0)
    assert r.successor.closed
    assert not r.worker.running


async def test_results_for_a_gone_successor_are_dropped_not_fatal(shard):
    async with Running(shard) as r:
        await r.successor.close()
        r.put(fwd("a", 0, 2), hidden(2))
        for _ in range(100):
            if r.worker.counters["dropped_out"]:
                break
            await asyncio.sleep(0.01)
        assert r.worker.counters["dropped_out"] == 1
        assert not r.task.done()


async def test_a_prune_that_discards_a_whole_forward_cuts_it_at_the_next_emulated_layer(shard):
    """A slow device stops a tree forward once a prune arriving behind it discards every node of it: the result
    goes on with every row dead, after about half its emulated time (the prune comes during the first of the
    stage's two layers). A prune that keeps one of its nodes cuts nothing."""
    slow = 200.0
    async with Running(shard, device=EmulatedDevice(ComputeEmulation(slowdown=slow, basis="measured"))) as r:
        r.put(fwd("a", 0, 3), hidden(3))
        await r.get()
        for seq, keep in ((1, []), (3, [1])):  # discards both nodes / keeps node 1
            r.put(Forward(request_id="a", seq=seq, first=0, parents=[-1, -1], positions=[3, 3]), hidden(2))
            await asyncio.sleep(0.02)
            r.put(Prune(request_id="a", seq=seq + 1, accept=0, keep=keep))
            out = await r.get()
            assert (await r.get()).kind == "prune"
            b = r.worker.timeline()[-1]
            emulated = slow * b["compute_s"]
            if not keep:
                assert out.dead == [0, 1]
                assert b["end"] - b["start"] <= 0.5 * emulated + 0.05
            else:
                assert out.dead == []
                assert b["end"] - b["start"] >= emulated - 1e-3
        assert r.worker.snapshot()["cut"] == 1


async def test_queued_forwards_of_different_requests_run_as_one_batch_each_in_its_own_order(shard):
    """Forwards of four requests queued at a stage run together (one engine call); each request's messages still
    apply in its own order (b's second forward waits for the next forward, c's prune follows its forward), and every
    result is what the request gets from a stage of its own."""
    inputs = {rid: hidden(n) for rid, n in (("a", 2), ("b", 3), ("c", 1), ("d", 4))}
    second_b = hidden(1)

    def feed(r):  # all queued before the worker takes the first
        for rid, t in inputs.items():
            r.put(fwd(rid, 0, t["hidden"].shape[0]), t)
        r.put(fwd("b", 1, 1, first=0, start=3), second_b)
        r.put(Prune(request_id="c", seq=1, accept=0, keep=[]))

    async with Running(shard) as r:
        feed(r)
        got = [await asyncio.wait_for(r.out.get(), 30) for _ in range(6)]
        snap = r.worker.snapshot()
        timeline = r.worker.timeline()
    order = [(f.msg.request_id, f.msg.kind, f.msg.seq) for f in got]
    assert order == [("a", "forward", 0), ("b", "forward", 0), ("c", "forward", 0), ("d", "forward", 0),
                     ("b", "forward", 1), ("c", "prune", 1)]
    assert (snap["batches"], snap["batched_forwards"], snap["frames_in"], snap["forwards"]) == (1, 4, 6, 5)
    assert [(b["requests"], b["nodes"]) for b in timeline] == [(4, 10), (1, 1)]
    ref = []
    for rid, t in inputs.items():  # the same inputs through a stage of their own, one request at a time
        async with Running(shard) as alone:
            alone.put(fwd(rid, 0, t["hidden"].shape[0]), t)
            if rid == "b":
                alone.put(fwd("b", 1, 1, first=0, start=3), second_b)
            ref += [(await asyncio.wait_for(alone.out.get(), 30)).tensors["hidden"] for _ in range(1 + (rid == "b"))]
    batched = [f.tensors["hidden"] for f in got if f.msg.kind == "forward"]
    by_request = [batched[0], batched[1], batched[4], batched[2], batched[3]]  # a, b0, b1, c, d
    for x, y in zip(by_request, ref, strict=True):
        assert torch.equal(x, y)


async def test_a_forward_that_reuses_a_retained_request_waits_for_that_request_s_release(shard):
    """b's first forward reuses a's retained KV: queued behind a's Release it is not batched ahead of it (a's forward
    runs, then the Release retains, then b takes the KV over)."""
    async with Running(shard) as r:
        r.put(fwd("x", 0, 2), hidden(2))  # something the others can batch with
        r.put(fwd("a", 0, 4), hidden(4))
        r.put(Release(request_id="a", seq=1, retain=4))
        reuse = Forward(request_id="b", seq=0, first=0, parents=[-1], positions=[4], commit=True, reuse="a")
        r.put(reuse, hidden(1))
        got = [await r.get() for _ in range(4)]
    assert [(m.request_id, m.kind) for m in got] == [("x", "forward"), ("a", "forward"), ("a", "release"),
                                                      ("b", "forward")]
    assert r.worker.core.counters["reused"] == 1


async def test_forwards_of_other_micro_batches_are_not_batched_together(shard):
    """Forward.group: the leader's micro-batches travel the ring apart (each at another stage), so a stage batches
    only the forwards of one group."""
    async with Running(shard) as r:
        for rid, group in (("a", 0), ("b", 1), ("c", 0), ("d", 1)):
            r.put(fwd(rid, 0, 2).model_copy(update={"group": group}), hidden(2))
        got = [await r.get() for _ in range(4)]
        timeline = r.worker.timeline()
    assert [m.request_id for m in got] == ["a", "c", "b", "d"]
    assert [(b["request_id"], b["requests"]) for b in timeline] == [("a", 2), ("b", 2)]
