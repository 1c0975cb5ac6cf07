"""Edge-device emulation: link delivery-time arithmetic and the compute slowdown rule."""

import pydantic
import pytest

from flowspec_p2p.pipeline.emulation import ComputeEmulation, DeviceClock, LinkEmulation, LinkSchedule


def test_back_to_back_frames_queue_behind_each_other_then_add_latency():
    s = LinkSchedule(LinkEmulation(bandwidth_mbps=100.0, latency_ms=2.0))
    # 12_500 bytes = 100_000 bits = 1 ms at 100 Mbit/s
    assert s.delivery_time(10.0, 12_500) == pytest.approx(10.0 + 0.001 + 0.002)
    assert s.delivery_time(10.0, 12_500) == pytest.approx(10.0 + 0.002 + 0.002)  # waited for the first
    assert s.delivery_time(10.0005, 25_000) == pytest.approx(10.0 + 0.004 + 0.002)
    assert s.delivery_time(20.0, 12_500) == pytest.approx(20.0 + 0.001 + 0.002)  # an idle link starts fresh


def test_unlimited_bandwidth_is_pure_latency_and_order_is_kept():
    s = LinkSchedule(LinkEmulation(latency_ms=5.0))
    times = [s.delivery_time(t, n) for t, n in [(0.0, 10**9), (0.001, 1), (0.001, 10)]]
    assert times == pytest.approx([0.005, 0.006, 0.006])
    assert times == sorted(times)


def test_emulation_is_off_by_default_and_described_in_reports():
    assert not LinkEmulation().enabled
    assert not ComputeEmulation().enabled
    assert LinkEmulation().describe() == "links: not emulated"
    assert LinkEmulation(bandwidth_mbps=100, latency_ms=2).describe() == "links: 100 Mbit/s, 2 ms one-way latency"
    assert ComputeEmulation(slowdown=4).describe() == "compute slowdown 4x (this host's uncontended speed)"
    measured = ComputeEmulation(slowdown=4, basis="measured")
    assert measured.describe() == "compute slowdown 4x (the measured compute time)"


def test_compute_slowdown_waits_s_minus_one_times_the_compute_time():
    assert ComputeEmulation(slowdown=4.0).extra_wait(0.010) == pytest.approx(0.030)
    assert ComputeEmulation().extra_wait(0.010) == 0.0
    clock = DeviceClock(ComputeEmulation(slowdown=4.0, basis="measured"))
    assert clock.extra_wait(2, 0.010) == pytest.approx(0.030)
    assert clock.extra_wait(2, 0.020) == pytest.approx(0.060)  # contention is multiplied by the slowdown


def test_device_time_follows_the_fastest_compute_so_host_contention_does_not_count():
    clock = DeviceClock(ComputeEmulation(slowdown=4.0), window=3)
    assert clock.extra_wait(1, 0.010) == pytest.approx(0.030)  # uncontended: as the measured basis
    assert clock.extra_wait(1, 0.020) == pytest.approx(0.020)  # the host was busy: still 4 x 10 ms in all
    assert clock.extra_wait(1, 0.050) == 0.0  # contention beyond the slowdown shows (never negative)
    assert clock.extra_wait(4, 0.016) == pytest.approx(0.048)  # each row count has its own reference
    clock.extra_wait(1, 0.012)
    assert clock.extra_wait(1, 0.012) == pytest.approx(0.036)  # the window forgot the 10 ms forward
    assert DeviceClock(ComputeEmulation()).extra_wait(1, 0.010) == 0.0
    assert clock.extra_wait(0, 0.0001) == pytest.approx(0.0003)  # all rows skipped: not a 0-row reference


@pytest.mark.parametrize("kw", [{"bandwidth_mbps": 0}, {"latency_ms": -1}, {"bandwidth_mbps": -5}])
def test_invalid_link_settings_are_rejected(kw):
    with pytest.raises(pydantic.ValidationError):
        LinkEmulation(**kw)
    with pytest.raises(pydantic.ValidationError):
        ComputeEmulation(slowdown=0.5)
