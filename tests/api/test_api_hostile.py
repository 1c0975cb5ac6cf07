"""The API under clients that misbehave: hang-ups (streamed or not) cancel the request at once and free the turn and
every stage's cache; out-of-range numbers are 400s; tokenization runs off the event loop."""

import asyncio
import threading
import time

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from flowspec_p2p.api.app import create_app
from flowspec_p2p.decoding.ar import AR
from flowspec_p2p.decoding.chunk import CHUNK
from flowspec_p2p.decoding.leader import Leader
from flowspec_p2p.decoding.loopback import LoopbackRing
from flowspec_p2p.decoding.settings import LeaderSettings
from flowspec_p2p.pipeline.emulation import Device

from ..ring_fixtures import F64, ByteTokenizer, tiny_parts

TOK = ByteTokenizer()
CHAT = {"messages": [{"role": "user", "content": "Hello there"}], "temperature": 0, "decoding": "ar"}
FORWARD_S = 0.03  # each stage holds every forward this long: a 180-token reply takes several seconds


class SlowDevice(Device):
    async def finish(self, rows, compute_s, t0, layers, cut, wait) -> None:
        await wait(time.perf_counter() + FORWARD_S)


@pytest.fixture(scope="module")
def parts(tiny_llama):
    return tiny_parts(tiny_llama)


@pytest.fixture
async def slow(parts):
    """(server URL, leader, ring): a leader over a 3-stage in-memory ring of slow stages, served on port 0."""
    leader = Leader(parts.head, TOK, modes=[AR, CHUNK], model_id="tiny",
                    settings=LeaderSettings(max_context=200, ready_timeout_s=0.05))
    app = create_app(leader, run_leader=False)
    async with LoopbackRing(parts.stages, leader, hops="memory", wire_dtype=F64, capacity=200) as ring:
        for w in ring.workers:
            w.device = SlowDevice()
        server = TestServer(app)
        await server.start_server()
        try:
            yield str(server.make_url("")), leader, ring
        finally:
            await server.close()


def caches_free(ring) -> bool:
    return all(not w.core.requests for w in ring.workers)


async def until(cond, timeout_s: float) -> float:
    t0 = time.perf_counter()
    async with asyncio.timeout(timeout_s):
        while not cond():  # noqa: ASYNC110 - polling another component's state
            await asyncio.sleep(0.02)
    return time.perf_counter() - t0


@pytest.mark.parametrize("stream", [False, True])
async def test_a_client_that_hangs_up_is_cancelled_within_a_second_and_frees_turn_and_caches(slow, stream):
    url, leader, ring = slow

    async def call():
        async with aiohttp.ClientSession() as s, \
                s.post(url + "/v1/chat/completions", json={**CHAT, "max_tokens": 180, "stream": stream}) as r:
            await r.read()

    task = asyncio.create_task(call())
    await until(lambda: not leader.idle.is_set() and not caches_free(ring), 5)
    await asyncio.sleep(0.3)
    task.cancel()  # the client goes away: its connection closes
    await asyncio.gather(task, return_exceptions=True)
    took = await until(lambda: leader.idle.is_set() and caches_free(ring) and leader.admission.in_flight == 0,
                       1.0)
    assert took < 1.0
    assert leader.counters["cancelled"] == 1
    async with aiohttp.ClientSession() as s, \
            s.post(url + "/v1/chat/completions", json={**CHAT, "max_tokens": 4}) as r:
        assert r.status == 200
        assert (await r.json())["stats"]["new_tokens"] > 0


async def test_a_client_that_hangs_up_while_queued_leaves_the_queue(slow):
    url, leader, _ring = slow

    async def call(n):
        async with aiohttp.ClientSession() as s, \
                s.post(url + "/v1/chat/completions", json={**CHAT, "max_tokens": n}) as r:
            return r.status

    leader.admission.set_limit(1)  # one request in flight: the next one queues
    first = asyncio.create_task(call(40))
    await until(lambda: not leader.idle.is_set(), 5)
    queued = asyncio.create_task(call(40))
    await until(lambda: leader.admission.waiting == 1, 5)
    queued.cancel()
    await asyncio.gather(queued, return_exceptions=True)
    await until(lambda: leader.admission.waiting == 0, 1.0)
    assert await first == 200
    assert leader.admission.in_flight == 0


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1, 10**30])
async def test_a_seed_beyond_64_bits_is_a_400(slow, seed):
    url, _, _ = slow
    async with aiohttp.ClientSession() as s, \
            s.post(url + "/v1/chat/completions", json={**CHAT, "max_tokens": 2, "seed": seed}) as r:
        assert r.status == 400
        assert (await r.json())["error"]["param"] == "seed"


async def test_tokenization_runs_off_the_event_loop(slow, monkeypatch):
    url, leader, _ = slow
    threads = []
    chat = leader.tokenizer.chat

    def spy(messages):
        threads.append(threading.current_thread())
        return chat(messages)

    monkeypatch.setattr(leader.tokenizer, "chat", spy)
    async with aiohttp.ClientSession() as s, \
            s.post(url + "/v1/chat/completions", json={**CHAT, "max_tokens": 2}) as r:
        assert r.status == 200
    assert threads
    assert threads[0] is not threading.main_thread()
