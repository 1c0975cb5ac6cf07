"""Edge-device emulation: link delivery-time arithmetic and the compute slowdown rule."""

import pydantic
import pytest

from flowspec_p2p.emulation import ComputeEmulation, LinkEmulation, LinkSchedule


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
    assert ComputeEmulation(slowdown=4).describe() == "compute slowdown 4x"


def test_compute_slowdown_waits_s_minus_one_times_the_compute_time():
    assert ComputeEmulation(slowdown=4.0).extra_wait(0.010) == pytest.approx(0.030)
    assert ComputeEmulation().extra_wait(0.010) == 0.0


@pytest.mark.parametrize("kw", [{"bandwidth_mbps": 0}, {"latency_ms": -1}, {"bandwidth_mbps": -5}])
def test_invalid_link_settings_are_rejected(kw):
    with pytest.raises(pydantic.ValidationError):
        LinkEmulation(**kw)
    with pytest.raises(pydantic.ValidationError):
        ComputeEmulation(slowdown=0.5)
