"""What a decoding mode sees: ``ModeContext`` (one request's view of the pipeline and of the leader's parts),
``DecodingMode``, ``Pipeline``, ``LeaderParts``, the compute thread (``ThreadCompute``) and the shared ``prefill``
helper. The leader (leader.py) creates one ModeContext per request, routes the request's returned messages into
it, and runs the mode.

Writing a mode (the built-in modes plug in the same way; ar.py is the simplest)::

    async def my_mode(ctx: ModeContext) -> AsyncIterator[list[int]]:
        t0 = time.perf_counter()
        await ctx.forward(parents=[-1, 0], positions=[0, 1], tokens=ctx.prompt[:2], commit=True)
        msg, tensors = await ctx.recv()                   # this request's next returned message, in order
        feats = ctx.features(tensors)                      # [m, hidden] final-normed, head dtype
        token = await ctx.decide(feats[-1])                # the LM head on the leader's compute thread
        ctx.ledger.prefilled(2, time.perf_counter() - t0)  # what it did goes to the request's ledger (ledger.py)
        yield [token]                                      # committed tokens, streamed to the client at once

    leader.register_mode(DecodingMode("my-mode", my_mode, needs_drafter=False))

A mode must not send ``Release``: the leader does, in order, when the mode ends (or is closed early because the
client left or a stop string matched). Prefill belongs to the mode (``prefill`` is the shared helper).

What a mode reports goes to ``ctx.ledger``, the request's one record (ledger.py; the reply's stats, the dashboard and
/metrics are views of it): ``prefilled`` once the prompt decided the first token, ``stepped`` per committing forward,
``decoded`` with the decode phase's seconds and ``note`` with its own typed figures. A token decided from one
position comes from ``next_token``, which also notes its logprobs when the request asked for them; a speculative mode
calls ``note_walk`` after each verification (on the compute thread: it reads the walk's logits rows), ``walked``
with what the walk emitted (a step), and ``drafted`` with the draft nodes it sends. Sending, receiving and
``compute`` note the rest themselves. ``remaining`` is what the attempt may still commit.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar

import torch

from ..errors import LinkLost, PeerGone, StageFailed
from ..ledger import MAX_TOP_LOGPROBS, Ledger, TokenLogprob
from ..model.engine import Shard
from ..model.sampling import PositionalDraws, SamplingParams, choose
from ..pipeline.codec import wire_dtype
from ..pipeline.messages import DataMessage, Forward, Prune, StageError
from ..pipeline.transport import Frame, Sender
from ..speculative.drafter import Drafter
from ..speculative.verify import Rows, Verdict
from .batcher import NextTokens
from .prompt_cache import Reuse
from .settings import LeaderSettings

T = TypeVar("T")

RETURN_SLACK = 16  # returned messages a request may hold beyond what it sent (a stage's own StageErrors)
Tensors = dict[str, torch.Tensor]


def token_logprobs(logits: torch.Tensor, token: int, top_n: int) -> TokenLogprob:
    """logits: [vocab] of the position that decided ``token`` -> its log-probability and the ``top_n`` best (the raw
    distribution: log_softmax of the logits, before temperature, top-k or top-p; it draws nothing, so the tokens are
    the same with or without logprobs)."""
    assert logits.ndim == 1, logits.shape
    assert 0 <= top_n <= MAX_TOP_LOGPROBS, top_n
    with torch.inference_mode():
        lp = torch.log_softmax(logits.to(torch.float64), dim=-1)  # [vocab]
        top: tuple[tuple[int, float], ...] = ()
        if top_n > 0:
            values, ids = torch.topk(lp, min(top_n, lp.shape[-1]))  # [top_n] each
            top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
        return TokenLogprob(int(token), float(lp[token]), top)


@dataclass
class Pipeline:
    """The current ring as the leader sees it. The leader owns ``sender`` once given (closes it when replaced)."""

    sender: Sender  # the first hop
    takes: Literal["tokens", "hidden"] = "tokens"  # what the first hop consumes
    epoch: int = 0
    stages: int = 1  # compute stages in the ring (the first hop included)
    info: dict = field(default_factory=dict)  # free-form, shown on /cluster
    max_requests: int | None = None  # requests whose KV the plan holds on every stage (None: the settings')
    parallel: int | None = None  # compute stations that can work at once (None: every stage and the leader)


@dataclass(frozen=True)
class DecodingMode:
    """A decoding mode. ``run(ctx)`` is an async generator of committed-token chunks."""

    name: str
    run: Callable[[ModeContext], AsyncIterator[list[int]]]
    needs_drafter: bool = False
    lossless: bool = True  # greedy output equals single-device autoregressive output
    description: str = ""


class Compute(Protocol):
    """Where the leader's heavy work runs (drafting, LM head, verification): off the event loop."""

    async def run(self, fn: Callable[..., T], *args: Any) -> T: ...

    def describe(self) -> str: ...

    def close(self) -> None: ...


