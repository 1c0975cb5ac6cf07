"""Emulating edge devices on one host: slow links and slow compute, for benchmarks. Off by default; where it is on,
the agent installs it as a wrapper (a link's ``LinkEmulation``, a stage's ``EmulatedDevice``, the leader's
``EmulatedCompute``) and nothing else in the data path knows about it.

Link emulation is applied by the *sender* of each data-plane link, frame by frame:

    serialisation   a frame of B bytes occupies the link for B * 8 / (bandwidth_mbps * 1e6) seconds; frames queue
                    behind each other (one wire), so a burst of segments drains at the link rate
    latency         every frame then arrives latency_ms later (one-way propagation)
    order           FIFO is preserved: a frame is never delivered before one sent earlier

So frame i is delivered at ``d_i = max(t_i, w_{i-1}) + B_i*8/bw + latency`` with ``w_i = max(t_i, w_{i-1}) +
B_i*8/bw`` (``t_i`` the send time). The sender does not block: like a kernel socket buffer, the pacer holds the
frames until they are due. ``LinkSchedule`` is that arithmetic (pure, tested with a fake clock); ``Pacer`` is the
asyncio shell that holds frames until they are due.

Compute emulation (``ComputeEmulation``, applied per stage by an ``EmulatedDevice`` through a ``DeviceClock``): N stages
sharing a few cores should behave like N devices each ``slowdown`` times slower than one uncontended core. A
forward of r computed rows (rows the look-ahead skipped do not count) that computed for t seconds is held until
``slowdown * t_min(r)`` has passed, where t_min(r) is the fastest of the stage's last 64 r-row forwards (basis
"fastest"): stages that happen to compute at the same
time on the shared host (which real devices would not) then still look like independent devices, as long as the
contention stays below the slowdown. Basis "measured" holds it (slowdown - 1) * t instead, which multiplies any
contention by the slowdown too: concurrent stages (FlowSpec, Chunk-PP) are penalised against one-at-a-time
ones (autoregressive). The leader's compute (drafting, LM head, verification; ``EmulatedCompute``) uses basis
"cpu": it stays busy until slowdown x the CPU time its compute thread used has passed (``cpu_time_wait``; with more
than one torch thread the thread's CPU time misses their work, so it falls back to "measured"). Every benchmark
report states the emulation it used (``describe``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Literal, Protocol, TypeVar

import torch
from pydantic import Field

from ..types import Settings

log = logging.getLogger(__name__)


class LinkEmulation(Settings):
    """A link's emulated bandwidth (Mbit/s; None = unlimited) and one-way latency (ms)."""

    bandwidth_mbps: float | None = Field(None, gt=0)
    latency_ms: float = Field(0.0, ge=0, le=60_000)

    @property
    def enabled(self) -> bool:
        return self.bandwidth_mbps is not None or self.latency_ms > 0

    def describe(self) -> str:
        if not self.enabled:
            return "links: not emulated"
        bw = "unlimited" if self.bandwidth_mbps is None else f"{self.bandwidth_mbps:g} Mbit/s"
        return f"links: {bw}, {self.latency_ms:g} ms one-way latency"


def measured_wait(slowdown: float, compute_s: float) -> float:
    """Basis "measured": wait (s - 1) * t after computing for t seconds (wall clock)."""
    return (slowdown - 1.0) * compute_s


def cpu_time_wait(slowdown: float, wall_s: float, cpu_s: float) -> float:
    """Basis "cpu": after ``wall_s`` seconds that used ``cpu_s`` seconds of CPU, the wait until s * cpu_s have
    passed (negative: none; waiting for a core on the shared host is not the emulated device's work)."""
    return slowdown * cpu_s - wall_s if slowdown > 1.0 else 0.0


