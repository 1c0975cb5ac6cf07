"""The chooser behind ``auto``: untried modes first, then the fastest, losers re-measured ever less often, fresh
measurements after a re-plan, greedy and sampled requests apart."""

from __future__ import annotations

import itertools

import pytest

from flowspec_p2p.decoding.auto import AutoSettings, LoadMeter, ModeChooser, load_bucket

MODES = ["ar", "chunk", "flowspec"]


def serve(chooser: ModeChooser, speed: dict[str, float], n: int, epoch: int = 1, greedy: bool = True) -> list:
    """n requests of 64 tokens; a mode decodes at ``speed[mode]`` tokens/s. -> the choices"""
    out = []
    for _ in range(n):
        c = chooser.choose(MODES, epoch, greedy)
        chooser.record(c.mode, epoch, greedy, 64, 63 / speed[c.mode])
        out.append(c)
    return out


def test_untried_modes_first_then_the_fastest():
    chooser = ModeChooser(AutoSettings(recheck=4))
    got = serve(chooser, {"ar": 80.0, "flowspec": 60.0}, 6)
    assert [(c.mode, c.reason) for c in got[:3]] == [("flowspec", "untried"), ("ar", "untried"), ("ar", "fastest")]
    assert got[2].rates == {"flowspec": 60.0, "ar": 80.0}


def test_a_losing_mode_is_rechecked_ever_less_often():
    chooser = ModeChooser(AutoSettings(recheck=4, max_recheck=32))
    got = serve(chooser, {"ar": 80.0, "flowspec": 60.0}, 120)
    probes = [i for i, c in enumerate(got) if c.reason == "recheck"]
    assert all(got[i].mode == "flowspec" for i in probes)
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    assert gaps == sorted(gaps)
    assert gaps[-1] > 2 * gaps[0]  # it kept losing: later and later
    assert sum(c.mode == "flowspec" for c in got) < 0.1 * len(got)


def test_a_recheck_that_wins_takes_over():
    chooser = ModeChooser(AutoSettings(recheck=2))
    serve(chooser, {"ar": 80.0, "flowspec": 60.0}, 5)
    got = serve(chooser, {"ar": 80.0, "flowspec": 200.0}, 8)  # the draft starts paying (say, copied text)
    assert got[-1].mode == "flowspec"
    assert got[-1].reason == "fastest"


def test_a_replan_starts_over_and_greedy_and_sampled_are_measured_apart():
    chooser = ModeChooser()
    serve(chooser, {"ar": 80.0, "flowspec": 60.0}, 4)
    assert chooser.choose(MODES, 1, False).reason == "untried"  # sampled: not measured yet
    c = chooser.choose(MODES, 2, True)  # a new plan
    assert (c.mode, c.reason) == ("flowspec", "untried")
    assert list(chooser.snapshot()) == ["epoch 2 greedy"]


def test_short_replies_and_other_modes_teach_nothing():
    chooser = ModeChooser()
    chooser.record("flowspec", 1, True, 3, 0.01)  # 3 tokens: too few
    chooser.record("pipedec", 1, True, 64, 0.5)  # not a candidate
    assert chooser.choose(MODES, 1, True).reason == "untried"
    assert chooser.choose(["ar"], 1, True).reason == "only"


def test_rates_are_kept_per_load_so_speculation_can_win_alone_and_lose_under_load():
    chooser = ModeChooser(AutoSettings(recheck=4))
    for load, speed in ((1, {"ar": 80.0, "flowspec": 120.0}), (4, {"ar": 30.0, "flowspec": 12.0})):
        for _ in range(3):
            c = chooser.choose(MODES, 1, True, load)
            chooser.record(c.mode, 1, True, 64, 63 / speed[c.mode], load)
    assert chooser.choose(MODES, 1, True, 1).mode == "flowspec"
    assert chooser.choose(MODES, 1, True, 3).mode == "ar"  # 3 and 4 in flight share a bucket
    assert chooser.choose(MODES, 1, True, 2).reason == "untried"
    assert [load_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 40)] == [1, 2, 4, 4, 8, 8, 9, 9]
    assert "epoch 1 greedy load 3-4" in chooser.snapshot()


def test_requests_that_start_together_try_different_untried_modes():
    chooser = ModeChooser()
    first, second = chooser.choose(MODES, 1, True, 2), chooser.choose(MODES, 1, True, 2)
    assert {first.mode, second.mode} == set(AutoSettings().candidates)  # not both on one untried mode
    assert first.reason == second.reason == "untried"
    third = chooser.choose(MODES, 1, True, 2)  # both on trial: it shares the least tried
    assert third.reason == "untried"
    for c in (first, second, third):
        chooser.ended(c, 1, True, 2)
    chooser.record(first.mode, 1, True, 64, 1.0, 2)
    nxt = chooser.choose(MODES, 1, True, 2)
    assert (nxt.mode, nxt.reason) == (second.mode, "untried")  # its trial ended without a measurement
    chooser.ended(nxt, 1, True, 2)
    chooser.record(second.mode, 1, True, 64, 2.0, 2)
    assert chooser.choose(MODES, 1, True, 2).mode == first.mode  # the faster


def test_the_load_meter_averages_requests_in_flight_over_time_and_over_a_request_s_life():
    m = LoadMeter(window_s=1.0)
    m.set(1, 0.0)
    mark = m.mark(0.0)
    m.set(4, 1.0)  # three more arrive a second later
    m.set(1, 3.0)
    assert m.mean_since(mark, 4.0) == pytest.approx((1 + 8 + 1) / 4)  # its own life: 1 for 1 s, 4 for 2 s, 1 for 1 s
    assert m.expected(4.0) == 2  # one in flight, but 1.9 on average lately
    m.set(0, 4.0)
    assert m.expected(100.0) == 0  # long idle: the average decays away
    m.set(1, 100.0)
    assert m.expected(100.0) == 1
    assert m.mean_since(m.mark(100.0), 100.0) == 1.0  # no time passed: the count now
