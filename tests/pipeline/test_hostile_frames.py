"""Structurally valid frames with hostile fields: each is refused before anything is allocated for it, ends at most
its own request, and never the stage; a request's state is touched only through the link that carries it."""

import asyncio
import json

import pytest
import torch

from flowspec_p2p.errors import ProtocolError
from flowspec_p2p.pipeline import codec
from flowspec_p2p.pipeline import stage as stage_mod
from flowspec_p2p.pipeline.messages import MAX_NODES, Forward, Prune, Release, StageError
from flowspec_p2p.pipeline.stage import MAX_REQUESTS, StageCore
from flowspec_p2p.pipeline.transport import Frame, Inbox, LinkDown, QueueSender

from ..ring_fixtures import F64, tiny_parts
from .test_codec import frame_with_header
from .test_worker import Running


@pytest.fixture(scope="module")
def shard(tiny_llama):
    return tiny_parts(tiny_llama).stages[1]  # layers [1, 3): hidden in, hidden out


def hidden(m):
    return {"hidden": torch.randn(m, 64, dtype=F64)}


def chain(rid, seq, m, start=0):
    return Forward(request_id=rid, seq=seq, first=0, parents=[-1, *range(m - 1)],
                   positions=list(range(start, start + m)), commit=True)


def core(shard, capacity=64):
    return StageCore(shard, index=2, capacity=capacity, wire_dtype=F64)


# ------------------------------------------------------------------------------------------ the codec's caps


def header(msg: dict) -> bytes:
    return frame_with_header({"v": 1, "msg": msg})


@pytest.mark.parametrize("msg", [
    {"kind": "prune", "request_id": "x" * 600_000, "seq": 1, "accept": 0, "keep": []},  # 600 kB id
    {"kind": "prune", "request_id": "r", "seq": 1, "accept": 0, "keep": list(range(MAX_NODES + 1))},
    {"kind": "forward", "request_id": "r", "seq": 0, "first": 0, "parents": [-1] * (MAX_NODES + 1),
     "positions": [0] * (MAX_NODES + 1), "dead": list(range(MAX_NODES))},  # 95k dead nodes, scaled down
    {"kind": "forward", "request_id": "r", "seq": 0, "first": 0, "parents": [-1], "positions": [2**40]},
    {"kind": "forward", "request_id": "r", "seq": 0, "first": 0, "parents": [-7], "positions": [0]},
    {"kind": "forward", "request_id": "r", "seq": 2**62, "first": 0, "parents": [-1], "positions": [0]},
    {"kind": "error", "request_id": "r", "seq": 0, "stage": 1, "message": "e" * 5000},
])
def test_oversized_or_out_of_range_fields_are_refused_by_the_codec(msg):
    raw = header(msg)
    if len(raw) > codec.MAX_HEADER_BYTES + 8:
        with pytest.raises(ProtocolError):
            codec.decode(raw)
        return
    with pytest.raises(ProtocolError, match="invalid header"):
        codec.decode(raw)


def test_a_prune_with_a_long_request_id_is_refused_before_it_reaches_a_stage():
    raw = json.dumps({"v": 1, "msg": {"kind": "prune", "request_id": "x" * 65, "seq": 1, "accept": 0,
                                      "keep": []}}).encode()
    with pytest.raises(ProtocolError, match="request_id"):
        codec.decode(codec.PREFIX.pack(codec.MAGIC, len(raw)) + raw)


# ---------------------------------------------------------------------------------------------- the core


def test_a_forward_that_would_outgrow_the_tree_or_the_capacity_fails_its_request_only(shard, monkeypatch):
    c = core(shard, capacity=64)
    out, _ = c.handle(chain("live", 0, 4), hidden(4), link=1)
    assert out.kind == "forward"
    # dead nodes count: 70 of them do not fit a 64-slot capacity
    many = Forward(request_id="big", seq=0, first=0, parents=[-1] * 70, positions=[0] * 70, dead=list(range(70)))
    out, _ = c.handle(many, hidden(70), link=1)
    assert isinstance(out, StageError)
    assert "capacity" in out.message
    assert "big" not in c.requests
    monkeypatch.setattr(stage_mod, "MAX_PENDING", 8)
    tree = Forward(request_id="live", seq=1, first=0, parents=[-1] * 9, positions=[4] * 9)
    out, _ = c.handle(tree, hidden(9), link=1)
    assert isinstance(out, StageError)
    assert "pending tree" in out.message


def test_a_first_forward_beyond_the_capacity_allocates_no_cache(shard, monkeypatch):
    made = []
    c = core(shard, capacity=16)
    real = c.shard.new_cache
    monkeypatch.setattr(c.shard, "new_cache", lambda n: made.append(n) or real(n))
    for bad in (Forward(request_id="a", seq=0, first=0, parents=[-1], positions=[16]),
                Forward(request_id="a", seq=0, first=3, parents=[-1], positions=[0]),
                chain("a", 0, 17)):
        out, _ = c.handle(bad, hidden(len(bad.parents)), link=1)
        assert isinstance(out, StageError)
    assert made == []


