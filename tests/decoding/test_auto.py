"""The chooser behind ``auto``: modes compared by the pipeline's aggregate rate while each runs alone, untried
modes first (each in a trial that all of its key's requests run), then the fastest, losers re-measured ever less
often, fresh measurements after a re-plan, greedy and sampled requests and load levels apart."""

from __future__ import annotations

import itertools

import pytest

from flowspec_p2p.decoding.auto import AutoSettings, LoadMeter, ModeChooser, load_bucket

MODES = ["ar", "chunk", "flowspec"]
TOKENS = 64


class Clock:
    """A simulated pipeline: ``clients`` closed-loop clients, each request TOKENS tokens; when every request in
    flight runs one mode the pipeline commits ``aggregate(mode, n)`` tokens/s in all, shared equally; mixed, each
    request runs at ``mixed(mode, n)`` (what its own rate would say)."""

    def __init__(self, chooser: ModeChooser, aggregate, mixed=None, greedy: bool = True, epoch: int = 1):
        self.chooser, self.aggregate, self.mixed = chooser, aggregate, mixed
        self.greedy, self.epoch, self.now = greedy, epoch, 0.0
        self.ids = itertools.count()

    def serve(self, clients: int, requests: int, load: int | None = None) -> list:
        """``requests`` auto requests from ``clients`` clients -> the choices, in order."""
        c = self.chooser
        live: dict[str, list] = {}  # id -> [mode, tokens left]
        out, started = [], 0
        while started < requests or live:
            while len(live) < clients and started < requests:
                choice = c.choose(MODES, self.epoch, self.greedy, load or clients)
                rid = f"r{next(self.ids)}"
                c.started(rid, choice.mode, self.epoch, self.greedy, self.now, load or clients)
                live[rid] = [choice.mode, TOKENS]
                out.append(choice)
                started += 1
            n, modes = len(live), {m for m, _ in live.values()}
            rate = {r: self.aggregate(m, n) / n if len(modes) == 1 else self.mixed(m, n)
                    for r, (m, _) in live.items()}
            dt = min(left / rate[r] for r, (_, left) in live.items())  # until the next request ends
            dt = min(dt, 8 / max(rate.values()))  # tokens commit in steps
            self.now += dt
            for r, v in live.items():
                v[1] -= rate[r] * dt
                c.committed(rate[r] * dt, self.now, load or clients)
            for r in [r for r, v in live.items() if v[1] <= 1e-9]:
                c.finished(r, self.now, load or clients)
                del live[r]
        return out


def alone(speed: dict[str, float]):
    return lambda mode, n: speed[mode]


def test_untried_modes_first_then_the_fastest():
    chooser = ModeChooser(AutoSettings(recheck=4))
    got = Clock(chooser, alone({"ar": 80.0, "flowspec": 60.0})).serve(1, 6)
    assert [(c.mode, c.reason) for c in got[:3]] == [("flowspec", "untried"), ("ar", "untried"), ("ar", "fastest")]
    assert got[2].rates == pytest.approx({"flowspec": 60.0, "ar": 80.0})


def test_a_losing_mode_is_rechecked_ever_less_often():
    chooser = ModeChooser(AutoSettings(recheck=4, max_recheck=32))
    got = Clock(chooser, alone({"ar": 80.0, "flowspec": 60.0})).serve(1, 120)
    probes = [i for i, c in enumerate(got) if c.reason == "recheck"]
    assert all(got[i].mode == "flowspec" for i in probes)
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    assert gaps == sorted(gaps)
    assert gaps[-1] > 2 * gaps[0]  # it kept losing: later and later
    assert sum(c.mode == "flowspec" for c in got) < 0.1 * len(got)


def test_a_recheck_that_wins_takes_over():
    chooser = ModeChooser(AutoSettings(recheck=2))
    clock = Clock(chooser, alone({"ar": 80.0, "flowspec": 60.0}))
    clock.serve(1, 5)
    clock.aggregate = alone({"ar": 80.0, "flowspec": 200.0})  # the draft starts paying (say, copied text)
    got = clock.serve(1, 8)
    assert got[-1].mode == "flowspec"
    assert got[-1].reason == "fastest"


def test_a_replan_starts_over_and_greedy_and_sampled_are_measured_apart():
    chooser = ModeChooser()
    Clock(chooser, alone({"ar": 80.0, "flowspec": 60.0})).serve(1, 4)
    assert chooser.choose(MODES, 1, False).reason == "untried"  # sampled: not measured yet
    c = chooser.choose(MODES, 2, True)  # a new plan
    assert (c.mode, c.reason) == ("flowspec", "untried")
    assert list(chooser.snapshot()) == ["epoch 2 greedy"]


def test_short_measurements_and_other_modes_teach_nothing():
    chooser = ModeChooser()
    chooser.started("a", "flowspec", 1, True, 0.0)
    chooser.committed(3, 0.01)  # 3 tokens: too few
    chooser.finished("a", 0.01)
    chooser.started("b", "pipedec", 1, True, 1.0)  # not a candidate
    chooser.committed(64, 1.5)
    chooser.finished("b", 1.5)
    assert chooser.choose(MODES, 1, True).reason == "untried"
    assert chooser.choose(["ar"], 1, True).reason == "only"