class ComputeEmulation(Settings):
    """Compute slowdown s >= 1 (see the module docstring for the two bases)."""

    slowdown: float = Field(1.0, ge=1.0, le=1000.0)
    basis: Literal["fastest", "measured"] = "fastest"

    @property
    def enabled(self) -> bool:
        return self.slowdown > 1.0

    def extra_wait(self, compute_s: float) -> float:
        """Basis "measured" (``measured_wait``)."""
        return measured_wait(self.slowdown, compute_s)

    def describe(self) -> str:
        if not self.enabled:
            return "compute: not emulated"
        of = "this host's uncontended speed" if self.basis == "fastest" else "the measured compute time"
        return f"compute slowdown {self.slowdown:g}x ({of})"


class DeviceClock:
    """One stage's emulated device: how long to hold a forward after it computed (ComputeEmulation)."""

    def __init__(self, emulation: ComputeEmulation, window: int = 64):
        self.emulation = emulation
        self.window = window
        self.recent: dict[int, deque[float]] = {}  # rows -> compute seconds of the last ``window`` such forwards

    def extra_wait(self, rows: int, compute_s: float, record: bool = True) -> float:
        """Seconds to hold a forward of ``rows`` rows that computed in ``compute_s``. ``record``: a sample of
        this device's speed (not for a forward cut short)."""
        e = self.emulation
        if not e.enabled:
            return 0.0
        if e.basis == "measured":
            return e.extra_wait(compute_s)
        if rows <= 0:  # every row was skipped (look-ahead): no forward ran, only bookkeeping
            return e.extra_wait(compute_s)
        seen = self.recent.setdefault(rows, deque(maxlen=self.window))
        if record:
            seen.append(compute_s)
        elif not seen:
            return e.extra_wait(compute_s)
        return max(0.0, e.slowdown * min(seen) - compute_s)


NO_LINK_EMULATION = LinkEmulation()
NO_COMPUTE_EMULATION = ComputeEmulation()


class Device:
    """A stage's device as it is: a forward is done when it has computed (the worker's default)."""

    async def finish(self, rows: int, compute_s: float, t0: float, layers: int, cut: bool,
                     wait: Callable[[float], Awaitable[bool]]) -> None:
        """Called after each forward; returns when the device would be done with it (see EmulatedDevice)."""

    def describe(self) -> str:
        return NO_COMPUTE_EMULATION.describe()


class EmulatedDevice(Device):
    """A stage's device ``emulation.slowdown`` times slower (DeviceClock). ``finish`` holds the forward until the
    emulated device would be done; ``wait(deadline)`` (the worker's) waits until time.perf_counter() reaches the
    deadline and says True as soon as a prune arrived that discards the whole forward: the emulated device then
    stops at its next emulated layer boundary."""

    def __init__(self, emulation: ComputeEmulation):
        self.emulation = emulation
        self.clock = DeviceClock(emulation)

    async def finish(self, rows: int, compute_s: float, t0: float, layers: int, cut: bool,
                     wait: Callable[[float], Awaitable[bool]]) -> None:
        """``rows``: rows computed; ``t0``: time.perf_counter() at the start; ``cut``: the forward was already cut
        short (nothing to learn about the device's speed from it)."""
        hold = max(0.0, self.clock.extra_wait(rows, compute_s, record=not cut))
        if hold <= 0:
            return
        emulated = compute_s + hold  # the whole forward on the emulated device, one layer at a time
        layer = emulated / max(1, layers)
        if cut or await wait(t0 + emulated):
            elapsed = time.perf_counter() - t0
            stop_at = min(emulated, math.ceil(elapsed / layer - 1e-9) * layer)
            await asyncio.sleep(max(0.0, t0 + stop_at - time.perf_counter()))

    def describe(self) -> str:
        return self.emulation.describe()


def device_for(emulation: ComputeEmulation) -> Device:
    """The device a stage with this compute emulation runs on (a fresh clock for each)."""
    return EmulatedDevice(emulation) if emulation.enabled else Device()


T = TypeVar("T")


