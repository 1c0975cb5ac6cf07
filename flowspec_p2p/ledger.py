"""One request's ledger: every figure of one request, appended once as it happens, and the views that render it.

vLLM's ``SpecDecodingStats`` is the model (vllm/v1/spec_decode/metrics.py): the decoder feeds one record, and the
logging and Prometheus sides only read it. Here a ``Ledger`` is created by whoever owns the request (the API's
handler, ``Leader.generate`` or a single-device decoder's caller), owned by that request alone, and appended to by:

    the request's owner  ``admitted`` (after its wait for a turn), ``committed`` (each chunk passed on, stamped),
                         ``resumed`` (a new attempt), ``attempt_ended``, ``finish``
    its decoding mode    ``prefilled`` (the prompt's forward and the first token), ``stepped`` (a forward that committed
                         tokens), ``walked`` (a verification walk: a step that verified a draft), ``drafted``,
                         ``decoded`` (the decode phase's seconds), ``note`` (its typed mode-specific figures)
    the mode's ring view ``sent``, ``returned`` (each result back: stage busy, bytes, trip, window), ``computed`` (the
                         leader's compute intervals); decoding/context.ModeContext does these

Each event adds a few numbers (no dict is built on the hot path). What reads it is a view, a function of the
ledger's fields: ``reply_stats`` (the reply's ``stats``, ``flowspec generate --stats``, what the benchmarks record),
``request_summary`` (the dashboard's request view) and api/metrics.py (/metrics, once the request finished).

Glossary:
    step        a target forward (or verification) that committed tokens; the prefill's counts (it decides the first
                token), so autoregressive tau = 1
    tau         new_tokens / steps
    walk        a speculative step: the tokens it emitted (accepted drafted tokens + the bonus; their mean is tau
                without the prefill step) and how deep the target confirmed the draft: the accepted path, and one
                level more when the bonus is a drafted child still in flight (FlowSpec's continue: that draft was
                right, its features are on their way)
    drafted     tree nodes sent to be verified (the decided root of a tree is not a draft)
    attempt     one run of the mode on one pipeline. A request whose pipeline broke resumes on the next one: every
                attempt appends to the same ledger, so counts and times are sums over the attempts; the mode's
                figures and the decode window (``decode_started_at``/``decode_finished_at``) are the last attempt's
    stage busy  every returned Forward carries each stage's busy seconds for it (``Forward.stage_s``, ring order);
                summed per stage, against the request's window (first forward sent to last result back, summed over
                attempts) they give each stage's bubbles: the time it idled while the request ran
    trips       seconds from sending a Forward to its result coming back
    logprobs    when the request asked for them: one ``TokenLogprob`` per committed token (decoding/context.py
                computes them from the target's logits; they come with the chunk)

Times: durations are seconds (time.perf_counter differences); instants are time.time(), comparable across agents.
The ledger reads no clock itself except for ``started``'s default: events carry their times.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

MAX_TOP_LOGPROBS = 20
STATS_KEYS = (  # what every reply's stats carry first (reply_stats); the rest: extra_stats
    "mode", "prompt_tokens", "new_tokens", "steps", "prefill_s", "decode_s", "tau", "decode_tokens_per_s")

F = TypeVar("F")


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # the ``top_n`` most likely tokens, most likely first


class Figures(Protocol):
    """A mode's own figures for one attempt (a typed record the mode updates as it runs)."""

    def stats(self, ledger: Ledger) -> dict:
        """Its keys of the reply's ``stats`` (it may read the ledger's counts of its attempt)."""
        ...


@dataclass(slots=True)
class Attempt:
    """One attempt: the ledger's counts when it began (its own counts are the differences), its decode seconds, when
    the owner ended it (time.time()), and its mode's figures."""

    new_tokens: int = 0
    steps: int = 0
    walks: int = 0
    draft_tokens: int = 0
    decode_s: float = 0.0
    ended_at: float | None = None
    figures: list[Figures] = field(default_factory=list)


