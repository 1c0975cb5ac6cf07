"""What a device offers the planner (memory, compute, threads, link), as agents advertise it: plain data, without
the benchmark that measures it (profile.py), so that the control plane's messages need no torch."""

from __future__ import annotations

from pydantic import Field

from ..types import FrozenModel

MAX_MEMORY_BYTES = 1 << 50  # 1 PiB
MAX_GFLOPS = 1e7  # 10 PFLOP/s; the slowest device a planner takes is MIN_GFLOPS
MIN_GFLOPS = 1e-3
MAX_THREADS = 4096
MAX_LINK_MBPS = 1e7
MAX_LATENCY_MS = 1e5
MAX_SLOWDOWN = 1e4


class DeviceProfile(FrozenModel):
    """Every number is finite and in a physical range: a peer's profile feeds the planner's arithmetic."""

    memory_bytes: int = Field(ge=0, le=MAX_MEMORY_BYTES)  # offered for the model (--memory-mb), runtime aside
    runtime_bytes: int | None = Field(default=None, ge=0, le=MAX_MEMORY_BYTES)  # the agent before any weights
    gflops: float = Field(ge=MIN_GFLOPS, le=MAX_GFLOPS, allow_inf_nan=False)
    threads: int = Field(ge=1, le=MAX_THREADS)
    link_mbps: float | None = Field(default=None, gt=0, le=MAX_LINK_MBPS, allow_inf_nan=False)
    latency_ms: float = Field(default=0.0, ge=0, le=MAX_LATENCY_MS, allow_inf_nan=False)
    slowdown: float = Field(default=1.0, ge=1.0, le=MAX_SLOWDOWN, allow_inf_nan=False)
    measured: bool = True  # False when memory or compute came from configuration
