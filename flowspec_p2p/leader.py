"""The leader: head of the pipeline, owner of requests, host of the decoding modes.

    client -> api.py -> Leader.generate -> mode (async generator) -> ModeContext.send -> pipeline (stage 1 ...)
                                            ^                                               |
                                            +-- ModeContext.recv <- demux (Leader.run) <- inbox (stage N)

Glossary:
    pipeline     the ring of stages for the current plan (``Pipeline``): the first hop's sender (a websocket
                 ``Link``, or a ``QueueSender`` into a StageWorker that runs in the leader's own process), what
                 the first hop consumes (token ids, or hidden states the leader embeds), and the plan epoch
    head         the leader's ``Shard``: the final norm + LM head (logits, verification) and, when the first
                 stage does not embed, the embedding
    mode         a decoding strategy: an async generator ``mode(ctx)`` yielding committed-token chunks
    context      ``ModeContext``: one request's view of the pipeline (send / recv with request id and sequence
                 numbers filled in, head, drafter, sampling, budget, stats)

One request is in flight at a time (batch size 1, as in FlowSpec); others wait for their turn (at most
``max_waiting`` of them, at most ``queue_timeout_s``) and are then refused with ``Busy`` (HTTP 503). Requests
arriving while there is no pipeline (planning, loading) wait ``ready_timeout_s`` and then get ``NotReady``
(HTTP 503 with Retry-After). A request whose pipeline breaks — a link down, a stage error, no reply within
``step_timeout_s``, a re-plan (``set_pipeline``) — ends with ``PeerGone`` / ``StageFailed``; it never hangs.

Writing a mode (the lead's ``flowspec`` mode plugs in the same way)::

    async def my_mode(ctx: ModeContext) -> AsyncIterator[list[int]]:
        await ctx.forward(parents=[-1, 0], positions=[0, 1], tokens=ctx.prompt[:2], commit=True)
        msg, tensors = await ctx.recv()                   # this request's next returned message, in order
        feats = ctx.features(tensors)                      # [m, hidden] final-normed, head dtype
        token = await ctx.compute(ctx.choose, feats[-1])   # heavy work on the leader's compute thread
        ctx.stats.steps += 1; ctx.stats.new_tokens += 1
        yield [token]                                      # committed tokens, streamed to the client at once

    leader.register_mode(ModeSpec("my-mode", my_mode, needs_drafter=False))

A mode must not send ``Release``: the leader does, in order, when the mode ends (or is closed early because the
client left or a stop string matched). Prefill belongs to the mode (``prefill`` below is the shared helper).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

import torch
from pydantic import Field

from .codec import wire_dtype
from .emulation import cpu_time_wait, measured_wait
from .errors import Busy, FlowSpecError, InvalidRequest, NotReady, PeerGone, StageFailed
from .generate import GenStats, check_context
from .messages import Forward, Prune, Release, Reset, StageError
from .sampling import SamplingParams, choose
from .shard import Shard
from .transport import LINK_LOST, Frame, LinkDown, Sender
from .types import FrozenModel

log = logging.getLogger(__name__)


class LeaderSettings(FrozenModel):
    mode_preference: tuple[str, ...] = ("flowspec", "chunk", "ar")  # default mode: the first one available
    default_mode: str | None = None  # overrides mode_preference
    max_context: int = Field(2048, ge=2)  # prompt + new tokens; the stages' KV capacity must be at least this
    max_waiting: int = Field(8, ge=0)  # requests queued behind the one in flight; more get Busy (503)
    queue_timeout_s: float = Field(300.0, gt=0)  # waiting for the turn longer than this: Busy (503)
    ready_timeout_s: float = Field(10.0, ge=0)  # waiting for a pipeline longer than this: NotReady (503)
    step_timeout_s: float = Field(60.0, gt=0)  # no reply from the pipeline for this long: PeerGone
    retry_after_s: int = Field(2, ge=1)  # Retry-After for 503s
    prefill_chunk: int = Field(128, ge=1)  # prompt tokens per prefill Forward (chunks are pipelined)
    wire_dtype: str = "float32"  # activations the leader itself sends (when it embeds for stage 1)
    tree_margin: int = Field(256, ge=0)  # KV slots a stage needs beyond max_context for pending draft-tree nodes
    slowdown: float = Field(1.0, ge=1.0, le=1000.0)  # emulated device (emulation.py) for ``ModeContext.compute``
    # (drafting, LM head, verification). Basis "cpu": the leader is busy slowdown x the CPU time its compute thread
    # used (t_cpu; with one torch thread, else as "measured"), so stages computing at the same time on the shared
    # host do not count; "measured": it waits (slowdown - 1) x the wall time, which multiplies that contention too
    slowdown_basis: Literal["cpu", "measured"] = "cpu"

    @property
    def stage_capacity(self) -> int:
        """KV capacity every stage (StageCore ``capacity``) needs for requests this leader accepts."""
        return self.max_context + self.tree_margin


@dataclass
class Pipeline:
    """The current ring as the leader sees it. The leader owns ``sender`` once given (closes it when replaced)."""

    sender: Sender  # the first hop
    takes: Literal["tokens", "hidden"] = "tokens"  # what the first hop consumes
    epoch: int = 0
    stages: int = 1  # compute stages in the ring (the first hop included)
    info: dict = field(default_factory=dict)  # free-form, shown on /cluster


@dataclass(frozen=True)
class ModeSpec:
    """A decoding mode. ``run(ctx)`` is an async generator of committed-token chunks."""

    name: str
    run: Callable[[ModeContext], AsyncIterator[list[int]]]
    needs_drafter: bool = False
    lossless: bool = True  # greedy output equals single-device autoregressive output
    description: str = ""


@dataclass
class _Failure:
    error: BaseException


class ModeContext:
    """One request's view of the pipeline and the leader's pieces (see the module docstring)."""

    def __init__(self, leader: Leader, pipeline: Pipeline, request_id: str, prompt: list[int],
                 params: SamplingParams, max_new_tokens: int, stop_ids: frozenset[int], stats: GenStats):
        self.leader = leader
        self.pipeline = pipeline
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.max_new_tokens = max_new_tokens  # already clamped to the context limit
        self.stop_ids = stop_ids
        self.stats = stats
        self.head: Shard = leader.head
        self.drafter = leader.drafter
        self.settings = leader.settings
        self.gen: torch.Generator | None = None if params.greedy else params.generator()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.seq = 0  # next sequence number of this request
        self.in_flight = 0  # forwards sent whose result has not come back
        self.returned = 0  # forward results queued here, not yet taken by recv()
        self.error: BaseException | None = None  # set when the leader fails this request (link down, re-plan)
        self.busy: list[tuple[float, float]] = []  # time.time() (start, end) of each compute, emulated wait included

    def fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
            self.queue.put_nowait(_Failure(error))

    # ------------------------------------------------------------------------------------------- sending

    async def send(self, msg, tensors: dict[str, torch.Tensor] | None = None) -> None:
        """Send ``msg`` down the pipeline with this request's id and the next sequence number."""
        if self.error is not None:
            raise self.error
        msg = msg.model_copy(update={"request_id": self.request_id, "seq": self.seq})
        self.seq += 1
        if isinstance(msg, Forward):
            self.in_flight += 1
        try:
            await self.pipeline.sender.send(msg, tensors)
        except PeerGone as e:
            raise PeerGone(f"pipeline broke while sending: {e}") from e

    async def forward(self, *, first: int = 0, parents: Sequence[int], positions: Sequence[int],
                      tokens: Sequence[int] | torch.Tensor, commit: bool = False, tag: int = 0) -> None:
        """Send new nodes: token ids, embedded here when the first stage does not embed."""
        ids = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)  # [m]
        msg = Forward(request_id="", seq=0, first=first, parents=list(parents), positions=list(positions),
                      commit=commit, tag=tag)
        if self.pipeline.takes == "tokens":
            await self.send(msg, {"tokens": ids})
        else:
            await self.send(msg, {"hidden": self.embed(ids)})

    async def prune(self, accept: int, keep: Sequence[int]) -> None:
        await self.send(Prune(request_id="", seq=0, accept=accept, keep=list(keep)))

    async def reset(self, length: int) -> None:
        await self.send(Reset(request_id="", seq=0, length=length))

    # ----------------------------------------------------------------------------------------- receiving

    async def recv(self, timeout_s: float | None = None) -> tuple[object, dict[str, torch.Tensor]]:
        """The next message of this request back from the pipeline (Forward results and acks, in order).
        Raises PeerGone (link down, re-plan, no reply in time) or StageFailed (a stage reported an error)."""
        timeout_s = self.settings.step_timeout_s if timeout_s is None else timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                item = await self.queue.get()
        except TimeoutError:
            raise PeerGone(f"no reply from the pipeline within {timeout_s:g} s") from None
        if isinstance(item, _Failure):
            raise item.error
        msg = item.msg
        if isinstance(msg, StageError):
            if msg.message.startswith(LINK_LOST):
                raise PeerGone(msg.message.removeprefix(LINK_LOST))
            raise StageFailed(f"stage {msg.stage}: {msg.message}")
        if isinstance(msg, Forward):
            self.in_flight -= 1
            self.returned -= 1
        return msg, item.tensors

    async def recv_forward(self) -> tuple[Forward, dict[str, torch.Tensor]]:
        """The next returned Forward, skipping acks of prunes and resets."""
        while True:
            msg, tensors = await self.recv()
            if isinstance(msg, Forward):
                return msg, tensors

    # ------------------------------------------------------------------------------------------ compute

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [m] -> hidden [m, hidden] in the wire dtype (the leader embeds for a first stage without it)."""
        if self.head.embed is None:
            raise PeerGone("the first stage wants hidden states but the leader holds no embedding")
        with torch.inference_mode():
            return self.head.embed(ids).to(wire_dtype(self.settings.wire_dtype))

    def features(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """Final-normed features of returned nodes -> [m, hidden] in the head's dtype."""
        with torch.inference_mode():
            if "features" in tensors:
                return tensors["features"].to(self.head.dtype)
            if self.head.norm is None:
                raise StageFailed("the last stage returned hidden states but the leader holds no final norm")
            return self.head.norm(tensors["hidden"].to(self.head.dtype))

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """features [..., hidden] -> logits [..., vocab]"""
        with torch.inference_mode():
            return self.head.logits(features)

    def choose(self, features: torch.Tensor) -> int:
        """The next token at one position. features: [hidden]"""
        return choose(self.logits(features), self.params, self.gen)

    async def compute(self, fn: Callable, *args):
        """Run ``fn(*args)`` on the leader's compute thread (keeps the event loop responsive). With an emulated
        slowdown s (``LeaderSettings.slowdown``) the leader then stays busy until s times the CPU time it used
        has passed (basis "cpu"), or waits (s - 1) * t after t seconds (basis "measured")."""

        def timed():
            t0, c0 = time.perf_counter(), time.thread_time()
            out = fn(*args)
            return out, time.perf_counter() - t0, time.thread_time() - c0

        start = time.time()
        out, compute_s, cpu_s = await asyncio.get_running_loop().run_in_executor(self.leader.executor, timed)
        s = self.settings
        if s.slowdown_basis == "cpu" and torch.get_num_threads() == 1:  # more threads: t_cpu misses their work
            wait = cpu_time_wait(s.slowdown, compute_s, cpu_s)
        else:
            wait = measured_wait(s.slowdown, compute_s)
        if wait > 0:
            await asyncio.sleep(wait)
        self.busy.append((start, time.time()))
        return out