class TimedCompute(Protocol):
    async def timed(self, fn: Callable[..., T], *args: Any) -> tuple[T, float, float]:
        """-> (fn(*args), wall seconds, CPU seconds of the thread it ran on)"""

    def close(self) -> None: ...


class EmulatedCompute:
    """The leader's compute on a device ``slowdown`` times slower: after fn ran for t seconds using c seconds of
    CPU, it stays busy until slowdown x c has passed (basis "cpu"; with more than one torch thread, or basis
    "measured", it waits (slowdown - 1) x t). Wraps the leader's compute thread (decoding.context.ThreadCompute)."""

    def __init__(self, inner: TimedCompute, slowdown: float, basis: Literal["cpu", "measured"] = "cpu"):
        self.inner = inner
        self.slowdown = slowdown
        self.basis = basis
        # the emulated device is one: a call (its compute and its wait) holds it, so several requests' calls take
        # the sum of their emulated times, as on the slow device (without it, one call's wait overlapped the next
        # call's compute)
        self._device = asyncio.Lock()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        async with self._device:
            out, wall_s, cpu_s = await self.inner.timed(fn, *args)
            if self.basis == "cpu" and torch.get_num_threads() == 1:
                wait = cpu_time_wait(self.slowdown, wall_s, cpu_s)
            else:
                wait = measured_wait(self.slowdown, wall_s)
            if wait > 0:
                await asyncio.sleep(wait)
        return out

    def describe(self) -> str:
        return f"leader compute slowdown {self.slowdown:g}x (basis {self.basis})"

    def close(self) -> None:
        self.inner.close()


class LinkSchedule:
    """Pure delivery-time arithmetic of one emulated link (see the module docstring)."""

    def __init__(self, emulation: LinkEmulation):
        self.emulation = emulation
        self.wire_free_at = float("-inf")  # when the last queued frame finishes serialising

    def serialisation_s(self, nbytes: int) -> float:
        bw = self.emulation.bandwidth_mbps
        return 0.0 if bw is None else nbytes * 8 / (bw * 1e6)

    def delivery_time(self, now: float, nbytes: int) -> float:
        """Send a frame of ``nbytes`` at ``now``; return when it arrives at the far end."""
        start = max(now, self.wire_free_at)
        self.wire_free_at = start + self.serialisation_s(nbytes)
        return self.wire_free_at + self.emulation.latency_ms / 1e3


class Pacer:
    """Holds frames until their emulated delivery time, then hands them to ``deliver`` in FIFO order.

    ``submit`` never blocks. The pacing task is owned by the pacer: ``start()`` creates it, ``close()`` cancels
    and awaits it (the link that owns the pacer calls both). ``error`` holds what stopped delivery, if anything."""

    def __init__(
        self,
        emulation: LinkEmulation,
        deliver: Callable[[bytes], Awaitable[None]],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.schedule = LinkSchedule(emulation)
        self.deliver = deliver
        self.clock = clock
        self.queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        self.error: BaseException | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        assert self._task is None
        self._task = asyncio.get_running_loop().create_task(self._run(), name="link-pacer")

    def submit(self, frame: bytes) -> None:
        if self.error is not None:
            raise self.error
        self.queue.put_nowait((self.schedule.delivery_time(self.clock(), len(frame)), frame))

    async def drain(self) -> None:
        """Wait until every submitted frame has been delivered (or delivery failed)."""
        await self.queue.join()

    async def _run(self) -> None:
        while True:
            due, frame = await self.queue.get()
            try:
                wait = due - self.clock()
                if wait > 0:
                    await asyncio.sleep(wait)
                if self.error is None:
                    await self.deliver(frame)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the link broke: remember it, drop what is queued (the owner is told)
                log.debug("paced delivery failed: %s", e)
                self.error = e
            finally:
                self.queue.task_done()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task])  # never swallows the caller's own cancellation
            self._task = None
