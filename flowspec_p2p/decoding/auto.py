"""``auto``, the leader's default mode: each request runs the mode measured fastest on this pipeline for requests
like it, and the losing modes are measured again now and then.

A mode's speed on a cluster depends on what no constant captures (stage speeds, links, the draft's acceptance on
this traffic, the leader's own speed), so the chooser measures it: every completed request of at least
``min_tokens`` new tokens, in any mode, updates that mode's running decode rate for its key (the pipeline's epoch,
whether the request is greedy: acceptance differs with temperature, and the load it ran under: how many requests
were in flight, on average over its life, bucketed (``load_bucket``), since speculation's extra rows pay on an idle
pipeline and cost the others on a busy one; a re-plan starts the measurements over). A request is chosen for the
load it is expected to run under: the requests in flight as it starts, or the recent average when that is higher
(``LoadMeter``: the first of a burst of requests sees none of the others yet).
A mode with no measurement yet is tried first (in ``candidates`` order); after that the fastest runs, and a losing
mode is tried again after ``recheck`` requests, twice as late each time it loses again (so a mode that never pays
costs a vanishing share of the requests).

Pure bookkeeping (no torch, no I/O): leader.py asks ``choose`` per request (the ``Choice`` goes to the request's
ledger) and reports ``record`` after it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pydantic import Field

from ..ledger import Ledger
from ..types import Settings


class AutoSettings(Settings):
    candidates: tuple[str, ...] = ("flowspec", "ar")  # the modes auto chooses among, tried in this order first
    min_tokens: int = Field(16, ge=2)  # shorter replies say little about a mode's decode rate
    weight: float = Field(0.5, gt=0.0, le=1.0)  # of the newest request in a mode's running rate
    recheck: int = Field(8, ge=1)  # requests before a losing mode runs again (doubling while it keeps losing)
    max_recheck: int = Field(256, ge=1)


@dataclass
class _Mode:
    rate: float | None = None  # running decode tokens/s
    samples: int = 0
    since: int = 0  # requests of this key since this mode last ran
    wait: int = 0  # requests to wait before trying it again while it loses
    trying: int = 0  # requests running it untried: the others that start meanwhile measure another mode


@dataclass(frozen=True)
class Choice:
    mode: str
    reason: str  # "only" | "untried" | "fastest" | "recheck"
    rates: dict[str, float | None]

    def as_dict(self) -> dict:
        return {"chose": self.mode, "reason": self.reason,
                "rates": {m: None if r is None else round(r, 2) for m, r in self.rates.items()}}

    def stats(self, ledger: Ledger) -> dict:
        """Its key of the reply's stats (it is one of the request's figures, ledger.Figures): ``auto``."""
        return {"auto": self.as_dict()}


LOAD_BUCKETS = (1, 2, 4, 8)  # requests in flight: 1, 2, 3-4, 5-8, more


def load_bucket(in_flight: int) -> int:
    """The smallest bucket bound at or above ``in_flight`` (requests in flight, this one included)."""
    return next((b for b in LOAD_BUCKETS if in_flight <= b), LOAD_BUCKETS[-1] + 1)


LOAD_WINDOW_S = 10.0  # the time constant of the recent average of requests in flight


class LoadMeter:
    """Requests in flight over time (``set`` on every change, ``now``: time.monotonic()): their recent average (an
    exponential window of ``window_s``) and each request's own average over its life (``mark`` at its start,
    ``mean_since`` at its end)."""

    def __init__(self, window_s: float = LOAD_WINDOW_S):
        self.window_s = window_s
        self.n = 0
        self.at: float | None = None
        self.area = 0.0  # integral of n dt since the first event
        self.average = 0.0  # exponentially weighted over time

    def _advance(self, now: float) -> None:
        if self.at is not None and now > self.at:
            dt = now - self.at
            self.area += self.n * dt
            self.average = self.n + (self.average - self.n) * math.exp(-dt / self.window_s)
        self.at = now if self.at is None else max(self.at, now)

    def set(self, n: int, now: float) -> None:
        self._advance(now)
        self.n = n

    def expected(self, now: float) -> int:
        """The load a request starting now should expect: those in flight, or the recent average if higher."""
        self._advance(now)
        return max(self.n, round(self.average))

    def mark(self, now: float) -> tuple[float, float]:
        self._advance(now)
        return now, self.area

    def mean_since(self, mark: tuple[float, float], now: float) -> float:
        """The average requests in flight from ``mark`` to ``now`` (the current count when no time passed)."""
        self._advance(now)
        t0, a0 = mark
        return (self.area - a0) / (now - t0) if now > t0 else float(self.n)


class ModeChooser:
    def __init__(self, settings: AutoSettings | None = None):
        self.settings = settings or AutoSettings()
        # (epoch, greedy, load bucket) -> mode -> its record
        self._keys: dict[tuple[int, bool, int], dict[str, _Mode]] = {}

    def _key(self, epoch: int, greedy: bool, load: int = 1) -> dict[str, _Mode]:
        k = (epoch, greedy, load_bucket(load))
        if k not in self._keys:
            for old in [o for o in self._keys if o[0] != epoch]:  # a re-plan: the old pipeline's rates are stale
                del self._keys[old]
            self._keys[k] = {m: _Mode(wait=self.settings.recheck) for m in self.settings.candidates}
        return self._keys[k]

    def choose(self, available: list[str], epoch: int, greedy: bool, load: int = 1) -> Choice:
        """The mode for the next request among ``available`` (the leader's modes its drafter allows), starting with
        ``load`` requests in flight (itself included)."""
        key = self._key(epoch, greedy, load)
        cands = [m for m in self.settings.candidates if m in available]
        rates = {m: key[m].rate for m in cands}
        if not cands:
            return Choice(available[0], "only", rates)
        if len(cands) == 1:
            return self._ran(key, Choice(cands[0], "only", rates))
        untried = [m for m in cands if key[m].rate is None]
        free = [m for m in untried if not key[m].trying]
        measured = [m for m in cands if key[m].rate is not None]
        if free or (untried and not measured):  # requests starting together try different modes
            mode = free[0] if free else min(untried, key=lambda m: key[m].trying)
            key[mode].trying += 1
            return self._ran(key, Choice(mode, "untried", rates))
        best = max(measured, key=lambda m: rates[m])
        due = [m for m in measured if m != best and key[m].since >= key[m].wait]
        if due:
            return self._ran(key, Choice(max(due, key=lambda m: key[m].since), "recheck", rates))
        return self._ran(key, Choice(best, "fastest", rates))

    def _ran(self, key: dict[str, _Mode], choice: Choice) -> Choice:
        for name, m in key.items():
            m.since = 0 if name == choice.mode else m.since + 1
        return choice

    def ended(self, choice: Choice, epoch: int, greedy: bool, load: int = 1) -> None:
        """A request that ran ``choice`` ended (completed or not): an untried mode's trial is over."""
        if choice.reason == "untried" and choice.mode in self.settings.candidates:
            m = self._key(epoch, greedy, load)[choice.mode]
            m.trying = max(0, m.trying - 1)

    def record(self, mode: str, epoch: int, greedy: bool, new_tokens: int, decode_s: float, load: int = 1) -> None:
        """A request of ``mode`` that started with ``load`` requests in flight completed with ``new_tokens`` in
        ``decode_s`` seconds of decoding."""
        s = self.settings
        if mode not in s.candidates or new_tokens < s.min_tokens or decode_s <= 0:
            return
        key = self._key(epoch, greedy, load)
        m = key[mode]
        rate = (new_tokens - 1) / decode_s
        m.rate = rate if m.rate is None else m.rate + s.weight * (rate - m.rate)
        m.samples += 1
        rivals = [o.rate for n, o in key.items() if n != mode and o.rate is not None]
        if rivals and m.rate < max(rivals):
            m.wait = min(2 * m.wait, s.max_recheck)  # it lost again: try it half as often
        else:
            m.wait = s.recheck

    def snapshot(self) -> dict:
        return {f"epoch {e} {'greedy' if g else 'sampled'}" + ("" if b == 1 else f" load {_bucket_name(b)}"):
                {n: {"tokens_per_s": None if m.rate is None else round(m.rate, 2), "samples": m.samples,
                     "recheck_after": m.wait} for n, m in k.items()}
                for (e, g, b), k in self._keys.items()}


def _bucket_name(b: int) -> str:
    lower = max((x for x in LOAD_BUCKETS if x < b), default=0) + 1
    return str(b) if lower == b else f"{lower}-{b}" if b in LOAD_BUCKETS else f"{lower}+"
