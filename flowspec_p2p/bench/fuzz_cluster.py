"""``flowspec fuzz``'s local cluster: a leader and a member agent in this process on loopback (the open mode, so
hostile control messages reach the handlers; the leader holds no layers, so the member's stage takes every frame),
fuzzed target by target in batches (bench/fuzz.py) until the time is up; a greedy request before and after must give
the same reply.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

import aiohttp

from ..agent import Agent
from ..cluster.stage_host import ws_url
from ..config import AgentConfig
from ..errors import FlowSpecError
from ..pipeline.messages import PROTOCOL_VERSION
from ..pipeline.transport import RingHello
from . import fuzz

log = logging.getLogger(__name__)

SERVING_TIMEOUT_S = 300.0  # the cluster must (re-)plan and load within this
TARGETS = ("stage", "control", "api")
PROMPT = "Name three colours."


def _serving(leader: Agent) -> bool:
    c = leader.coordinator
    return (c is not None and c.update is not None and c.transition is None and c.broken is None
            and leader.leader is not None and leader.leader.ready)


async def _until_serving(leader: Agent, timeout_s: float = SERVING_TIMEOUT_S) -> bool:
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):
            while not _serving(leader):  # noqa: ASYNC110 - polling the coordinator's state
                await asyncio.sleep(0.1)
            return True
    return False


async def _greedy(api_url: str, n: int = 24) -> str:
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": n, "temperature": 0, "decoding": "ar"}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s, \
            s.post(api_url + "/v1/chat/completions", json=body) as r:
        data = await r.json()
        if r.status != 200:
            raise FlowSpecError(f"the greedy check got {r.status}: {data}")
        return data["choices"][0]["message"]["content"]


def _stage_target(leader: Agent, member: Agent) -> fuzz.StageTarget | None:
    host = member.stage_host
    active = host.active if host is not None else None
    update = leader.coordinator.update if leader.coordinator is not None else None
    if active is None or active.worker is None or update is None or active.epoch != update.epoch:
        return None
    hello = RingHello(protocol=PROTOCOL_VERSION, cluster=leader.cfg.cluster, epoch=active.epoch, sender=leader.id,
                      wire_dtype=update.wire_dtype)
    return fuzz.StageTarget(url=ws_url(member.info.url), hello=hello, worker=active.worker, server=member.ring)


async def fuzz_local_cluster(*, minutes: float, targets: tuple[str, ...] = TARGETS, batch: int = 100, seed: int = 0,
                             model: str | None = None, threads: int = 1) -> dict:
    """Run the fuzzers for ``minutes`` against a fresh local cluster -> {"counts": {target: Counter}, "greedy_ok",
    "reply", "seconds"}."""
    name = f"fuzz-{uuid.uuid4().hex[:6]}"
    with tempfile.TemporaryDirectory(prefix="flowspec-fuzz-") as tmp:
        def cfg(label: str, leader: bool) -> AgentConfig:
            return AgentConfig.model_validate(dict(
                cluster=name, name=label, leader=leader, model=model if leader else None, insecure=True,
                interfaces=("127.0.0.1",), state_dir=Path(tmp) / label, api_port=0, threads=threads,
                planning={"leader_layers": "never"}))

        leader, member = Agent(cfg("leader", True)), Agent(cfg("member", False))
        tasks = [asyncio.create_task(a.run(), name=f"agent-{a.cfg.name}") for a in (leader, member)]
        counts: dict[str, Counter] = {t: Counter() for t in targets}
        t0 = time.monotonic()
        try:
            if not await _until_serving(leader):
                raise FlowSpecError("the local cluster did not start serving")
            before = await _greedy(leader.api_url)
            deadline = time.monotonic() + 60.0 * minutes
            round_ = 0
            while time.monotonic() < deadline:
                for target in targets:
                    for t in tasks:
                        if t.done():
                            why = t.exception() if not t.cancelled() else "cancelled"
                            raise FlowSpecError(f"{t.get_name()} stopped while fuzzed: {why!r}") from (
                                why if isinstance(why, BaseException) else None)
                    s = seed + 1000 * round_ + TARGETS.index(target)
                    if target == "stage":
                        await _until_serving(leader)
                        st = _stage_target(leader, member)
                        if st is None:
                            counts[target]["cluster_not_serving"] += 1
                            continue
                        wire = st.hello.wire_dtype or "float32"
                        frames = fuzz.frames(hidden=leader.leader.head.cfg.hidden_size, takes="tokens", wire=wire)
                        counts[target] += await fuzz.fuzz_stage(st, fuzz.draw(frames, batch, s))
                    elif target == "control":
                        ids = [leader.id, member.id]
                        for agent in (leader, member):
                            inputs = fuzz.control_inputs(ids, batch // 2, s, cluster=name)
                            counts[target] += await fuzz.fuzz_http(agent.info.url, inputs)
                    else:
                        counts[target] += await fuzz.fuzz_http(leader.api_url, fuzz.draw(fuzz.api_bodies(), batch, s))
                    log.info("fuzz round %d, %s: %s", round_, target, dict(counts[target]))
                round_ += 1
            if not await _until_serving(leader):
                raise FlowSpecError("the cluster did not serve again after fuzzing")
            after = await _greedy(leader.api_url)
        finally:
            for a in (leader, member):
                a.stop()
            await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
    return {"counts": counts, "greedy_ok": before == after, "reply": after, "seconds": round(time.monotonic() - t0, 1)}