@dataclass(slots=True, eq=False)
class Ledger:
    """One request's record (see the module docstring). ``logprobs`` is None unless asked for."""

    mode: str = ""
    prompt_tokens: int = 0
    top_logprobs: int | None = None  # None: no logprobs; else how many alternatives per token
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    started: float = field(default_factory=time.time)
    new_tokens: int = 0
    steps: int = 0
    prefills: list[tuple[int, float]] = field(default_factory=list)  # (tokens, seconds) of each attempt's prefill
    attempts: list[Attempt] = field(default_factory=lambda: [Attempt()])
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (time.time(), tokens) per committed chunk
    walk_tokens: list[int] = field(default_factory=list)  # tokens emitted per verification walk
    accepted_at_depth: list[int] = field(default_factory=list)  # [d - 1]: walks that confirmed a draft at depth d
    draft_tokens: int = 0
    stage_busy_s: list[float] = field(default_factory=list)  # per stage, ring order
    trips_s: list[float] = field(default_factory=list)
    sent_bytes: int = 0  # frames the leader sent on its first hop (a websocket link; 0 for an in-process hop)
    returned_bytes: int = 0  # tensor payload of the results that came back
    window_s: float = 0.0  # from the first forward sent to the last result back, summed over attempts
    leader_busy: list[tuple[float, float]] = field(default_factory=list)  # the leader's compute, time.time()
    logprobs: list[TokenLogprob] | None = None
    queued_s: float = 0.0  # waiting for its turn (decoding/admission.py)
    cached_tokens: int = 0  # prompt tokens whose KV came from the prompt cache (decoding/prompt_cache.py)
    deadline_reached: bool = False  # its own deadline ended it (the reply holds what was decided by then)
    finished: float | None = None
    outcome: str = ""  # "completed", "cancelled" or "failed" once finished

    def __post_init__(self) -> None:
        if self.top_logprobs is not None:
            assert 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS, self.top_logprobs
            self.logprobs = []

    # ------------------------------------------------------------------------------------- the mode's events

    def prefilled(self, tokens: int, seconds: float) -> None:
        """The prompt (``tokens``, a resumed attempt's committed tokens included) went through the target and
        decided the first new token: one step, one token."""
        self.prefills.append((tokens, seconds))
        self.steps += 1
        self.new_tokens += 1

    def stepped(self, tokens: int = 1) -> None:
        """A target forward committed ``tokens`` (autoregressive: one)."""
        self.steps += 1
        self.new_tokens += tokens

    def walked(self, emitted: int, depth: int) -> None:
        """A verification walk (a step) emitted ``emitted`` tokens and confirmed the draft ``depth`` levels deep."""
        self.steps += 1
        self.new_tokens += emitted
        self.walk_tokens.append(emitted)
        acc = self.accepted_at_depth
        if depth > len(acc):
            acc += [0] * (depth - len(acc))
        for d in range(depth):
            acc[d] += 1

    def drafted(self, nodes: int) -> None:
        """``nodes`` drafted tokens go to be verified."""
        self.draft_tokens += nodes

    def decoded(self, seconds: float) -> None:
        """The attempt's decode phase (after the first token) took ``seconds``."""
        self.attempts[-1].decode_s += seconds

    def note(self, figures: Figures) -> None:
        """The mode's typed figures for this attempt (rendered into the reply's stats)."""
        self.attempts[-1].figures.append(figures)

    # -------------------------------------------------------------------------------- the ring view's events

    def sent(self, nbytes: int) -> None:
        self.sent_bytes += nbytes

    def returned(self, stage_s: Sequence[float], nbytes: int, trip_s: float | None, window_s: float) -> None:
        """A Forward's result came back: each stage's busy seconds for it, its payload, its trip (None when its send
        was not timed) and how far it moved the request's window."""
        busy = self.stage_busy_s
        if len(stage_s) > len(busy):
            busy += [0.0] * (len(stage_s) - len(busy))
        for i, s in enumerate(stage_s):
            busy[i] += s
        self.returned_bytes += nbytes
        if trip_s is not None:
            self.trips_s.append(trip_s)
        self.window_s += window_s

    def computed(self, start: float, end: float) -> None:
        """The leader computed for this request from ``start`` to ``end`` (time.time())."""
        self.leader_busy.append((start, end))

    # ------------------------------------------------------------------------------------- the owner's events

    def admitted(self, queued_s: float) -> None:
        """Its turn came after ``queued_s`` seconds of waiting."""
        self.queued_s += queued_s

    def committed(self, tokens: int, at: float, logprobs: Sequence[TokenLogprob] = ()) -> None:
        """A chunk of ``tokens`` was passed on at ``at``; ``logprobs``: the ones noted for it (when asked for; extra
        ones, of tokens the budget cut off, are not kept)."""
        self.chunks.append((at, tokens))
        if self.logprobs is not None:
            assert len(logprobs) >= tokens, f"{len(logprobs)} logprobs noted for {tokens} tokens"
            self.logprobs += logprobs[:tokens]

    def resumed(self) -> None:
        """A new attempt begins (the request continues on another pipeline)."""
        self.attempts.append(Attempt(self.new_tokens, self.steps, len(self.walk_tokens), self.draft_tokens))

    def attempt_ended(self, at: float) -> None:
        self.attempts[-1].ended_at = at

    def finish(self, outcome: str, at: float) -> None:
        self.finished, self.outcome = at, outcome

    # ------------------------------------------------------------------------------------------ reading it

    @property
    def attempt(self) -> Attempt:
        return self.attempts[-1]

    @property
    def attempt_tokens(self) -> int:
        return self.new_tokens - self.attempts[-1].new_tokens

    @property
    def attempt_walks(self) -> int:
        return len(self.walk_tokens) - self.attempts[-1].walks

    @property
    def attempt_drafted(self) -> int:
        return self.draft_tokens - self.attempts[-1].draft_tokens

    @property
    def resumes(self) -> int:
        return len(self.attempts) - 1

    @property
    def prefill_s(self) -> float:
        return sum(s for _, s in self.prefills)

    @property
    def decode_s(self) -> float:
        return sum(a.decode_s for a in self.attempts)

    @property
    def tau(self) -> float:
        return self.new_tokens / self.steps if self.steps else 0.0

    @property
    def running(self) -> bool:
        return self.finished is None

    @property
    def first_token_at(self) -> float | None:
        return self.chunks[0][0] if self.chunks else None

    def figure(self, kind: type[F]) -> F | None:
        """The last attempt's figures of type ``kind``, if noted."""
        return next((f for f in self.attempts[-1].figures if isinstance(f, kind)), None)

    def as_dict(self) -> dict:
        """``reply_stats(self)``"""
        return reply_stats(self)

    @property
    def extra(self) -> dict:
        """The reply's stats beyond the common keys (``STATS_KEYS``): the mode's figures, the leader's decode window,
        ``resumed``, ..."""
        return extra_stats(self)


