"""The leader: head of the pipeline, owner of requests, host of the decoding modes.

    client -> api/app.py -> Leader.generate -> mode (async generator) -> ModeContext.send -> pipeline (stage 1 ...)
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
                 numbers filled in, head, drafter, sampling, budget, the request's ledger)
    ledger       ``Ledger`` (ledger.py): the request's one record, owned by the request; its mode, its ring view
                 and the leader append to it, across attempts; the reply's stats, /metrics and the dashboard render it

Up to ``max_requests`` requests are decoded at once, each by its own mode on its own tasks: their messages share
the ring, each stage runs the queued forwards of different requests in one batched engine call (pipeline/worker.py),
and every request's output is what it would be alone (the engine is batch-invariant). Others wait for their turn in
arrival order (admission.py: at most ``max_waiting`` of them, at most ``queue_timeout_s``) and are then refused
with ``Busy`` (HTTP 503). Requests
arriving while there is no pipeline (planning, loading) wait ``ready_timeout_s`` and then get ``NotReady``
(HTTP 503 with Retry-After). A request whose pipeline breaks — a link down, no reply within ``step_timeout_s``, a
re-plan (``set_pipeline``) — **resumes**: the leader waits up to ``resume_timeout_s`` for the next pipeline (the
re-plan that a device leaving sets off) and continues from the tokens it already committed, prompt and committed
tokens prefilled again (the attempt appends to the same ledger: its totals are sums over the attempts). That is
lossless: every mode decodes the target's distribution given the prefix, and a sampled
request gives the text it would have given undisturbed: the token at each absolute position comes from one uniform
of (seed, position) (sampling.PositionalDraws; a request without a seed gets one). Without a
new pipeline in time, or after ``resume_attempts`` resumptions, it ends with ``PeerGone``; a stage error ends it
with ``StageFailed``. It never hangs.

Decoding modes plug in through ``DecodingMode`` and see one request through a ``ModeContext`` (context.py), which
reaches the leader only through its ``LeaderParts``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import torch

from ..errors import Busy, DeadlineReached, FlowSpecError, InvalidRequest, NotReady, PeerGone
from ..ledger import Ledger, reply_stats
from ..model.engine import Shard
from ..model.generate import check_context
from ..model.sampling import SamplingParams
from ..pipeline.messages import Release
from ..pipeline.transport import Frame, Inbox, LinkDown
from ..speculative.drafter import Drafter
from .admission import Admission
from .ar import AR
from .auto import LoadMeter, ModeChooser
from .batcher import NextTokens
from .context import Compute, DecodingMode, LeaderParts, ModeContext, Pipeline, ThreadCompute
from .prompt_cache import MIN_REUSE, PromptCache
from .settings import LeaderSettings

log = logging.getLogger(__name__)

LEDGERS_KEPT = 16  # recent requests' ledgers kept for the dashboard


def _job_params(params: SamplingParams) -> SamplingParams:
    """A sampled request without a seed gets one: its draws depend only on (seed, position)
    (sampling.PositionalDraws), so every attempt of it continues the same text."""
    if params.greedy or params.seed is not None:
        return params
    return params.model_copy(update={"seed": secrets.randbits(63)})


@dataclass
class _Job:
    """One request across its attempts: what it asked for, what it committed, its ledger."""

    spec: DecodingMode
    prompt: list[int]
    params: SamplingParams
    budget: int  # new tokens at most
    stops: frozenset[int]
    ledger: Ledger  # the caller's: every attempt appends to it
    cache_prompt: bool = True  # may it take and leave KV in the prompt cache (prompt_cache.py)
    deadline: float | None = None  # time.monotonic() by which it ends, whatever it has decided by then
    committed: list[int] = field(default_factory=list)

    def complete(self) -> bool:
        """Every token was decided (the budget is used up, or a stop token came)."""
        return bool(self.committed) and (len(self.committed) >= self.budget or self.committed[-1] in self.stops)


class Leader:
    """See the module docstring. ``run()`` (the demultiplexer) must run while requests are served: give it to
    the agent's TaskGroup, or let api.create_app run it (``cleanup_ctx``)."""

    def __init__(self, head: Shard, tokenizer, *, drafter: Drafter | None = None,
                 settings: LeaderSettings | None = None, modes: Sequence[DecodingMode] = (AR,),
                 model_id: str = "flowspec", compute: Compute | None = None):
        """``compute``: where the modes' heavy work runs (default: one thread; an emulated device wraps it)."""
        assert head.has_head, "the leader's shard must hold the final norm and LM head"
        self.head = head
        self.tokenizer = tokenizer
        self.drafter = drafter
        self.settings = settings or LeaderSettings()
        self.model_id = model_id
        compute = compute or ThreadCompute()
        self.parts = LeaderParts(head, drafter, self.settings, compute, NextTokens(compute))
        self.modes: dict[str, DecodingMode] = {}
        for m in modes:
            self.register_mode(m)
        self.chooser = ModeChooser(self.settings.auto)
        self.register_mode(DecodingMode("auto", self._run_auto, description="per request, the mode measured "
                                        "fastest on this pipeline for requests like it (decoding/auto.py)"))
        self.inbox: asyncio.Queue = Inbox()  # the return link's RingServer delivers here (bounded: backpressure)
        self.pipeline: Pipeline | None = None
        self._ready = asyncio.Event()
        self._swapped = asyncio.Event()  # set whenever a new pipeline is installed
        self.admission = Admission(self.settings.max_requests, self.settings.max_waiting)
        self.prompt_cache = PromptCache()  # finished requests' KV the current pipeline's stages retain
        self._active: dict[str, ModeContext] = {}
        self.load = LoadMeter()  # requests in flight over time (auto's load keys)
        self.idle = asyncio.Event()  # set while no request is in flight
        self.idle.set()
        self.counters = {"requests": 0, "completed": 0, "cancelled": 0, "failed": 0, "busy": 0, "not_ready": 0,
                         "dropped": 0, "resumed": 0}
        self.ledgers: deque[Ledger] = deque(maxlen=LEDGERS_KEPT)  # recent requests'; the one in flight is the last

    # ---------------------------------------------------------------------------------------- modes

    def register_mode(self, spec: DecodingMode) -> None:
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

    async def _run_auto(self, ctx: ModeContext) -> AsyncIterator[list[int]]:
        """``auto``: the chooser's mode for this request; the stats' ``auto`` says which and why."""
        avail = [m for m in self.available_modes() if m != "auto"]
        choice = self.chooser.choose(avail, ctx.pipeline.epoch, ctx.params.greedy, ctx.load)
        ctx.ledger.note(choice)
        self.chooser.started(ctx.request_id, choice.mode, ctx.pipeline.epoch, ctx.params.greedy, time.monotonic(),
                             ctx.load)
        async with contextlib.aclosing(self.modes[choice.mode].run(ctx)) as chunks:
            async for chunk in chunks:
                yield chunk

    def resolve_mode(self, name: str | None) -> DecodingMode:
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
        if pipeline is None or old is None or old.sender is not pipeline.sender:
            self.prompt_cache.clear()  # what the old stages retained is gone with them
        if old is not None and (pipeline is None or old.sender is not pipeline.sender):
            self._fail_all(PeerGone("the cluster is re-planning; retry the request"))
            await old.sender.close()
        if pipeline is None:
            self._ready.clear()
        else:
            if pipeline.max_requests is not None:  # the plan holds KV for this many requests on every stage
                self.admission.set_limit(pipeline.max_requests)
            self._ready.set()
            self._swapped.set()
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
                        ctx.deliver(ev)
                    else:  # a late reply of a request that already ended
                        self.counters["dropped"] += 1
                elif isinstance(ev, LinkDown) and self._affects_pipeline(ev):
                    self._fail_all(PeerGone(f"pipeline link {ev.direction} {ev.peer} down: {ev.reason}"))
        finally:
            if self.pipeline is not None:
                await self.pipeline.sender.close()

    def close(self) -> None:
        """Stop the compute thread (after ``run`` ended)."""
        self.parts.batcher.close()
        self.parts.compute.close()

    def _affects_pipeline(self, ev: LinkDown) -> bool:
        p = self.pipeline
        if p is None:
            return False
        if ev.direction == "out":
            return ev.link == getattr(p.sender, "id", None)
        return ev.epoch == p.epoch

    # ------------------------------------------------------------------------------------- requests

    def check(self, prompt_len: int, max_tokens: int, mode: str | None) -> tuple[DecodingMode, int]:
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
        stats: Ledger | None = None,
        cache_prompt: bool = True,
        deadline: float | None = None,
    ) -> AsyncIterator[list[int]]:
        """Decode ``prompt`` through the pipeline: an async generator of committed-token chunks. ``stats``: the
        request's ledger (ledger.py; a fresh one by default), which the mode, its ring view and the leader append
        to as it goes: its ``reply_stats`` carry mode, tokens, steps, tau, prefill_s, decode_s and the decode window
        ``decode_started_at``/``decode_finished_at`` (time.time()) with ``leader_busy_s``, the leader's compute
        within it; its ``leader_busy`` the leader's compute intervals. Close it to stop early. A broken pipeline is
        survived as the module docstring says (``resumed`` in the stats: how often; every attempt appends to the
        same ledger, so counts and times are sums over them, the mode's figures the last attempt's). The ledger is
        kept in ``ledgers`` once its turn came. ``deadline`` (time.monotonic()): the request's own; a turn that does
        not come by then is Busy, and a reply still decoding then ends with the tokens decided so far (the ledger's
        ``deadline_reached``), its stages released as for any ending."""
        spec, budget = self.check(len(prompt), max_tokens, mode)
        ledger = stats if stats is not None else Ledger(mode=spec.name)
        ledger.mode, ledger.prompt_tokens = spec.name, len(prompt)
        stop_ids = self.tokenizer.stop_ids if stop_ids is None and self.tokenizer is not None else stop_ids
        self.counters["requests"] += 1
        job = _Job(spec, list(prompt), _job_params(params), budget, frozenset(stop_ids or ()), ledger, cache_prompt,
                   deadline)
        await self._take_turn(ledger, deadline)
        self.ledgers.append(ledger)
        outcome = "failed"
        try:
            pipeline = await self._wait_ready()
            for attempt in itertools.count():
                try:
                    async with contextlib.aclosing(self._attempt(job, pipeline, attempt)) as chunks:
                        async for chunk in chunks:
                            yield chunk
                    outcome = "completed"
                    return
                except PeerGone as broken:
                    if attempt >= self.settings.resume_attempts:
                        raise
                    log.warning("request: %s; resuming after %d token(s) on the next pipeline", broken,
                                len(job.committed))
                    pipeline = await self._next_pipeline(pipeline, broken)
                    ledger.resumed()
        except (GeneratorExit, asyncio.CancelledError):
            outcome = "cancelled"
            raise
        finally:
            ledger.finish(outcome, time.time())
            self.admission.release()

    async def _attempt(self, job: _Job, pipeline: Pipeline, attempt: int) -> AsyncIterator[list[int]]:
        """One attempt of ``job`` on ``pipeline``, from the tokens it committed so far. Raises PeerGone when the
        pipeline broke before the reply was complete (the caller decides whether to resume)."""
        ledger = job.ledger
        rid = uuid.uuid4().hex[:16]
        ctx = ModeContext(self.parts, pipeline, rid, [*job.prompt, *job.committed],
                          job.params, job.budget - len(job.committed), job.stops, ledger)
        if self.settings.prompt_cache and job.cache_prompt and pipeline is self.pipeline:
            await self._within_budget(pipeline, in_flight=len(self._active) + 1)
            ctx.reuse = self.prompt_cache.take(ctx.prompt)
            ledger.cached_tokens += 0 if ctx.reuse is None else ctx.reuse.length
        ctx.group = self._group(pipeline)
        self._active[rid] = ctx
        self.load.set(len(self._active), time.monotonic())
        ctx.load = self.load.expected(time.monotonic())  # auto's load key: in flight now (itself included) or recently
        if job.spec.name != "auto":  # every mode's requests teach auto what it is worth here (auto's: once chosen)
            self.chooser.started(rid, job.spec.name, pipeline.epoch, job.params.greedy, time.monotonic(), ctx.load)
        ctx.in_flight_now = lambda: len(self._active)
        self.idle.clear()
        outcome: str | None = "failed"
        timer = None
        if job.deadline is not None:
            left = max(0.0, job.deadline - time.monotonic())
            timer = asyncio.get_running_loop().call_later(left, ctx.fail, DeadlineReached("the request's deadline"))
        try:
            if ctx.max_new_tokens > 0:
                async with contextlib.aclosing(job.spec.run(ctx)) as chunks:
                    async for chunk in chunks:
                        job.committed += chunk
                        now = time.monotonic()
                        self.chooser.committed(len(chunk), now, self.load.expected(now))
                        ledger.committed(len(chunk), time.time(), ctx.pending_logprobs)
                        ctx.pending_logprobs.clear()
                        yield chunk
            outcome = "completed"
        except DeadlineReached:
            ledger.deadline_reached = True
            outcome = "completed"  # what it decided in time is its reply
            return
        except PeerGone:
            if job.complete():
                outcome = "completed"  # every token was decided before the break
                return
            if attempt < self.settings.resume_attempts:
                outcome = None  # counted once the next pipeline comes, or not
            raise
        except (GeneratorExit, asyncio.CancelledError):
            outcome = "cancelled"  # the caller closed the stream early (client gone, stop string)
            raise
        finally:
            if timer is not None:
                timer.cancel()
            del self._active[rid]
            now = time.monotonic()
            self.load.set(len(self._active), now)
            self.chooser.finished(rid, now, self.load.expected(now))
            if not self._active:
                self.idle.set()
            if outcome is not None:
                self.counters[outcome] += 1
            ledger.attempt_ended(time.time())  # the decode window ends here
            await self._release(ctx, pipeline, [*job.prompt, *job.committed],
                                outcome == "completed" and job.cache_prompt)

    def _group(self, pipeline: Pipeline) -> int:
        """A new request's micro-batch: the least full of ``micro_batches`` groups (default: one per compute station
        of the ring that can work at once -- stages and leader, fewer where they share a host's cores -- but no more
        than half the requests in flight, so each still batches two)."""
        stations = pipeline.parallel or pipeline.stages + 1
        n = self.settings.micro_batches or max(1, min(stations, self.admission.limit // 2))
        count = [0] * n
        for c in self._active.values():
            if c.group < n:
                count[c.group] += 1
        return count.index(min(count))

    async def _release(self, ctx: ModeContext, pipeline: Pipeline, sequence: list[int], done: bool) -> None:
        """Free the request's state on every stage, in order; a completed request's committed positions (their KV
        on the stages, their features here) stay for a later request that shares the prefix (prompt_cache.py),
        within the memory budget."""
        if pipeline.sender.closed:
            return
        retain = min(ctx.stage_committed, sum(len(f) for f in ctx.kept), len(sequence))
        if not (done and self.settings.prompt_cache and pipeline is self.pipeline and retain >= MIN_REUSE):
            retain = None
        with contextlib.suppress(FlowSpecError):
            if ctx.seq:
                await pipeline.sender.send(Release(request_id=ctx.request_id, seq=ctx.seq, retain=retain))
            elif ctx.reuse is not None:  # it took a retained entry but never sent its first forward
                await pipeline.sender.send(Release(request_id=ctx.reuse.rid, seq=0))
        if retain is not None and ctx.seq:
            self.prompt_cache.add(ctx.request_id, sequence[:retain], torch.cat(ctx.kept)[:retain])
            await self._within_budget(pipeline, in_flight=len(self._active))

    async def _within_budget(self, pipeline: Pipeline, in_flight: int) -> None:
        """Retained entries hold as much KV on every stage as a request: drop the least recently used ones beyond
        what the requests in flight leave of the plan's budget."""
        for old in self.prompt_cache.evict(self.admission.limit - in_flight):
            with contextlib.suppress(FlowSpecError):
                await pipeline.sender.send(Release(request_id=old, seq=0))

    async def _next_pipeline(self, old: Pipeline, broken: PeerGone) -> Pipeline:
        """The pipeline a broken request resumes on; re-raises ``broken`` when none comes in time."""
        try:
            nxt = await self._wait_replaced(old)
        except (GeneratorExit, asyncio.CancelledError):
            self.counters["cancelled"] += 1  # the caller left while the request waited for a pipeline
            raise
        if nxt is None:
            self.counters["failed"] += 1
            raise broken
        self.counters["resumed"] += 1
        return nxt

    async def _take_turn(self, ledger: Ledger, deadline: float | None) -> None:
        wait = self.settings.queue_timeout_s
        if deadline is not None:
            wait = max(0.0, min(wait, deadline - time.monotonic()))
        try:
            ledger.admitted(await self.admission.acquire(wait))
        except Busy:
            self.counters["busy"] += 1
            raise

    async def _wait_replaced(self, old: Pipeline) -> Pipeline | None:
        """The first pipeline other than ``old`` installed within ``resume_timeout_s``, or None."""
        try:
            async with asyncio.timeout(self.settings.resume_timeout_s):
                while self.pipeline is None or self.pipeline is old:
                    self._swapped.clear()
                    await self._swapped.wait()
        except TimeoutError:
            return None
        return self.pipeline

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
            "auto": self.chooser.snapshot(),
            "slowdown": getattr(self.parts.compute, "slowdown", 1.0),
            "in_flight": list(self._active),
            "waiting": self.admission.waiting,
            "admission": self.admission.snapshot(),
            "prompt_cache": self.prompt_cache.snapshot(),
            **self.counters,
            "last_request": next((reply_stats(led) for led in reversed(self.ledgers)
                                  if led.attempt.ended_at is not None), None),
        }
