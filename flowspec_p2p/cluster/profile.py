"""What a device can offer, measured when its agent starts: free memory, decoder-block throughput, threads.

    memory_bytes   what the agent offers for the model (weights, KV cache, activations): MEMORY_FRACTION of the
                   memory available now without swapping (psutil: ``MemAvailable`` on Linux, free + inactive pages
                   on macOS, the available physical memory on Windows), or a configured offer (``--memory-mb``)
    runtime_bytes  the agent process's own memory before any weights (its resident set once the benchmark ran, plus
                   RUNTIME_MARGIN for the servers and buffers a running agent adds): the planner adds it to a
                   stage's count for the resident set it expects
    gflops         effective GFLOP/s of one decoder block of the model (or of REFERENCE_CONFIG when the agent
                   has no model copy yet) on a BENCH_TOKENS-token segment over a BENCH_CONTEXT-token cache, on the
                   agent's engine, median of BENCH_REPEATS runs, divided by the emulated compute slowdown. The planner
                   turns it into seconds per layer: tokens * 2 * layer_params / (gflops * 1e9)
    link_mbps      the device's link estimate (configured, or the emulated bandwidth); None = unknown

The benchmark runs on random weights: it measures the device, not the model's values, and needs no weights.
"""

from __future__ import annotations

import logging
import time

import psutil
import torch

from ..model.arch import ModelConfig
from ..model.engine import Engine
from ..model.load import get_engine, set_threads
from .device import DeviceProfile

log = logging.getLogger(__name__)

MEMORY_FRACTION = 0.8  # of the available memory, leaving room for the OS and other programs
RUNTIME_MARGIN = 48 << 20  # bytes a running agent holds beyond its resident set at the measurement
BENCH_TOKENS = 16  # a FlowSpec segment
BENCH_CONTEXT = 128  # tokens already in the KV cache
BENCH_REPEATS = 5
BENCH_WARMUP = 2
SCORE_DIGITS = 2  # significant digits kept: two agents on equal hardware advertise equal scores

# SmolLM2-135M's block shape: the reference when the agent has no model copy yet.
REFERENCE_CONFIG = ModelConfig(
    arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
    num_kv_heads=3, head_dim=64, rms_eps=1e-5, rope_theta=100000.0, max_position=2048,
)


def available_memory_bytes() -> int:
    """Memory the OS could give us now without swapping (psutil works on Linux, macOS, Windows and the BSDs)."""
    return int(psutil.virtual_memory().available)


def block_flops(cfg: ModelConfig, tokens: int, context: int) -> float:
    """Multiply-adds x 2 of one decoder block on ``tokens`` new tokens over ``context`` cached ones."""
    attn = 2 * 2 * tokens * (context + tokens) * cfg.q_dim  # scores + weighted values
    return 2.0 * cfg.layer_params() * tokens + attn


def benchmark_block(cfg: ModelConfig, engine: Engine | None = None, *, tokens: int = BENCH_TOKENS,
                    context: int = BENCH_CONTEXT, repeats: int = BENCH_REPEATS) -> float:
    """GFLOP/s of one decoder block with random weights (median of ``repeats``) on ``engine`` (default
    ``get_engine()``), the engine the device's stages will run."""
    engine = engine or get_engine()
    return block_flops(cfg, tokens, context) / engine.layer_seconds(cfg, tokens, context, repeats) / 1e9


def _round(x: float, digits: int = SCORE_DIGITS) -> float:
    if x <= 0:
        return x
    from math import floor, log10

    return round(x, digits - 1 - floor(log10(x)))


def measure(model: ModelConfig | None = None, *, threads: int | None = None, memory_bytes: int | None = None,
            gflops: float | None = None, link_mbps: float | None = None, latency_ms: float = 0.0,
            slowdown: float = 1.0, engine: Engine | None = None) -> DeviceProfile:
    """Measure this device (or take the configured values) on ``engine`` (default ``get_engine()``). ``threads``
    also sets the compute threads."""
    if threads:
        set_threads(threads)
    threads = torch.get_num_threads()
    measured = memory_bytes is None and gflops is None
    if gflops is None:
        t0 = time.perf_counter()
        raw = benchmark_block(model or REFERENCE_CONFIG, engine=engine)
        gflops = _round(raw / slowdown)
        log.info("micro-benchmark: %.2f GFLOP/s per block (%d threads, slowdown %g) in %.2f s", gflops, threads,
                 slowdown, time.perf_counter() - t0)
    if memory_bytes is None:
        memory_bytes = int(available_memory_bytes() * MEMORY_FRACTION)
    return DeviceProfile(memory_bytes=memory_bytes, gflops=gflops, threads=threads, link_mbps=link_mbps,
                         latency_ms=latency_ms, slowdown=slowdown, measured=measured, runtime_bytes=runtime_bytes())


def runtime_bytes() -> int:
    """This process's own memory (its resident set now, RUNTIME_MARGIN added): what an agent holds before weights."""
    return int(psutil.Process().memory_info().rss) + RUNTIME_MARGIN