async def prefill(ctx: ModeContext) -> torch.Tensor:
    """Send the prompt in committing chunks (all at once: the stages work on them as a pipeline); return the
    features of every prompt token. -> [prompt_len, hidden]"""
    prompt, step = ctx.prompt, ctx.settings.prefill_chunk
    for a in range(0, len(prompt), step):
        ids = prompt[a : a + step]
        await ctx.forward(parents=list(range(-1, len(ids) - 1)), positions=range(a, a + len(ids)), tokens=ids,
                          commit=True)
    feats = []
    for _ in range(0, len(prompt), step):
        _, tensors = await ctx.recv_forward()
        feats.append(ctx.features(tensors))
    return torch.cat(feats)


async def ar_mode(ctx: ModeContext) -> AsyncIterator[list[int]]:
    """Pipelined autoregressive decoding: one token in flight; each step is one committing Forward."""
    stats = ctx.stats
    t0 = time.perf_counter()
    feats = await prefill(ctx)
    token = await ctx.compute(ctx.choose, feats[-1])
    stats.prefill_s = time.perf_counter() - t0
    stats.steps, stats.new_tokens = 1, 1
    t1 = time.perf_counter()
    try:
        yield [token]
        pos = len(ctx.prompt)
        while stats.new_tokens < ctx.max_new_tokens and token not in ctx.stop_ids:
            await ctx.forward(parents=[-1], positions=[pos], tokens=[token], commit=True)
            _, tensors = await ctx.recv_forward()
            token = await ctx.compute(ctx.choose, ctx.features(tensors)[-1])
            pos += 1
            stats.steps += 1
            stats.new_tokens += 1
            yield [token]
    finally:
        stats.decode_s = time.perf_counter() - t1


