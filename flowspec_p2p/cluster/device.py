"""What a device offers the planner (memory, compute, threads, link), as agents advertise it: plain data, without
the benchmark that measures it (profile.py), so that the control plane's messages need no torch."""

from __future__ import annotations

from pydantic import Field

from ..types import FrozenModel


class DeviceProfile(FrozenModel):
    memory_bytes: int = Field(ge=0)
    gflops: float = Field(gt=0)
    threads: int = Field(ge=1)
    link_mbps: float | None = Field(default=None, gt=0)
    latency_ms: float = Field(default=0.0, ge=0)
    slowdown: float = Field(default=1.0, ge=1.0)
    measured: bool = True  # False when memory or compute came from configuration
