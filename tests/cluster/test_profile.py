"""Device profiles: the micro-benchmark measures a decoder block; configuration replaces measurements."""

import torch

from flowspec_p2p.cluster import profile
from flowspec_p2p.cluster.profile import REFERENCE_CONFIG, benchmark_block, measure


def test_the_benchmark_reports_a_positive_rate_and_slowdown_divides_it(monkeypatch):
    monkeypatch.setattr(profile, "BENCH_REPEATS", 2)
    rate = benchmark_block(REFERENCE_CONFIG, tokens=4, context=16, repeats=2)
    assert rate > 0.01
    monkeypatch.setattr(profile, "benchmark_block", lambda cfg, **kw: 40.0)
    assert measure(slowdown=4.0).gflops == 10.0
    assert measure().measured


def test_configured_values_replace_measurements(monkeypatch):
    monkeypatch.setattr(profile, "benchmark_block", lambda *a, **kw: (_ for _ in ()).throw(AssertionError))
    before = torch.get_num_threads()
    try:
        p = measure(memory_bytes=123, gflops=4.5, link_mbps=50.0, latency_ms=2.0, threads=1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    got = (p.memory_bytes, p.gflops, p.link_mbps, p.latency_ms, p.threads, p.measured)
    assert got == (123, 4.5, 50.0, 2.0, 1, False)


def test_available_memory_is_plausible():
    assert profile.available_memory_bytes() > 16 * 1024 * 1024


def test_the_memory_offered_is_a_fraction_of_what_psutil_says_is_available(monkeypatch):
    from collections import namedtuple

    mem = namedtuple("svmem", "total available")(total=16 << 30, available=6 << 30)  # as psutil reports on macOS too
    monkeypatch.setattr(profile.psutil, "virtual_memory", lambda: mem)
    monkeypatch.setattr(profile, "benchmark_block", lambda cfg, **kw: 40.0)
    assert profile.available_memory_bytes() == 6 << 30
    assert measure().memory_bytes == int((6 << 30) * profile.MEMORY_FRACTION)
