"""The fault matrix: the middle stage of a 3-stage websocket ring fails at one of five event points of a FlowSpec
request (the second prefill chunk, the third tree segment, the second prune, the first expansion of a pending tree,
the request's release at its end), greedy and seeded at T=1, in two ways:

    kill   the stage vanishes as under kill -9: its worker stops and its sockets close (the ring's links go down)
    stop   the stage freezes as under SIGSTOP: it takes frames and answers none, its sockets stay open (the leader's
           step timeout finds it)

after which the control plane's re-plan is played by the test: a new ring of three stages (a spare agent took the
layers) or of two (no spare: the survivors took them) is installed. Every request must give the single-device
text (seeded sampling included: draws depend only on (seed, position)), none may hang, and no stage of either ring
may keep the request's cache once the old ring is retired.

CI runs 10 of the 40 cases: every event x sampling once, the fault and the spare alternating
(FLOWSPEC_FULL_FAULT_MATRIX=1 runs all 40). The faults are emulated in this process; a real kill -9 of an agent is
covered by tests/cluster/test_replan.py, a compute hang with live sockets there too.
"""

import asyncio
import itertools
import os

import pytest

from flowspec_p2p.decoding.flowspec import make_flowspec
from flowspec_p2p.decoding.leader import Leader
from flowspec_p2p.decoding.loopback import LoopbackRing
from flowspec_p2p.decoding.settings import LeaderSettings
from flowspec_p2p.ledger import Ledger
from flowspec_p2p.model.sampling import SamplingParams
from flowspec_p2p.model.torch_shard import TorchShard
from flowspec_p2p.model.weights import open_source
from flowspec_p2p.pipeline.messages import Forward, Prune, Release
from flowspec_p2p.speculative.drafter import OracleDrafter
from flowspec_p2p.types import LayerRange

from ..ring_fixtures import F64, tiny_parts

PROMPT = [5, 17, 33, 8, 61, 9, 12, 40, 3, 77, 21]
N = 30
EVENTS = ("prefill", "mid_segment", "prune", "expansion", "eos")
SAMPLING = {"greedy": SamplingParams(), "seeded_t1": SamplingParams(temperature=1.0, seed=5)}
FAULTS = ("kill", "stop")
FULL = os.environ.get("FLOWSPEC_FULL_FAULT_MATRIX") == "1"
STEP_TIMEOUT_S = 2.0  # the leader's: no reply for this long and the attempt ends (a frozen stage)
ALL = list(itertools.product(EVENTS, SAMPLING, FAULTS, (True, False)))
# CI: each event x sampling once; every event meets both faults (one per sampling), the spare alternates from event
# to event, so every (fault, spare) pair comes
CASES = ALL if FULL else [(e, s, FAULTS[(i + j) % 2], i % 2 == 0)
                          for i, e in enumerate(EVENTS) for j, s in enumerate(SAMPLING)]


@pytest.fixture(scope="module")
def parts(tiny_llama):
    return tiny_parts(tiny_llama)


@pytest.fixture(scope="module")
def two_stages(tiny_llama):
    """The survivors' ring when no spare is there: the 4 layers on two stages."""
    src = open_source(tiny_llama)
    return [TorchShard.from_source(src, LayerRange(start=a, end=b), embed=a == 0, head=b == 4, dtype=F64).eval()
            for a, b in ((0, 2), (2, 4))]


@pytest.fixture(scope="module")
def drafter(parts):
    """The target drafting for itself: trees keep nodes across walks, so every event point (expansions of a
    pending tree included) comes."""
    return OracleDrafter(parts.whole)


def fires_at(event: str):
    """A predicate on the messages the victim stage takes: true at the event point (counted per event kind)."""
    seen = {"n": 0}

    def hit(msg) -> bool:
        match = {
            "prefill": isinstance(msg, Forward) and msg.commit and len(msg.parents) > 1,
            "mid_segment": isinstance(msg, Forward) and not msg.commit,
            "prune": isinstance(msg, Prune),
            "expansion": isinstance(msg, Forward) and not msg.commit and msg.first > 0,
            "eos": isinstance(msg, Release),
        }[event]
        if match:
            seen["n"] += 1
        return match and seen["n"] == {"prefill": 2, "mid_segment": 3, "prune": 2}.get(event, 1)
    return hit


@pytest.mark.parametrize(("event", "sampling", "fault", "spare"), CASES,
                         ids=[f"{e}-{s}-{f}-{'spare' if sp else 'nospare'}" for e, s, f, sp in CASES])
async def test_a_stage_failing_at_an_event_point_never_hangs_loses_text_or_leaks_a_cache(
        parts, two_stages, drafter, event, sampling, fault, spare):
    params = SAMPLING[sampling]
    leader = Leader(parts.head, None, drafter=drafter, modes=[make_flowspec()], settings=LeaderSettings(
        max_context=160, prefill_chunk=4, step_timeout_s=STEP_TIMEOUT_S, resume_timeout_s=5.0))
    demux = asyncio.create_task(leader.run())  # outlives the old ring, as in an agent
    old = LoopbackRing(parts.stages, leader, hops="ws", wire_dtype=F64, run_leader=False)
    new = LoopbackRing(parts.stages if spare else two_stages, leader, hops="ws", wire_dtype=F64, epoch=1,
                       run_leader=False)
    fired = asyncio.Event()
    loop = asyncio.get_running_loop()
    frozen = {"on": False}
    hit = fires_at(event)

    def handle(msg, *a, **k):
        if frozen["on"]:
            return None  # a killed or frozen stage passes nothing on
        if hit(msg):
            frozen["on"] = True
            loop.call_soon_threadsafe(fired.set)
            return None
        return real(msg, *a, **k)

    async def request() -> tuple[list[int], Ledger]:
        stats, out = Ledger(mode="?"), []
        async for chunk in leader.generate(PROMPT, params=params, max_tokens=N, stop_ids=frozenset(),
                                           mode="flowspec", stats=stats):
            out += chunk
        return out, stats

    async with old:
        victim = old.workers[1]
        real = victim.core.handle
        victim.core.handle = handle
        try:
            task = asyncio.create_task(request())
            await asyncio.wait_for(fired.wait(), 10)  # the event point comes
            # what the control plane does: notice, plan, load, switch (the old ring is then retired)
            if fault == "kill":
                await old.stop_stage(2)
            await asyncio.sleep(0.05 if fault == "kill" else STEP_TIMEOUT_S + 0.2)  # the step timeout finds it
            await new.__aenter__()
            out, stats = await asyncio.wait_for(task, 20)  # never hangs
            assert out == parts.reference(PROMPT, N, params)
            if event != "eos":
                assert stats.extra.get("resumed", 0) >= 1
        finally:
            victim.core.handle = real
    try:
        if new._tg is not None:  # the old ring is retired; on the new one the request left nothing behind
            async with asyncio.timeout(3):
                while any(w.core.requests for w in new.workers):  # noqa: ASYNC110 - polling the stages
                    await asyncio.sleep(0.02)
            async with asyncio.timeout(20):  # and it serves the next request
                again = []
                async for chunk in leader.generate(PROMPT, params=params, max_tokens=8, stop_ids=frozenset(),
                                                   mode="flowspec", stats=Ledger(mode="?")):
                    again += chunk
            assert again == parts.reference(PROMPT, 8, params)
    finally:
        if new._tg is not None:
            await new.__aexit__(None, None, None)
        demux.cancel()
        await asyncio.gather(demux, return_exceptions=True)
