"""Membership as a pure apply(state, event): joins, heartbeats, graceful and silent departures, debounced re-plans."""

import pytest

from flowspec_p2p.cluster import membership as cluster
from flowspec_p2p.cluster.control import PeerInfo
from flowspec_p2p.cluster.device import DeviceProfile
from flowspec_p2p.cluster.membership import Heard, Joined, Left, Membership, Planned, Tick, apply, devices, needs_replan


def info(aid: str, role: str = "member", gflops: float = 10.0, **kw) -> PeerInfo:
    return PeerInfo(id=aid, cluster="c", role=role, host="127.0.0.1", port=1000 + len(aid),
                    profile=DeviceProfile(memory_bytes=1 << 30, gflops=gflops, threads=1), **kw)


@pytest.fixture
def state():
    return Membership(self_info=info("lead", role="leader"))


def replay(state, *events):
    for e in events:
        state = apply(state, e)
    return state


def test_a_burst_of_joins_yields_one_replan_after_the_debounce(state):
    s = replay(state, Joined(info("a"), at=0.0), Joined(info("b"), at=0.3))
    assert not needs_replan(s, 0.3 + cluster.REPLAN_DEBOUNCE_S / 2)
    assert needs_replan(s, 0.3 + cluster.REPLAN_DEBOUNCE_S)
    s = apply(s, Planned(at=1.0))
    assert not needs_replan(s, 10.0)
    assert [d.id for d in devices(s)] == ["a", "b", "lead"]
    assert [d.leader for d in devices(s)] == [False, False, True]


def test_heartbeats_keep_a_member_and_do_not_replan(state):
    s = replay(state, Joined(info("a"), at=0.0), Planned(at=0.0))
    t = 0.0
    while t < 10:
        t += cluster.HEARTBEAT_INTERVAL_S
        s = replay(s, Heard("a", at=t, epoch=1, state="ready"), Tick(at=t))
    assert "a" in s.members
    assert s.members["a"].state == "ready"
    assert s.members["a"].epoch == 1
    assert s.changed_at is None


def test_a_member_that_goes_silent_is_dropped_and_triggers_a_replan(state):
    s = replay(state, Joined(info("a"), at=0.0), Planned(at=0.0), Heard("a", at=1.0))
    s = apply(s, Tick(at=1.0 + cluster.HEARTBEAT_TIMEOUT_S - 0.01))
    assert "a" in s.members
    s = apply(s, Tick(at=1.0 + cluster.HEARTBEAT_TIMEOUT_S + 0.01))
    assert "a" not in s.members
    assert s.departed == (("a", "timeout"),)
    assert needs_replan(s, 100.0)


def test_bye_and_mdns_removal_leave_at_once(state):
    s = replay(state, Joined(info("a"), at=0.0), Joined(info("b"), at=0.0), Planned(at=0.0),
               Left("a", at=1.0, reason="bye"), Left("b", at=1.1, reason="mdns"))
    assert s.members == {}
    assert s.changed_at == 1.1
    assert s.departed == (("a", "bye"), ("b", "mdns"))


def test_rejoining_unchanged_is_not_a_change_but_a_new_profile_is(state):
    s = replay(state, Joined(info("a"), at=0.0), Planned(at=0.0), Joined(info("a"), at=1.0))
    assert s.changed_at is None
    assert s.members["a"].last_seen == 1.0
    s = apply(s, Joined(info("a", gflops=20.0), at=2.0))
    assert s.changed_at == 2.0


def test_a_failed_member_is_left_out_of_plans_until_it_rejoins(state):
    s = replay(state, Joined(info("a"), at=0.0), Planned(at=0.0), Heard("a", at=1.0, epoch=1, state="failed"))
    assert s.changed_at == 1.0
    assert [d.id for d in devices(s)] == ["lead"]
    s = replay(s, Planned(at=2.0), Joined(info("a"), at=3.0))
    assert [d.id for d in devices(s)] == ["a", "lead"]
    assert s.changed_at == 3.0


def test_events_about_unknown_or_self_are_ignored(state):
    assert apply(state, Heard("x", at=1.0)) == state
    assert apply(state, Left("x", at=1.0)) == state
    assert apply(state, Joined(info("lead", role="leader"), at=1.0)) == state


def test_a_failed_member_that_still_answers_is_retried_with_backoff(state, monkeypatch):
    from flowspec_p2p.cluster import membership

    monkeypatch.setattr(membership, "RETRY_BASE_S", 10.0)
    s = replay(state, Joined(info("a"), at=0.0), Planned(at=0.0), Heard("a", at=1.0, epoch=3, state="failed"),
               Planned(at=1.5))
    assert [d.id for d in devices(s)] == ["lead"]
    s = replay(s, Heard("a", at=5.0, epoch=2, state="ready"), Heard("a", at=8.0, epoch=2, state="ready"),
               Heard("a", at=10.5, epoch=2, state="ready"), Tick(at=10.9))
    assert s.members["a"].failed  # not yet: 10 s after the failure
    s = apply(s, Tick(at=11.0))
    assert [d.id for d in devices(s)] == ["a", "lead"]
    assert s.changed_at == 11.0
    # a stale report of the same failure (epoch 3 or older) does not count again; a new one does, and waits 20 s
    s = replay(s, Planned(at=11.5), Heard("a", at=12.0, epoch=3, state="failed"))
    assert not s.members["a"].failed
    s = replay(s, Heard("a", at=13.0, epoch=4, state="failed"), Heard("a", at=14.0, epoch=4, state="ready"),
               *(Heard("a", at=float(t), epoch=4, state="ready") for t in range(16, 33, 2)), Tick(at=32.9))
    assert s.members["a"].failed
    assert s.members["a"].failures == 2
    assert not apply(s, Tick(at=33.0)).members["a"].failed
    # one that stays silent after failing is not retried (and times out)
    quiet = replay(state, Joined(info("b"), at=0.0), Heard("b", at=1.0, epoch=1, state="failed"))
    assert apply(quiet, Tick(at=3.0)).members["b"].failed
