"""Admission of requests to the pipeline: at most ``limit`` decoded at once (their KV sits on every stage), the
rest waiting in arrival order (FIFO: one client's burst queues behind requests that came before it), at most
``max_waiting`` of them; a request that would wait beyond that, or longer than its timeout, is refused with
``Busy`` (HTTP 503 with Retry-After). The limit follows the plan (``set_limit``: the planner counts KV for that many
requests on every stage).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque

from ..errors import Busy


class Admission:
    def __init__(self, limit: int, max_waiting: int):
        assert limit >= 1, limit
        assert max_waiting >= 0, max_waiting
        self.limit = limit
        self.max_waiting = max_waiting
        self.in_flight = 0
        self._queue: deque[asyncio.Future] = deque()
        self.admitted = 0  # requests admitted so far, and the seconds they waited for it in all
        self.waited_s = 0.0

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def set_limit(self, limit: int) -> None:
        """A new plan's number of requests in flight; a larger one admits waiters at once (a smaller one lets the
        requests in flight finish)."""
        self.limit = max(1, limit)
        self._grant()

    async def acquire(self, timeout_s: float) -> float:
        """Wait for a turn. -> seconds waited. Raises Busy when the queue is full or the turn does not come within
        ``timeout_s``; a caller cancelled while it waits leaves the queue (its turn, if granted, passes on)."""
        if self.in_flight < self.limit and not self._queue:
            self.in_flight += 1
            self._admitted(0.0)
            return 0.0
        if len(self._queue) >= self.max_waiting:
            raise Busy(f"{len(self._queue)} requests are already waiting; retry later")
        t0 = time.perf_counter()
        turn = asyncio.get_running_loop().create_future()
        self._queue.append(turn)
        try:
            async with asyncio.timeout(timeout_s):
                await turn
        except BaseException as e:
            self._withdraw(turn)
            if isinstance(e, TimeoutError):
                raise Busy(f"waited {timeout_s:g} s for the requests ahead; retry later") from None
            raise
        waited = time.perf_counter() - t0
        self._admitted(waited)
        return waited

    def _withdraw(self, turn: asyncio.Future) -> None:
        """A waiter gave up (timeout, or its client left): out of the queue, or, when its turn was granted just as
        it gave up, the turn passes on."""
        if turn.done() and not turn.cancelled():
            self.release()
            return
        turn.cancel()
        with contextlib.suppress(ValueError):
            self._queue.remove(turn)

    def release(self) -> None:
        """A request admitted by ``acquire`` ended."""
        self.in_flight -= 1
        assert self.in_flight >= 0
        self._grant()

    def _grant(self) -> None:
        while self._queue and self.in_flight < self.limit:
            turn = self._queue.popleft()
            if not turn.done():
                self.in_flight += 1
                turn.set_result(None)

    def _admitted(self, waited: float) -> None:
        self.admitted += 1
        self.waited_s += waited

    def snapshot(self) -> dict:
        return {"max_requests": self.limit, "in_flight": self.in_flight, "waiting": self.waiting,
                "max_waiting": self.max_waiting, "admitted": self.admitted,
                "mean_wait_s": round(self.waited_s / self.admitted, 4) if self.admitted else 0.0}