class ThreadCompute:
    """The leader's compute thread (one: torch releases the GIL, the event loop stays responsive). ``timed`` also
    measures the wall and CPU time of the call, for an emulated device (pipeline/emulation.EmulatedCompute)."""

    def __init__(self) -> None:
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="leader")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def timed(self, fn: Callable[..., T], *args: Any) -> tuple[T, float, float]:
        """-> (fn(*args), wall seconds, CPU seconds of the compute thread)"""

        def call() -> tuple[T, float, float]:
            t0, c0 = time.perf_counter(), time.thread_time()
            out = fn(*args)
            return out, time.perf_counter() - t0, time.thread_time() - c0

        return await asyncio.get_running_loop().run_in_executor(self.executor, call)

    def describe(self) -> str:
        return "compute: not emulated"

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


@dataclass(frozen=True)
class LeaderParts:
    """What a mode uses of the leader: the head shard (final norm, LM head, maybe the embedding), the drafter, the
    settings and where heavy work runs."""

    head: Shard
    drafter: Drafter | None
    settings: LeaderSettings
    compute: Compute
    batcher: NextTokens | None = None  # next tokens of several requests in one LM-head call

@dataclass
class _Failure:
    error: BaseException


class ModeContext:
    """One request's view of the pipeline and the leader's parts (see the module docstring)."""

    def __init__(self, parts: LeaderParts, pipeline: Pipeline, request_id: str, prompt: list[int],
                 params: SamplingParams, max_new_tokens: int, stop_ids: frozenset[int], ledger: Ledger):
        self.parts = parts
        self.pipeline = pipeline
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.max_new_tokens = max_new_tokens  # already clamped to the context limit
        self.stop_ids = stop_ids
        self.ledger = ledger  # the request's, across its attempts
        self.head: Shard = parts.head
        # the request's own drafter state (its caches and context) over the shared draft model
        self.drafter = None if parts.drafter is None else parts.drafter.fork()
        self.settings = parts.settings
        # sampled tokens come from (seed, absolute position) only (sampling.PositionalDraws): a resumed request
        # continues exactly as it would have undisturbed
        self.gen: PositionalDraws | None = None if params.greedy else PositionalDraws(params.seed)
        self.next_position = len(prompt)  # absolute position of the token the next next_token() decides
        self.queue: asyncio.Queue[Frame | _Failure] = asyncio.Queue()
        self.seq = 0  # next sequence number of this request
        self.in_flight = 0  # forwards sent whose result has not come back
        self.returned = 0  # forward results queued here, not yet taken by recv()
        self.error: BaseException | None = None  # set when the leader fails this request (link down, re-plan)
        self.load = 1  # requests in flight when it started, itself included (the leader sets it)
        self.in_flight_now: Callable[[], int] = lambda: 1  # requests in flight now (the leader sets it)
        self.group = 0  # its micro-batch (Forward.group; the leader sets it)
        self.reuse: Reuse | None = None  # the prompt cache's hit: the KV the stages keep for this prompt's prefix
        self.stage_committed = 0  # positions every stage holds as committed prefix once our messages arrive
        self.kept: list[torch.Tensor] = []  # target features [n, hidden] of those positions, in order
        self._busy_from = len(ledger.leader_busy)  # the ledger's compute intervals before this attempt
        self._base_tokens = ledger.new_tokens  # the ledger's tokens before this attempt
        self.pending_logprobs: list[TokenLogprob] = []  # for the next chunk the mode yields (the leader takes them)
        self._sent_at: deque[float] = deque()  # time.perf_counter() of each Forward in flight, oldest first
        self._mark: float | None = None  # time.perf_counter() up to which the request's window is counted

    @property
    def remaining(self) -> int:
        """New tokens this attempt may still commit."""
        return self.max_new_tokens - (self.ledger.new_tokens - self._base_tokens)

    @property
    def busy(self) -> list[tuple[float, float]]:
        """time.time() (start, end) of each compute of this attempt, emulated wait included."""
        return self.ledger.leader_busy[self._busy_from:]

    def fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
            self.queue.put_nowait(_Failure(error))

    def deliver(self, frame: Frame) -> None:
        """A message of this request came back from the pipeline (the leader's demultiplexer calls this). Every
        returned message answers one this request sent: more than it sent fails the request (a stage is broken)."""
        if self.queue.qsize() >= max(self.seq, 1) + RETURN_SLACK:
            self.fail(StageFailed(f"the pipeline returned more messages than request {self.request_id} sent"))
            return
        self.returned += isinstance(frame.msg, Forward)
        self.queue.put_nowait(frame)

    # ------------------------------------------------------------------------------------------- sending

    async def send(self, msg: DataMessage, tensors: Tensors | None = None) -> None:
        """Send ``msg`` down the pipeline with this request's id and the next sequence number."""
        if self.error is not None:
            raise self.error
        msg = msg.model_copy(update={"request_id": self.request_id, "seq": self.seq})
        self.seq += 1
        if isinstance(msg, Prune):
            self.stage_committed += msg.accept
        if isinstance(msg, Forward):
            self.stage_committed += len(msg.parents) if msg.commit else 0
            self.in_flight += 1
            self._sent_at.append(time.perf_counter())
            self._mark = self._mark or self._sent_at[-1]
        counters = getattr(self.pipeline.sender, "counters", None)
        before = counters.bytes if counters is not None else 0
        try:
            await self.pipeline.sender.send(msg, tensors)
        except PeerGone as e:
            raise PeerGone(f"pipeline broke while sending: {e}") from e
        self.ledger.sent((counters.bytes - before) if counters is not None else 0)

    async def forward(self, *, first: int = 0, parents: Sequence[int], positions: Sequence[int],
                      tokens: Sequence[int] | torch.Tensor, commit: bool = False, tag: int = 0,
                      reuse: str | None = None) -> None:
        """Send new nodes: token ids, embedded here when the first stage does not embed. ``reuse``: the request's
        first forward starts from that retained request's KV (prefill does this on a prompt-cache hit)."""
        ids = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)  # [m]
        msg = Forward(request_id="", seq=0, first=first, parents=list(parents), positions=list(positions),
                      commit=commit, tag=tag, reuse=reuse, group=self.group)
        if self.pipeline.takes == "tokens":
            await self.send(msg, {"tokens": ids})
        else:
            await self.send(msg, {"hidden": self.embed(ids)})

    async def prune(self, accept: int, keep: Sequence[int]) -> None:
        await self.send(Prune(request_id="", seq=0, accept=accept, keep=list(keep)))

    # ----------------------------------------------------------------------------------------- receiving

    async def recv(self, timeout_s: float | None = None) -> tuple[DataMessage, Tensors]:
        """The next message of this request back from the pipeline (Forward results and acks, in order).
        Raises PeerGone (link down, re-plan, no reply in time; LinkLost when a stage lost its inbound link) or
        StageFailed (a stage reported an error)."""
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
            if msg.reason == "link_lost":
                raise LinkLost(msg.message)
            raise StageFailed(f"stage {msg.stage}: {msg.message}")
        if isinstance(msg, Forward):
            self.in_flight -= 1
            self.returned -= 1
            self._returned(msg, item.tensors)
        return msg, item.tensors

    def _returned(self, msg: Forward, tensors: Tensors) -> None:
        now = time.perf_counter()
        trip = now - self._sent_at.popleft() if self._sent_at else None
        window = 0.0
        if self._mark is not None:
            window, self._mark = now - self._mark, now
        self.ledger.returned(msg.stage_s, sum(t.numel() * t.element_size() for t in tensors.values()), trip, window)

    async def recv_forward(self) -> tuple[Forward, Tensors]:
        """The next returned Forward, skipping acks of prunes."""
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

    def keep(self, features: torch.Tensor) -> None:
        """``features`` [n, hidden]: the target features of the n positions that just became committed prefix on
        every stage (in order; the modes call it where they commit). The prompt cache keeps them, with the KV the
        stages retain, for the drafter of a later request that shares the prefix."""
        self.kept.append(features.detach())

    def features(self, tensors: Tensors) -> torch.Tensor:
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

    def greedy_tokens(self, features: torch.Tensor) -> torch.Tensor:
        """features [..., hidden] -> the logits' argmax [...] int64, without the [..., vocab] logits
        (Shard.greedy_tokens)"""
        with torch.inference_mode():
            return self.head.greedy_tokens(features)

    @property
    def wants_rows(self) -> bool:
        """Whether a verification walk must keep its logits rows (``note_walk``: the request asked for logprobs)."""
        return self.ledger.top_logprobs is not None

    def choose(self, features: torch.Tensor, position: int) -> int:
        """The token at absolute ``position``. features: [hidden]"""
        logits = self.logits(features)
        return choose(logits, self.params, None) if self.gen is None else self.gen.sample(logits, self.params,
                                                                                          position)

    def next_token(self, features: torch.Tensor) -> int:
        """The token at ``next_position`` (then one further), for a token the mode commits: its logprobs are noted
        when the request asked. features: [hidden]"""
        if self.argmax_only:
            return self.took_next(int(self.greedy_tokens(features)))
        return self.choose_next(self.logits(features))

    @property
    def argmax_only(self) -> bool:
        """Whether the next token needs the logits' argmax alone: greedy, and no logprobs asked for."""
        return self.params.greedy and not self.wants_rows

    def took_next(self, token: int) -> int:
        """``choose_next`` for a greedy request whose argmax came without logits (``argmax_only``)."""
        self.next_position += 1
        return token

    async def decide(self, features: torch.Tensor) -> int:
        """``next_token`` on the compute thread, batched with other requests' (batcher.py) where the leader has a
        batcher. features: [hidden]"""
        if self.parts.batcher is None:
            return await self.compute(self.next_token, features)
        return await self.parts.batcher.decide(self, features)

    def choose_next(self, logits: torch.Tensor) -> int:
        """``next_token`` from the target's ``logits`` [vocab] at ``next_position``."""
        position, self.next_position = self.next_position, self.next_position + 1
        token = choose(logits, self.params, None) if self.gen is None else self.gen.sample(logits, self.params,
                                                                                           position)
        if self.ledger.top_logprobs is not None:
            self.pending_logprobs.append(token_logprobs(logits, token, self.ledger.top_logprobs))
        return token

    def note_walk(self, rows: Rows, verdict: Verdict, emitted: Sequence[int]) -> None:
        """After a verification walk over ``rows`` (target logits per tree node) that emitted ``emitted``: the
        logprobs of each emitted token, from the row of the accepted node before it (rows the walk already read)."""
        n = self.ledger.top_logprobs
        if n is not None:
            self.pending_logprobs += [token_logprobs(rows[verdict.accepted[j]], t, n) for j, t in enumerate(emitted)]

    def walked(self, verdict: Verdict, emitted: int) -> None:
        """A walk (a step) ended in ``verdict`` and emitted ``emitted`` tokens (after any budget cut). The target
        confirmed the draft ``verdict.confirmed`` levels deep (no deeper than what it emitted)."""
        self.ledger.walked(emitted, min(verdict.confirmed, emitted))

    def drafted(self, nodes: int) -> None:
        """``nodes`` drafted tokens go down the pipeline to be verified."""
        self.ledger.drafted(nodes)

    async def compute(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` where the leader computes (``LeaderParts.compute``); the interval, an emulated
        device's wait included, goes to the ledger (``busy``: this attempt's)."""
        start = time.time()
        out = await self.parts.compute.run(fn, *args)
        self.ledger.computed(start, time.time())
        return out


async def prefill(ctx: ModeContext) -> torch.Tensor:
    """Send the prompt in committing chunks (all at once: the stages work on them as a pipeline; the stages batch
    them with other requests' steps, so a long prompt delays those by one chunk's forward at a time); return the
    features of every prompt token. On a prompt-cache hit (``ctx.reuse``) the stages already hold the prefix's KV:
    only the rest is sent, the prefix's features come from the cache. -> [prompt_len, hidden]"""
    prompt, step = ctx.prompt, ctx.settings.prefill_chunk
    start = 0 if ctx.reuse is None else ctx.reuse.length
    ctx.stage_committed = start
    for a in range(start, len(prompt), step):
        ids = prompt[a : a + step]
        await ctx.forward(parents=list(range(-1, len(ids) - 1)), positions=range(a, a + len(ids)), tokens=ids,
                          commit=True, reuse=ctx.reuse.rid if ctx.reuse is not None and a == start else None)
    feats = [] if ctx.reuse is None else [ctx.reuse.features.to(ctx.head.dtype)]
    for _ in range(start, len(prompt), step):
        _, tensors = await ctx.recv_forward()
        feats.append(ctx.features(tensors))
    out = torch.cat(feats)
    ctx.keep(out)
    return out