def test_under_load_modes_are_compared_by_the_pipeline_s_rate_not_by_a_request_s_own():
    """Among plain requests a speculating one runs faster than they do (it takes more of every stage), but with
    four speculating the pipeline commits fewer tokens than with four plain: auto runs ar under that load, and
    flowspec alone, where it is faster."""
    aggregate = {("ar", 1): 80.0, ("flowspec", 1): 120.0}
    per_load = lambda m, n: aggregate.get((m, n), {"ar": 200.0, "flowspec": 120.0}[m])  # noqa: E731
    mixed = lambda m, n: {"ar": 40.0, "flowspec": 90.0}[m]  # noqa: E731  one flowspec among ar: it looks fastest
    chooser = ModeChooser(AutoSettings(recheck=8))
    clock = Clock(chooser, per_load, mixed)
    got = clock.serve(4, 60)
    assert [c.reason for c in got[:2]] == ["untried"] * 2  # a trial: the key's requests all run it
    assert {c.mode for c in got[:2]} == {"flowspec"}
    rates = got[-1].rates
    assert rates["ar"] == pytest.approx(200.0, rel=0.05)
    assert rates["flowspec"] == pytest.approx(120.0, rel=0.05)
    assert sum(c.mode == "ar" for c in got[-20:]) >= 17
    rechecks = [i for i, c in enumerate(got) if c.reason == "recheck"]
    assert rechecks
    tried = max(i for i, c in enumerate(got[: rechecks[0]]) if c.mode == "flowspec")
    assert rechecks[0] - tried > 8 * 4  # recheck rounds of the bound's four requests, not 8 requests
    assert "epoch 1 greedy load 3-4" in chooser.snapshot()
    alone_now = clock.serve(1, 6)
    assert alone_now[-1].mode == "flowspec"  # one client: speculation wins
    assert [load_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 40)] == [1, 2, 4, 4, 8, 8, 9, 9]


def test_a_burst_s_tail_counts_against_the_mode_chosen_for_the_burst():
    """Four requests started together for a load of 4: plain ones finish together; speculating ones, as fast while
    all four run, finish far apart (acceptance differs by prompt), leaving the pipeline half idle meanwhile. That
    tail is the speculating burst's cost: with the recent average still at 4 it is kept under the burst's bucket,
    so ar runs at that load."""
    chooser = ModeChooser(AutoSettings(min_tokens=8))
    for i in range(4):
        chooser.started(f"a{i}", "ar", 1, True, 0.0, 4)
    chooser.committed(256, 1.0, 4)
    for i in range(4):
        chooser.finished(f"a{i}", 1.0, 4)
    for i in range(4):
        chooser.started(f"f{i}", "flowspec", 1, True, 10.0, 4)
    chooser.committed(128, 10.5, 4)  # two done in half a second...
    chooser.finished("f0", 10.5, 4)
    chooser.finished("f1", 10.5, 4)
    chooser.committed(128, 12.0, 4)  # ...the other two a second and a half later
    chooser.finished("f2", 12.0, 4)
    chooser.finished("f3", 12.0, 4)
    rates = chooser.snapshot()["epoch 1 greedy load 3-4"]
    assert rates["ar"]["tokens_per_s"] == pytest.approx(256.0)
    assert rates["flowspec"]["tokens_per_s"] == pytest.approx(128.0)  # 256 tokens in 2 s: the tail counted here
    assert list(chooser.snapshot()) == ["epoch 1 greedy load 3-4"]  # not under 1 and 2
    assert chooser.choose(MODES, 1, True, 4).mode == "ar"


def test_a_trial_that_never_runs_alone_ends_unmeasured_and_waits():
    """Requests of another mode (asked for by name) are always in flight: the trial cannot be measured, ends after
    max_trial rounds, and the mode is tried again only after ``recheck`` requests."""
    chooser = ModeChooser(AutoSettings(max_trial=2, recheck=5))
    chooser.started("pinned", "chunk", 1, True, 0.0)  # a candidate-less mode in flight throughout
    got = [chooser.choose(MODES, 1, True, 2) for _ in range(12)]
    assert [c.reason for c in got[:4]] == ["untried"] * 4
    assert {c.mode for c in got[:4]} == {"flowspec"}
    assert [c.reason for c in got[4:8]] == ["untried"] * 4
    assert {c.mode for c in got[4:8]} == {"ar"}
    assert got[8].reason == "fastest"
    assert got[8].mode == "flowspec"
    assert all(c.rates == {"flowspec": None, "ar": None} for c in got)


def test_the_load_meter_averages_requests_in_flight_over_time():
    m = LoadMeter(window_s=1.0)
    m.set(1, 0.0)
    m.set(4, 1.0)  # three more arrive a second later
    m.set(1, 3.0)
    assert m.expected(4.0) == 2  # one in flight, but 1.9 on average lately
    m.set(0, 4.0)
    assert m.expected(100.0) == 0  # long idle: the average decays away
    m.set(1, 100.0)
    assert m.expected(100.0) == 1