AR = ModeSpec("ar", ar_mode, description="pipelined autoregressive decoding, one token in flight")


def builtin_modes() -> list[ModeSpec]:
    """Every mode this package ships, with default settings: ar, chunk, pipedec and flowspec."""
    from .chunkpp import CHUNK
    from .flowspec import FLOWSPEC
    from .pipedec import PIPEDEC

    return [AR, CHUNK, PIPEDEC, FLOWSPEC]


def _decode_window(stats: GenStats, busy: list[tuple[float, float]]) -> None:
    """Stamp the decode window (the mode's ``decode_s`` ending now, as wall-clock time.time(), comparable with the
    stages' timelines) and the leader's busy seconds within it into ``stats.extra``."""
    end = time.time()
    start = end - stats.decode_s
    stats.extra["decode_started_at"] = start
    stats.extra["decode_finished_at"] = end
    stats.extra["leader_busy_s"] = round(sum(max(0.0, min(b, end) - max(a, start)) for a, b in busy), 4)


class Leader:
    """See the module docstring. ``run()`` (the demultiplexer) must run while requests are served: give it to
    the agent's TaskGroup, or let api.create_app run it (``cleanup_ctx``)."""

    def __init__(self, head: Shard, tokenizer, *, drafter=None, settings: LeaderSettings | None = None,
                 modes: Sequence[ModeSpec] = (AR,), model_id: str = "flowspec"):
        assert head.has_head, "the leader's shard must hold the final norm and LM head"
        self.head = head
        self.tokenizer = tokenizer
        self.drafter = drafter
        self.settings = settings or LeaderSettings()
        self.model_id = model_id
        self.modes: dict[str, ModeSpec] = {}
        for m in modes:
            self.register_mode(m)
        self.inbox: asyncio.Queue = asyncio.Queue()  # the return link's RingServer delivers here
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="leader")
        self.pipeline: Pipeline | None = None
        self._ready = asyncio.Event()
        self._turn = asyncio.Lock()
        self._waiting = 0
        self._active: dict[str, ModeContext] = {}
        self.counters = {"requests": 0, "completed": 0, "cancelled": 0, "failed": 0, "busy": 0, "not_ready": 0,
                         "dropped": 0}
        self.last_stats: dict | None = None

    # ---------------------------------------------------------------------------------------- modes

    def register_mode(self, spec: ModeSpec) -> None:
        self.modes[spec.name] = spec

    def available_modes(self) -> list[str]:
        return [n for n, m in self.modes.items() if self.drafter is not None or not m.needs_drafter]

    def default_mode(self) -> str:
        avail = self.available_modes()
        if self.settings.default_mode in avail:
            return self.settings.default_mode
        for name in self.settings.mode_preference:
            if name in avail:
                return name
        return avail[0]

    def resolve_mode(self, name: str | None) -> ModeSpec:
        name = name or self.default_mode()
        spec = self.modes.get(name)
        if spec is None:
            raise InvalidRequest(f"unknown decoding mode {name!r}; available: {', '.join(self.available_modes())}")
        if spec.needs_drafter and self.drafter is None:
            raise InvalidRequest(f"decoding mode {name!r} needs a draft head, and this cluster has none")
        return spec

    # ------------------------------------------------------------------------------------- pipeline

    @property
    def ready(self) -> bool:
        return self.pipeline is not None

    async def set_pipeline(self, pipeline: Pipeline | None) -> None:
        """Swap the pipeline (after a re-plan; None while planning). Requests in flight on the old one fail
        with PeerGone; the old first-hop sender is closed. Requests that wait meanwhile get the new one."""
        old, self.pipeline = self.pipeline, pipeline
        if old is not None and (pipeline is None or old.sender is not pipeline.sender):
            self._fail_all(PeerGone("the cluster is re-planning; retry the request"))
            await old.sender.close()
        if pipeline is None:
            self._ready.clear()
        else:
            self._ready.set()
            log.info("pipeline ready: epoch %d, %d stage(s), first hop %s takes %s", pipeline.epoch,
                     pipeline.stages, pipeline.sender.peer, pipeline.takes)

    def _fail_all(self, error: BaseException) -> None:
        for ctx in self._active.values():
            ctx.fail(error)

    async def run(self) -> None:
        """Demultiplex returned messages to their requests; fail requests whose links go down."""
        try:
            while True:
                ev = await self.inbox.get()
                if isinstance(ev, Frame):
                    ctx = self._active.get(ev.msg.request_id)
                    if ctx is not None:
                        ctx.returned += isinstance(ev.msg, Forward)
                        ctx.queue.put_nowait(ev)
                    else:  # a late reply of a request that already ended
                        self.counters["dropped"] += 1
                elif isinstance(ev, LinkDown) and self._affects_pipeline(ev):
                    self._fail_all(PeerGone(f"pipeline link {ev.direction} {ev.peer} down: {ev.reason}"))
        finally:
            if self.pipeline is not None:
                await self.pipeline.sender.close()

    def close(self) -> None:
        """Stop the compute thread (after ``run`` ended)."""
        self.executor.shutdown(wait=False, cancel_futures=True)

    def _affects_pipeline(self, ev: LinkDown) -> bool:
        p = self.pipeline
        if p is None:
            return False
        if ev.direction == "out":
            return ev.link == getattr(p.sender, "id", None)
        return ev.epoch == p.epoch

    # ------------------------------------------------------------------------------------- requests

    def check(self, prompt_len: int, max_tokens: int, mode: str | None) -> tuple[ModeSpec, int]:
        """Validate a request before it queues: -> (mode, clamped max new tokens). Raises InvalidRequest or
        ContextOverflow."""
        spec = self.resolve_mode(mode)
        return spec, check_context(prompt_len, max_tokens, self.settings.max_context)

    async def generate(
        self,
        prompt: Sequence[int],
        *,
        params: SamplingParams,
        max_tokens: int,
        stop_ids: frozenset[int] | None = None,
        mode: str | None = None,
        stats: GenStats | None = None,
        timeline: list[tuple[float, float]] | None = None,
    ) -> AsyncIterator[list[int]]:
        """Decode ``prompt`` through the pipeline: an async generator of committed-token chunks. ``stats`` is
        filled as it goes (mode, tokens, steps, tau, prefill_s, decode_s; extras ``decode_started_at`` and
        ``decode_finished_at``, the decode window in time.time(), and ``leader_busy_s``, the leader's compute within
        it). ``timeline``: if given, receives the leader's compute intervals (time.time() start, end). Close it to
        stop early."""
        spec, budget = self.check(len(prompt), max_tokens, mode)
        stats = stats if stats is not None else GenStats(mode=spec.name)
        stats.mode = spec.name
        stats.prompt_tokens = len(prompt)
        stop_ids = self.tokenizer.stop_ids if stop_ids is None and self.tokenizer is not None else stop_ids
        self.counters["requests"] += 1
        await self._take_turn()
        try:
            pipeline = await self._wait_ready()
            rid = uuid.uuid4().hex[:16]
            ctx = ModeContext(self, pipeline, rid, list(prompt), params, budget, frozenset(stop_ids or ()), stats)
            self._active[rid] = ctx
            outcome = "failed"
            try:
                if budget > 0:
                    async with contextlib.aclosing(spec.run(ctx)) as chunks:
                        async for chunk in chunks:
                            yield chunk
                outcome = "completed"
            except (GeneratorExit, asyncio.CancelledError):
                outcome = "cancelled"  # the caller closed the stream early (client gone, stop string)
                raise
            finally:
                del self._active[rid]
                self.counters[outcome] += 1
                _decode_window(stats, ctx.busy)
                if timeline is not None:
                    timeline.extend(ctx.busy)
                self.last_stats = stats.as_dict()
                if ctx.seq and not pipeline.sender.closed:  # free the request's state on every stage, in order
                    with contextlib.suppress(FlowSpecError):
                        await pipeline.sender.send(Release(request_id=rid, seq=ctx.seq))
        finally:
            self._turn.release()

    async def _take_turn(self) -> None:
        if self._turn.locked() and self._waiting >= self.settings.max_waiting:
            self.counters["busy"] += 1
            raise Busy(f"{self._waiting} requests are already waiting; retry later")
        self._waiting += 1
        try:
            async with asyncio.timeout(self.settings.queue_timeout_s):
                await self._turn.acquire()
        except TimeoutError:
            self.counters["busy"] += 1
            raise Busy(f"waited {self.settings.queue_timeout_s:g} s for the request ahead; retry later") from None
        finally:
            self._waiting -= 1

    async def _wait_ready(self) -> Pipeline:
        if self.pipeline is None:
            try:
                async with asyncio.timeout(self.settings.ready_timeout_s):
                    await self._ready.wait()
            except TimeoutError:
                pass
        if self.pipeline is None:
            self.counters["not_ready"] += 1
            raise NotReady("the cluster is planning or loading; retry shortly")
        return self.pipeline

    def snapshot(self) -> dict:
        p = self.pipeline
        return {
            "ready": p is not None,
            "pipeline": None if p is None else {"epoch": p.epoch, "stages": p.stages, "first_hop": p.sender.peer,
                                                "takes": p.takes, **p.info},
            "modes": self.available_modes(),
            "default_mode": self.default_mode(),
            "slowdown": self.settings.slowdown,
            "in_flight": list(self._active),
            "waiting": self._waiting,
            **self.counters,
            "last_request": self.last_stats,
        }
