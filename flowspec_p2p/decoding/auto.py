"""``auto``, the leader's default mode: each request runs the mode measured fastest on this pipeline at the load it
is expected to run under, and the losing modes are measured again now and then.

A mode's speed on a cluster depends on what no constant captures (stage speeds, links, the draft's acceptance on
this traffic, the leader's own speed), so the chooser measures it. What it measures is the pipeline's aggregate
rate: tokens committed per second by all requests in flight, over the stretches of time when every request in
flight runs one mode (``started``/``committed``/``finished``, from every mode's requests, not only auto's). One
request's own rate would mislead under load: a speculating request among plain ones takes more of every stage's
rows and looks fast while it slows the others down, and the pipeline as a whole down. The rates are kept per key:
the pipeline's epoch (a re-plan starts the measurements over), whether requests are greedy (acceptance differs
with temperature) and the load bucket (``load_bucket``: speculation's extra rows pay on an idle pipeline and may
cost the others on a busy one). The load is the one a request would be chosen for at that moment: the requests in
flight, or the recent average when that is higher (``LoadMeter``: the first of a burst of requests sees none of
the others yet, and a burst's end, when fewer remain, belongs to the burst).

A mode is measured in a trial: the requests of that key all run it (so that stretches with it alone in flight
occur) until it has committed ``min_tokens`` per request of the bucket's bound in such stretches, or
``max_trial`` rounds of the bound's requests have started. Untried modes are tried first (in ``candidates``
order); after that the fastest runs, and a losing mode is tried again after ``recheck`` rounds of the bound's
requests (``recheck`` requests alone, 4 x ``recheck`` at 3-4 in flight: a trial takes about a round), twice as late
each time it loses again (so a mode that never pays costs a vanishing share of the requests).

Pure bookkeeping (no torch, no I/O): leader.py asks ``choose`` per auto request (the ``Choice`` goes to the
request's ledger) and reports every request's start, tokens and end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pydantic import Field

from ..ledger import Ledger
from ..types import Settings


class AutoSettings(Settings):
    candidates: tuple[str, ...] = ("flowspec", "ar")  # the modes auto chooses among, tried in this order first
    min_tokens: int = Field(16, ge=1)  # a trial's tokens with its mode alone in flight, per request of the bound
    max_trial: int = Field(4, ge=1)  # a trial ends after this many rounds of the bound's requests, measured or not
    window_s: float = Field(30.0, gt=0.0)  # measured seconds a rate averages over (older ones fade)
    recheck: int = Field(8, ge=1)  # rounds of the bound's requests before a losing mode runs again (doubling)
    max_recheck: int = Field(256, ge=1)


@dataclass
class _Mode:
    tokens: float = 0.0  # committed while this mode alone was in flight at this key's load (faded over window_s)
    seconds: float = 0.0  # the time those stretches took
    stretches: int = 0
    since: int = 0  # requests of this key since this mode last ran
    wait: int = 0  # requests to wait before trying it again while it loses
    tried: bool = False
    trial_tokens: float = 0.0  # measured in its current trial

    def rate(self, min_tokens: int) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 and self.tokens >= min_tokens else None


@dataclass(eq=False)  # a key is itself: _regroup compares (key, mode) pairs by identity
class _Key:
    modes: dict[str, _Mode]
    trial: str | None = None  # the mode every request of this key runs until it is measured
    reason: str = ""  # "untried" | "recheck"
    started: int = 0  # requests of the trial so far


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
    exponential window of ``window_s``)."""

    def __init__(self, window_s: float = LOAD_WINDOW_S):
        self.window_s = window_s
        self.n = 0
        self.at: float | None = None
        self.average = 0.0  # exponentially weighted over time

    def _advance(self, now: float) -> None:
        if self.at is not None and now > self.at:
            dt = now - self.at
            self.average = self.n + (self.average - self.n) * math.exp(-dt / self.window_s)
        self.at = now if self.at is None else max(self.at, now)

    def set(self, n: int, now: float) -> None:
        self._advance(now)
        self.n = n

    def expected(self, now: float) -> int:
        """The load a request starting now should expect: those in flight, or the recent average if higher."""
        self._advance(now)
        return max(self.n, round(self.average))