# ------------------------------------------------------------------------------------------------- views


def busy_within(intervals: Sequence[tuple[float, float]], start: float, end: float) -> float:
    """Seconds of ``intervals`` inside [start, end]."""
    return sum(max(0.0, min(b, end) - max(a, start)) for a, b in intervals)


def extra_stats(led: Ledger) -> dict:
    """The reply's stats beyond ``STATS_KEYS``: the last attempt's mode figures; the draft's totals (``drafted``,
    ``accepted_by_depth``: walks that confirmed the draft at depth d + 1) when the request drafted; the decode window
    (time.time(): the last attempt's decoding, ending when its owner ended it, comparable with the stages'
    timelines) and the leader's busy seconds in it, when the owner stamped it; ``resumed`` (how often) if it was."""
    a = led.attempts[-1]
    out: dict = {}
    for f in a.figures:
        out.update(f.stats(led))
    if led.draft_tokens or led.walk_tokens:
        out["drafted"] = led.draft_tokens
        out["accepted_by_depth"] = list(led.accepted_at_depth)
    if a.ended_at is not None:
        start = a.ended_at - a.decode_s
        out["decode_started_at"] = start
        out["decode_finished_at"] = a.ended_at
        out["leader_busy_s"] = round(busy_within(led.leader_busy, start, a.ended_at), 4)
    if led.resumes:
        out["resumed"] = led.resumes
    if led.cached_tokens:
        out["cached_tokens"] = led.cached_tokens
    if led.deadline_reached:
        out["deadline_reached"] = True
    return out


def reply_stats(led: Ledger) -> dict:
    """The reply's ``stats`` object (also ``flowspec generate --stats`` and the benchmarks' records): counts and
    times summed over the attempts, then ``extra_stats``."""
    decode_s = led.decode_s
    return {
        "mode": led.mode, "prompt_tokens": led.prompt_tokens, "new_tokens": led.new_tokens, "steps": led.steps,
        "prefill_s": round(led.prefill_s, 4), "decode_s": round(decode_s, 4), "tau": round(led.tau, 4),
        "decode_tokens_per_s": round((led.new_tokens - 1) / decode_s, 3) if decode_s > 0 else None,
        **extra_stats(led),
    }


def itl_gaps(led: Ledger) -> list[tuple[float, int]]:
    """(seconds since the previous chunk, tokens) of every committed chunk after the first."""
    return [(t - p, n) for (p, _), (t, n) in itertools.pairwise(led.chunks)]


def acceptance_by_depth(led: Ledger) -> list[float]:
    """Per depth d: the walks that confirmed depth d over those that confirmed d - 1 (depth 0: every walk)."""
    acc, walks = led.accepted_at_depth, len(led.walk_tokens)
    return [round(n / prev, 3) if prev else 0.0 for n, prev in zip(acc, [walks, *acc], strict=False)]


def request_summary(led: Ledger, now: float | None = None) -> dict:
    """The dashboard's view of the request at ``now`` (time.time(); default: the clock)."""
    now = now or time.time()
    end = led.finished or now
    first = led.first_token_at
    decode_s = (led.chunks[-1][0] - first) if first is not None else 0.0
    window = max(led.window_s, 1e-9)
    walks = len(led.walk_tokens)
    tokens = led.new_tokens
    return {
        "id": led.id, "mode": led.mode, "running": led.running, "outcome": led.outcome,
        "prompt_tokens": led.prompt_tokens, "tokens": tokens, "steps": led.steps, "started": led.started,
        "elapsed_s": round(end - led.started, 3),
        "ttft_s": None if first is None else round(first - led.started, 4),
        "tokens_per_s": round((tokens - 1) / decode_s, 2) if decode_s > 0 else None,
        "tau": round(sum(led.walk_tokens) / walks, 3) if walks else None,
        "walks": walks, "drafted": led.draft_tokens, "acceptance_by_depth": acceptance_by_depth(led),
        "stages": [{"stage": i + 1, "busy_s": round(b, 4), "bubble_s": round(max(0.0, window - b), 4),
                    "busy": round(min(1.0, b / window), 3)} for i, b in enumerate(led.stage_busy_s)],
        "trip_ms": round(1e3 * sum(led.trips_s) / len(led.trips_s), 2) if led.trips_s else None,
        "resumes": led.resumes, "sent_bytes": led.sent_bytes, "returned_bytes": led.returned_bytes,
    }