def test_fresh_request_ids_on_another_link_do_not_evict_the_live_request(shard):
    c = core(shard)
    c.handle(chain("live", 0, 3), hidden(3), link=1)
    for i in range(MAX_REQUESTS + 4):
        c.handle(chain(f"junk{i}", 0, 1), hidden(1), link=2)
    assert "live" in c.requests
    assert sum(st.link == 2 for st in c.requests.values()) == MAX_REQUESTS
    out, _ = c.handle(chain("live", 1, 1, start=3).model_copy(update={"first": 0}), hidden(1), link=1)
    assert out.kind == "forward"


def test_a_frame_for_the_live_request_from_another_link_is_dropped_and_touches_nothing(shard):
    c = core(shard)
    c.handle(chain("live", 0, 3), hidden(3), link=1)
    for hostile in (chain("live", 7, 1), Prune(request_id="live", seq=1, accept=0, keep=[]),
                    Release(request_id="live", seq=1),
                    StageError(request_id="live", seq=1, stage=1, message="forged")):
        assert c.handle(hostile, hidden(1) if hostile.kind == "forward" else {}, link=9) is None
    assert c.requests["live"].next_seq == 1
    assert c.counters["foreign"] == 4
    out, _ = c.handle(chain("live", 1, 1, start=3), hidden(1), link=1)
    assert out.kind == "forward"


def test_an_unexpected_exception_in_the_shard_fails_the_request_not_the_stage(shard, monkeypatch):
    c = core(shard)

    monkeypatch.setattr(c, "shard", _Failing(c.shard))
    out, _ = c.handle(chain("a", 0, 2), hidden(2), link=1)
    assert isinstance(out, StageError)
    assert "cannot allocate memory" in out.message
    assert "a" not in c.requests
    # in a batch: the batch's requests fail, the stage and the requests it holds go on
    monkeypatch.undo()
    assert not isinstance(c.handle(chain("held", 0, 2), hidden(2), link=1)[0], StageError)
    monkeypatch.setattr(c, "shard", _Failing(c.shard))
    outs = c.handle_batch([(chain("b", 0, 2), hidden(2), (), 1), (chain("c", 0, 1), hidden(1), (), 1)])
    assert all(isinstance(o, StageError) and "cannot allocate memory" in o.message for o, _ in outs)
    assert set(c.requests) == {"held"}


class _Failing:
    """A shard whose forwards raise something unexpected (as an allocation failing in the engine)."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, *a, **k):
        raise RuntimeError("cannot allocate memory")

    forward_batch = __call__


def test_a_bad_forward_in_a_batch_fails_only_its_own_request(shard):
    c = core(shard)
    assert not isinstance(c.handle(chain("a", 0, 2), hidden(2), link=1)[0], StageError)
    stale = chain("a", 0, 1)  # seq 0 again: out of sequence
    outs = c.handle_batch([(stale, hidden(1), (), 1), (chain("b", 0, 3), hidden(3), (), 1),
                           (chain("c", 0, 1), hidden(2), (), 1)])  # c: the wrong number of hidden rows
    assert isinstance(outs[0][0], StageError)
    assert "seq" in outs[0][0].message
    assert not isinstance(outs[1][0], StageError)
    assert outs[1][1]["hidden"].shape == (3, shard.cfg.hidden_size)
    assert isinstance(outs[2][0], StageError)
    assert set(c.requests) == {"b"}


# -------------------------------------------------------------------------------------------- the worker


class Unsendable(QueueSender):
    """A successor that cannot encode one request's messages (as a header over the limit)."""

    async def send(self, msg, tensors=None):
        if msg.request_id == "bad" and msg.kind != "error":
            raise ProtocolError("header of 2000000 bytes exceeds 1048576")
        await super().send(msg, tensors)


async def test_a_result_that_cannot_be_sent_fails_its_request_and_the_stage_goes_on(shard):
    out = asyncio.Queue()
    async with Running(shard, Unsendable(out, "next")) as r:
        r.put(chain("bad", 0, 2), hidden(2))
        r.put(chain("good", 0, 2), hidden(2))
        async with asyncio.timeout(5):
            first, second = (await out.get()).msg, (await out.get()).msg
        assert isinstance(first, StageError)
        assert first.request_id == "bad"
        assert second.kind == "forward"
        assert second.request_id == "good"
        assert not r.task.done()
        assert "bad" not in r.worker.core.requests


async def test_a_lost_link_frees_its_requests_and_leaves_no_state_behind(shard):
    async with Running(shard) as r:
        for i in range(5):
            r.put(chain(f"r{i}", 0, 1), hidden(1), link=3)
        for _ in range(5):
            await r.get()
        r.worker.inbox.put_nowait(LinkDown("prev", "gone", "in", link=3))
        for _ in range(5):
            assert (await r.get()).reason == "link_lost"
        assert r.worker.core.requests == {}


async def test_the_inbox_holds_back_frames_beyond_its_limit_but_never_a_link_down():
    box = Inbox(limit=2)
    frame = Frame(Release(request_id="a", seq=0), {}, "p", 1, 0.0)
    await box.put(frame)
    await box.put(frame)
    third = asyncio.create_task(box.put(frame))
    await asyncio.sleep(0.05)
    assert not third.done()  # waits for room: the ring server stops reading that socket meanwhile
    await box.put(LinkDown("p", "gone", "in", 1))  # goes in at once
    assert box.qsize() == 3
    box.get_nowait()
    await asyncio.wait_for(third, 1)
    assert box.qsize() == 3
