"""What one request did, as it happens: ``RequestTrace``, filled by the leader and its modes, read by the dashboard
and /metrics (api/), and the log-probabilities of committed tokens (``token_logprobs``).

    committed   the leader stamps every chunk it passes on (time.time()), so time to first token and the gaps
                between chunks come out of the trace
    walks       a speculative mode reports each verification walk: the tokens it emitted (accepted drafted tokens
                + the bonus; their mean is tau without the prefill step) and how deep the target confirmed the
                draft: the accepted path, and one level more when the bonus is a drafted child still in flight
                (FlowSpec's continue: that draft was right, its features are on their way)
    drafted     tree nodes sent down the pipeline to be verified (the decided root of a tree is not a draft)
    stage_busy  every returned Forward carries each stage's busy seconds for it (``Forward.stage_s``, ring order);
                summed here per stage, they give each stage's busy time and, against the request's window (first
                forward sent to last result back), its bubbles: the time it idled while the request ran
    trips       seconds from sending a Forward to its result coming back (forwards return in order)
    logprobs    when the request asked for them: one ``TokenLogprob`` per committed token, from the target's logits
                at the position that decided it (the raw distribution: log_softmax of the logits, before temperature,
                top-k or top-p). Computing them reads the logits the mode already has and draws nothing, so the
                tokens are the same with or without them.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # the ``top_n`` most likely tokens, most likely first


def token_logprobs(logits: torch.Tensor, token: int, top_n: int) -> TokenLogprob:
    """logits: [vocab] of the position that decided ``token`` -> its log-probability and the ``top_n`` best."""
    with torch.inference_mode():
        lp = torch.log_softmax(logits.to(torch.float64), dim=-1)  # [vocab]
        top: tuple[tuple[int, float], ...] = ()
        if top_n > 0:
            values, ids = torch.topk(lp, min(top_n, lp.shape[-1]))  # [top_n] each
            top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
        return TokenLogprob(int(token), float(lp[token]), top)


@dataclass
class RequestTrace:
    """One request across its attempts (see the module docstring). ``logprobs`` is None unless asked for."""

    mode: str = ""
    prompt_tokens: int = 0
    top_logprobs: int | None = None  # None: no logprobs; else how many alternatives per token
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    started: float = field(default_factory=time.time)
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (time.time(), tokens) per committed chunk
    walk_tokens: list[int] = field(default_factory=list)  # tokens emitted per verification walk
    accepted_at_depth: list[int] = field(default_factory=list)  # [d - 1]: walks that confirmed a draft at depth d
    drafted: int = 0
    stage_busy_s: list[float] = field(default_factory=list)  # per stage, ring order
    trips_s: list[float] = field(default_factory=list)
    sent_bytes: int = 0  # frames the leader sent on its first hop (a websocket link; 0 for an in-process hop)
    returned_bytes: int = 0  # tensor payload of the results that came back
    window_s: float = 0.0  # from the first forward sent to the last result back, summed over attempts
    leader_busy: list[tuple[float, float]] = field(default_factory=list)  # the leader's compute, time.time()
    logprobs: list[TokenLogprob] | None = None
    resumes: int = 0
    queued_s: float = 0.0  # waiting for its turn (admission.py)
    finished: float | None = None
    outcome: str = ""  # "completed", "cancelled" or "failed" once finished

    def __post_init__(self) -> None:
        if self.top_logprobs is not None:
            assert 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS, self.top_logprobs
            self.logprobs = []

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.chunks)

    @property
    def first_token_at(self) -> float | None:
        return self.chunks[0][0] if self.chunks else None

    @property
    def running(self) -> bool:
        return self.finished is None

    def committed(self, chunk: Sequence[int], pending: list[TokenLogprob]) -> None:
        """The leader passes ``chunk`` on; ``pending``: the logprobs its mode noted for it (and maybe for tokens
        cut off after it, by the budget), which are taken here."""
        self.chunks.append((time.time(), len(chunk)))
        if self.logprobs is not None:
            assert len(pending) >= len(chunk), f"{len(pending)} logprobs noted for {len(chunk)} tokens"
            self.logprobs += pending[: len(chunk)]
        pending.clear()

    def walked(self, emitted: int, depth: int) -> None:
        """A verification walk emitted ``emitted`` tokens and confirmed the draft ``depth`` levels deep."""
        self.walk_tokens.append(emitted)
        if depth > len(self.accepted_at_depth):
            self.accepted_at_depth += [0] * (depth - len(self.accepted_at_depth))
        for d in range(depth):
            self.accepted_at_depth[d] += 1

    def returned(self, stage_s: Sequence[float]) -> None:
        if len(stage_s) > len(self.stage_busy_s):
            self.stage_busy_s += [0.0] * (len(stage_s) - len(self.stage_busy_s))
        for i, s in enumerate(stage_s):
            self.stage_busy_s[i] += s

    def finish(self, outcome: str) -> None:
        self.finished, self.outcome = time.time(), outcome

    def itl_gaps(self) -> list[tuple[float, int]]:
        """(seconds since the previous chunk, tokens) of every chunk after the first."""
        return [(t - p, n) for (p, _), (t, n) in zip(self.chunks, self.chunks[1:], strict=False)]

    def summary(self, now: float | None = None) -> dict:
        """The dashboard's view of this request."""
        now = now or time.time()
        end = self.finished or now
        first = self.first_token_at
        decode_s = (self.chunks[-1][0] - first) if first is not None else 0.0
        window = max(self.window_s, 1e-9)
        walks = len(self.walk_tokens)
        return {
            "id": self.id, "mode": self.mode, "running": self.running, "outcome": self.outcome,
            "prompt_tokens": self.prompt_tokens, "tokens": self.tokens, "started": self.started,
            "elapsed_s": round(end - self.started, 3),
            "ttft_s": None if first is None else round(first - self.started, 4),
            "tokens_per_s": round((self.tokens - 1) / decode_s, 2) if decode_s > 0 else None,
            "tau": round(sum(self.walk_tokens) / walks, 3) if walks else None,
            "walks": walks, "drafted": self.drafted,
            "acceptance_by_depth": [round(n / prev, 3) if prev else 0.0 for n, prev in
                                    zip(self.accepted_at_depth, [walks, *self.accepted_at_depth], strict=False)],
            "stages": [{"stage": i + 1, "busy_s": round(b, 4), "bubble_s": round(max(0.0, window - b), 4),
                        "busy": round(min(1.0, b / window), 3)} for i, b in enumerate(self.stage_busy_s)],
            "trip_ms": round(1e3 * sum(self.trips_s) / len(self.trips_s), 2) if self.trips_s else None,
            "resumes": self.resumes, "sent_bytes": self.sent_bytes, "returned_bytes": self.returned_bytes,
        }
