"""The request ledger (flowspec_p2p/ledger.py): its views are pure functions of the events appended to it, counts
and times are sums over a request's attempts, and the mode's figures and the decode window are the last attempt's."""

import copy
from dataclasses import dataclass

import pytest

from flowspec_p2p.ledger import (
    STATS_KEYS,
    Ledger,
    TokenLogprob,
    extra_stats,
    itl_gaps,
    reply_stats,
    request_summary,
)


@dataclass
class Counted:
    """A mode's figures: one number of its own and one read from the ledger (its attempt's walks)."""

    label: str
    draft_s: float = 0.0

    def stats(self, ledger: Ledger) -> dict:
        return {"label": self.label, "draft_s": round(self.draft_s, 4), "walks": ledger.attempt_walks}


def replay(led: Ledger) -> Ledger:
    """One request of two attempts, every event with its time: a prefill, two walks and a plain step; the pipeline
    breaks; a second prefill (prompt + the 4 committed tokens) and one walk."""
    led.prompt_tokens = 6
    first = Counted("first")
    led.note(first)
    led.computed(100.0, 100.2)
    led.prefilled(6, 0.5)
    led.committed(1, 100.5, [TokenLogprob(7, -0.1)])
    led.drafted(5)
    led.sent(300)
    led.returned([0.1, 0.2], 64, 0.25, 0.3)
    led.walked(2, 1)  # one drafted token accepted + the bonus
    led.committed(2, 100.9, [TokenLogprob(8, -0.2), TokenLogprob(9, -0.3), TokenLogprob(1, -0.4)])  # one cut off
    led.drafted(4)
    led.returned([0.1, 0.1], 64, 0.2, 0.2)
    led.walked(1, 0)  # the bonus only
    led.committed(1, 101.0, [TokenLogprob(2, -0.5)])
    first.draft_s = 0.05
    led.decoded(0.7)
    led.attempt_ended(101.2)
    led.resumed()
    second = Counted("second", draft_s=0.01)
    led.note(second)
    led.prefilled(10, 0.4)
    led.committed(1, 102.0, [TokenLogprob(3, -0.6)])
    led.computed(102.5, 102.7)
    led.drafted(3)
    led.returned([0.3, 0.1, 0.05], 96, None, 0.5)  # a third stage after the re-plan; a send that was not timed
    led.walked(3, 2)
    led.committed(3, 102.6, [TokenLogprob(4, -0.7), TokenLogprob(5, -0.8), TokenLogprob(6, -0.9)])
    led.decoded(0.6)
    led.attempt_ended(103.0)
    led.finish("completed", 103.1)
    return led


def fresh() -> Ledger:
    return Ledger(mode="flowspec", id="r1", started=99.0, top_logprobs=0)


def test_the_views_are_pure_functions_of_the_events():
    a, b = replay(fresh()), replay(fresh())
    before = copy.deepcopy(a)
    assert reply_stats(a) == reply_stats(b)  # same events, same views
    assert request_summary(a, 200.0) == request_summary(b, 200.0)
    assert reply_stats(a) == reply_stats(a)  # rendering twice changes nothing
    assert request_summary(a, 200.0) == request_summary(a, 200.0)
    for name in a.__dataclass_fields__:  # and the record is not touched by rendering
        assert getattr(a, name) == getattr(before, name), name


def test_counts_and_times_sum_over_the_attempts_and_the_figures_are_the_last_attempts():
    led = replay(fresh())
    s = reply_stats(led)
    assert {k: s[k] for k in ("mode", "prompt_tokens", "new_tokens", "steps", "prefill_s", "decode_s", "tau")} == {
        "mode": "flowspec", "prompt_tokens": 6, "new_tokens": 1 + 2 + 1 + 1 + 3, "steps": 2 + 3,
        "prefill_s": 0.9, "decode_s": 1.3, "tau": round(8 / 5, 4)}
    assert s["decode_tokens_per_s"] == round(7 / 1.3, 3)
    assert (s["label"], s["draft_s"], s["walks"]) == ("second", 0.01, 1)  # the second attempt's figures
    assert s["drafted"] == 5 + 4 + 3
    assert s["accepted_by_depth"] == [2, 1]  # depth 1: two walks confirmed it; depth 2: one
    assert (s["decode_started_at"], s["decode_finished_at"]) == (pytest.approx(103.0 - 0.6), 103.0)
    assert s["leader_busy_s"] == pytest.approx(0.2)  # the second attempt's compute, inside its decode window
    assert s["resumed"] == 1
    assert tuple(s)[: len(STATS_KEYS)] == STATS_KEYS  # every reply's keys, then the extras
    assert set(extra_stats(led)) == set(s) - set(STATS_KEYS)
    assert led.extra == extra_stats(led)
    assert led.prefills == [(6, 0.5), (10, 0.4)]
    assert [t for t, _ in led.leader_busy] == [100.0, 102.5]  # every attempt's
    assert [lp.token for lp in led.logprobs] == [7, 8, 9, 2, 3, 4, 5, 6]  # the cut-off one is not kept


def test_the_dashboard_summary_reads_the_same_record():
    led = replay(fresh())
    r = request_summary(led, 200.0)
    assert (r["id"], r["mode"], r["running"], r["outcome"]) == ("r1", "flowspec", False, "completed")
    assert (r["prompt_tokens"], r["tokens"], r["steps"]) == (6, 8, 5)
    assert r["elapsed_s"] == pytest.approx(4.1)
    assert r["ttft_s"] == pytest.approx(1.5)
    assert r["tokens_per_s"] == pytest.approx(round(7 / 2.1, 2))
    assert (r["walks"], r["tau"], r["drafted"]) == (3, 2.0, 12)
    assert r["acceptance_by_depth"] == [round(2 / 3, 3), 0.5]
    assert r["stages"] == [
        {"stage": 1, "busy_s": 0.5, "bubble_s": 0.5, "busy": 0.5},
        {"stage": 2, "busy_s": 0.4, "bubble_s": 0.6, "busy": 0.4},
        {"stage": 3, "busy_s": 0.05, "bubble_s": 0.95, "busy": 0.05},
    ]
    assert r["trip_ms"] == pytest.approx(225.0)
    assert (r["resumes"], r["sent_bytes"], r["returned_bytes"]) == (1, 300, 224)
    assert itl_gaps(led) == [(pytest.approx(0.4), 2), (pytest.approx(0.1), 1), (pytest.approx(1.0), 1),
                             (pytest.approx(0.6), 3)]


def test_a_request_in_flight_and_one_that_never_drafted():
    led = Ledger(mode="ar", started=10.0)
    assert request_summary(led, 12.0)["running"]
    assert request_summary(led, 12.0)["elapsed_s"] == 2.0
    led.prefilled(4, 0.1)
    for _ in range(3):
        led.stepped(1)
    led.decoded(0.3)
    s = reply_stats(led)
    assert (s["new_tokens"], s["steps"], s["tau"]) == (4, 4, 1.0)
    # no draft keys without drafts; no decode window until the owner ends the attempt; no resumed key
    assert not {"drafted", "accepted_by_depth", "decode_started_at", "leader_busy_s", "resumed"} & set(s)
    r = request_summary(led, 12.0)
    assert (r["walks"], r["tau"], r["acceptance_by_depth"], r["ttft_s"]) == (0, None, [], None)