class ModeChooser:
    def __init__(self, settings: AutoSettings | None = None):
        self.settings = settings or AutoSettings()
        self._keys: dict[tuple[int, bool, int], _Key] = {}  # (epoch, greedy, load bucket) -> its modes
        self._epoch: int | None = None  # the newest pipeline's
        self._running: dict[str, tuple[str, int, bool]] = {}  # request id -> (mode, epoch, greedy)
        self._alone: tuple[_Key, str] | None = None  # the key and mode the time counts for, while one mode runs
        self._at: float | None = None

    def _key(self, epoch: int, greedy: bool, load: int = 1) -> _Key:
        if self._epoch is None or epoch > self._epoch:
            self._keys.clear()  # a re-plan: the old pipeline's rates are stale
            self._epoch = epoch
            self._alone = None
        k = (epoch, greedy, load_bucket(load))
        if k not in self._keys:
            self._keys[k] = _Key({m: _Mode(wait=self.settings.recheck) for m in self.settings.candidates})
        return self._keys[k]

    # ---------------------------------------------------------------- what every request reports

    def started(self, request_id: str, mode: str, epoch: int, greedy: bool, now: float, load: int = 1) -> None:
        """A request of ``mode`` began (its prefill included) at time.monotonic() ``now``; ``load``: the load a
        request starting now should expect (LoadMeter.expected), as with every report."""
        self._advance(now)
        self._running[request_id] = (mode, epoch, greedy)
        self._regroup(load)

    def committed(self, tokens: int, now: float, load: int = 1) -> None:
        """A request in flight committed ``tokens``."""
        self._advance(now)
        if self._alone is not None:
            key, mode = self._alone
            m = key.modes[mode]
            m.tokens += tokens
            if key.trial == mode:
                m.trial_tokens += tokens
        self._regroup(load)

    def finished(self, request_id: str, now: float, load: int = 1) -> None:
        """A request ended (completed or not)."""
        self._advance(now)
        self._running.pop(request_id, None)
        self._regroup(load)

    def _advance(self, now: float) -> None:
        if self._at is not None and now > self._at and self._alone is not None:
            key, mode = self._alone
            m = key.modes[mode]
            m.seconds += now - self._at
            if m.seconds > self.settings.window_s:  # fade the oldest: the rate averages over the last window_s
                m.tokens *= self.settings.window_s / m.seconds
                m.seconds = self.settings.window_s
        self._at = now if self._at is None else max(self._at, now)

    def _regroup(self, load: int) -> None:
        """Where time counts from now: while the requests in flight all run one mode, the key of the load a request
        would be chosen for now (those in flight, or the recent average when more: ``load``), else nowhere. So the
        end of a burst, when fewer remain, counts where the burst's requests were chosen: what a mode's stragglers
        cost (requests that finish far apart leave the pipeline idler) is that mode's at that load."""
        kinds = set(self._running.values())
        alone = None
        if len(kinds) == 1:
            mode, epoch, greedy = next(iter(kinds))
            if mode in self.settings.candidates and (self._epoch is None or epoch >= self._epoch):
                key = self._key(epoch, greedy, max(len(self._running), load))
                alone = (key, mode)
        if alone is not None and alone != self._alone:
            key.modes[mode].stretches += 1
        self._alone = alone

    # ---------------------------------------------------------------------------- choosing

    def choose(self, available: list[str], epoch: int, greedy: bool, load: int = 1) -> Choice:
        """The mode for the next request among ``available`` (the leader's modes its drafter allows), starting with
        ``load`` requests in flight (itself included)."""
        s = self.settings
        key = self._key(epoch, greedy, load)
        cands = [m for m in s.candidates if m in available]
        rates = {m: key.modes[m].rate(s.min_tokens) for m in cands}
        if not cands:
            return Choice(available[0], "only", rates)
        if len(cands) == 1:
            return self._ran(key, Choice(cands[0], "only", rates))
        bound = load_bucket(load)
        if key.trial is not None:
            trial = key.modes[key.trial]
            if key.trial in cands and trial.trial_tokens < s.min_tokens * bound and key.started < s.max_trial * bound:
                key.started += 1
                return self._ran(key, Choice(key.trial, key.reason, rates))
            self._conclude(key, rates)
        fresh = [m for m in cands if rates[m] is None and not key.modes[m].tried]
        if fresh:
            return self._try(key, fresh[0], "untried", rates)
        measured = [m for m in cands if rates[m] is not None]
        best = max(measured, key=lambda m: rates[m]) if measured else cands[0]
        due = [m for m in cands if m != best and key.modes[m].since >= key.modes[m].wait * bound]
        if due:
            return self._try(key, max(due, key=lambda m: key.modes[m].since), "recheck", rates)
        return self._ran(key, Choice(best, "fastest", rates))

    def _try(self, key: _Key, mode: str, reason: str, rates: dict[str, float | None]) -> Choice:
        m = key.modes[mode]
        m.tokens, m.seconds = m.tokens / 2, m.seconds / 2  # the new trial weighs as much as all before it
        m.tried, m.trial_tokens = True, 0.0
        key.trial, key.reason, key.started = mode, reason, 1
        return self._ran(key, Choice(mode, reason, rates))

    def _conclude(self, key: _Key, rates: dict[str, float | None]) -> None:
        """The trial is over: a mode that lost (or could not be measured) waits twice as long before the next."""
        m = key.modes[key.trial]
        rate = m.rate(self.settings.min_tokens)
        rivals = [r for name, r in rates.items() if name != key.trial and r is not None]
        if rate is None or (rivals and rate < max(rivals)):
            if key.reason == "recheck":
                m.wait = min(2 * m.wait, self.settings.max_recheck)
        else:
            m.wait = self.settings.recheck
        key.trial = None

    def _ran(self, key: _Key, choice: Choice) -> Choice:
        for name, m in key.modes.items():
            m.since = 0 if name == choice.mode else m.since + 1
        return choice

    def snapshot(self) -> dict:
        s = self.settings
        return {f"epoch {e} {'greedy' if g else 'sampled'}" + ("" if b == 1 else f" load {_bucket_name(b)}"):
                {n: {"tokens_per_s": None if (r := m.rate(s.min_tokens)) is None else round(r, 2),
                     "seconds": round(m.seconds, 2), "samples": m.stretches, "recheck_after": m.wait,
                     **({"trial": k.reason} if k.trial == n else {})} for n, m in k.modes.items()}
                for (e, g, b), k in self._keys.items()}


def _bucket_name(b: int) -> str:
    lower = max((x for x in LOAD_BUCKETS if x < b), default=0) + 1
    return str(b) if lower == b else f"{lower}-{b}" if b in LOAD_BUCKETS else f"{lower}+"
