"""The async stage worker: a StageCore (stage.py) between an inbound queue and the link to the successor.

    inbox (Frames from the RingServer or a QueueSender) -> StageCore.handle, strictly in order -> successor

Forwards run on one worker thread (torch releases the GIL), so the event loop keeps answering heartbeats and
HTTP while a stage computes; cheap messages (prune, reset, release) are applied inline, which is safe because
the loop awaits each message before it takes the next. Sending runs as its own task, so computing message
k+1 overlaps sending message k; order is kept by a FIFO queue.

After a forward the worker asks its ``Device`` (emulation.py) to finish it: a real device is done at once; an
emulated one, s times slower, holds the result (and the next message) until it would be done. Each stage then
appends its busy seconds to the returned Forward (``stage_s``).

Observability: ``snapshot()`` (counters for /cluster) and ``timeline()`` (busy intervals: wall-clock start and
end of each forward including the emulated wait, in a bounded ring buffer, for per-stage timeline charts).

When the inbound link breaks, every request that came through it gets a StageError (reason "link_lost") sent
downstream, so the leader resumes it at once instead of waiting for a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

from ..errors import PeerGone
from ..model.engine import StopFlag
from .emulation import Device
from .messages import MAX_ERROR_TEXT, DataMessage, Forward, Prune, Release, StageError
from .stage import StageCore, Tensors
from .transport import Frame, Inbox, LinkDown, Sender

log = logging.getLogger(__name__)

TIMELINE_LENGTH = 8192  # busy intervals kept per stage
MAX_BATCH_REQUESTS = 16  # forwards of different requests run together in one engine call
MAX_BATCH_ROWS = 1024  # rows of one batched forward (a prefill chunk and the decode rows that ride with it)
OUTBOX_FRAMES = 64  # results waiting for the successor link; more and the stage stops taking frames
BACKLOG_FRAMES = 256  # inbound frames a stage takes ahead of the one it computes (look-ahead)
RECENT_FORWARDS = 64  # forwards whose busy time sets the stall bound the leader checks (forward_slowest_s)


@dataclass(frozen=True)
class BusyInterval:
    """One forward on this stage. ``start``/``end`` are time.time() (comparable across local processes), measured
    around the forward and the emulated slowdown wait; ``compute_s`` is the forward alone."""

    start: float
    end: float
    compute_s: float
    request_id: str  # the first request of a batched forward
    nodes: int  # rows of every request in it
    tag: int
    requests: int = 1  # requests whose forwards ran together


async def _hold_until(deadline: float) -> bool:
    """An emulated device's wait for a forward nothing can cut short: until time.perf_counter() reaches
    ``deadline``. -> False (not discarded)"""
    await asyncio.sleep(max(0.0, deadline - time.perf_counter()))
    return False


class _DiscardWatch:
    """Whether the first prune of a tree forward's request that arrives behind it discards every node of it.
    Arriving events are appended to the worker's backlog in order (they are handled after the forward)."""

    def __init__(self, msg: Forward, backlog: deque, link: int = 0):
        self.msg, self.backlog, self.link = msg, backlog, link
        self.nodes = set(range(msg.first, msg.first + len(msg.parents)))
        self.armed = not msg.commit  # committing forwards (prefill) are never discarded
        self.discarded = False
        for ev in backlog:  # a prune already queued was applied by look-ahead; later ones cannot cut this forward
            if self._decides(ev):
                self.armed = False
                break

    def _decides(self, ev) -> bool:
        """Whether ``ev`` is the message that settles this forward's fate (a prune or the request's end, on the
        forward's own link)."""
        return isinstance(ev, Frame) and ev.link == self.link and ev.msg.request_id == self.msg.request_id \
            and isinstance(ev.msg, Prune | Release | StageError)

    def arrived(self, ev) -> None:
        self.backlog.append(ev)
        if self.armed and self._decides(ev):
            self.armed = False
            self.discarded = isinstance(ev.msg, Prune) and not self.nodes & set(ev.msg.keep)


class StageWorker:
    """Runs ``core`` on the frames arriving in ``inbox`` and sends the results to ``successor``.

    Ownership: the worker owns its successor link once given (``set_successor`` closes the one it replaces;
    ``run`` closes the current one when it ends). ``run()`` runs until cancelled; give it to a TaskGroup."""

    def __init__(self, core: StageCore, successor: Sender | None = None, *, inbox: asyncio.Queue | None = None,
                 device: Device | None = None, name: str | None = None):
        self.core = core
        self.successor = successor
        self.inbox: asyncio.Queue = inbox if inbox is not None else Inbox()
        self.device = device or Device()
        self.name = name or f"stage{core.index}"
        self.timeline_buffer: deque[BusyInterval] = deque(maxlen=TIMELINE_LENGTH)
        # engine_calls / engine_rows: forwards run (one per batch) and the rows they carried: rows per engine call
        self.counters = {"frames_in": 0, "frames_out": 0, "dropped_out": 0, "compute_s": 0.0, "busy_s": 0.0,
                         "max_queue": 0, "engine_calls": 0, "engine_rows": 0}
        self._out: asyncio.Queue = asyncio.Queue(OUTBOX_FRAMES)  # full: the compute loop waits (backpressure)
        self._forward_since: float | None = None  # time.perf_counter() when the forward computing now began
        self._recent_s: deque[float] = deque(maxlen=RECENT_FORWARDS)  # busy seconds of the last forwards
        self.running = False

    async def set_successor(self, successor: Sender | None) -> None:
        old, self.successor = self.successor, successor
        if old is not None and old is not successor:
            await old.close()

    async def run(self) -> None:
        executor = ThreadPoolExecutor(1, thread_name_prefix=self.name)
        self.running = True
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._send_loop(), name=f"{self.name}-send")
                await self._compute_loop(executor)
        finally:
            self.running = False
            executor.shutdown(wait=False, cancel_futures=True)
            if self.successor is not None:
                await self.successor.close()

    async def _next(self, backlog: deque) -> object:
        """The next inbound event; everything already queued moves to ``backlog`` so forwards can look ahead."""
        if not backlog:
            backlog.append(await self.inbox.get())
        while not self.inbox.empty() and len(backlog) < BACKLOG_FRAMES:
            backlog.append(self.inbox.get_nowait())
        self.counters["max_queue"] = max(self.counters["max_queue"], len(backlog))
        return backlog.popleft()

    async def _compute_loop(self, executor: ThreadPoolExecutor) -> None:
        loop = asyncio.get_running_loop()
        backlog: deque = deque()
        while True:
            ev = await self._next(backlog)
            if isinstance(ev, LinkDown):
                await self._link_down(ev)
                continue
            assert isinstance(ev, Frame)
            msg = ev.msg
            self.counters["frames_in"] += 1
            if isinstance(msg, Forward):
                group = self._gather(ev, backlog)
                self.counters["frames_in"] += len(group) - 1
                if len(group) > 1:
                    for out in await self._forward_batch(loop, executor, group, backlog):
                        if out is not None:
                            await self._out.put(out)
                    continue
                out = await self._forward(loop, executor, ev, backlog)
            else:
                out = self.core.handle(msg, ev.tensors, link=ev.link)
            if out is not None:
                await self._out.put(out)

    @staticmethod
    def _gather(ev: Frame, backlog: deque) -> list[Frame]:
        """``ev`` (a Forward) and the queued Forwards of other requests that can run with it in one engine call:
        of ``ev``'s micro-batch (Forward.group), each the first queued message of its request (so every request's
        messages still apply in order) and, for one
        that reuses a retained request's KV, behind no message of that request (its Release must come first), at
        most MAX_BATCH_REQUESTS of them and MAX_BATCH_ROWS rows. They leave the backlog; the rest keep their
        order."""
        group, rows = [ev], len(ev.msg.parents)
        taken = {ev.msg.request_id}  # requests in the group, or with an earlier message still queued
        for e in list(backlog):
            if len(group) >= MAX_BATCH_REQUESTS:
                break
            if not isinstance(e, Frame):  # a link event: what follows it waits for it
                break
            rid = e.msg.request_id
            if isinstance(e.msg, Forward) and rid not in taken and e.msg.reuse not in taken \
                    and e.msg.group == ev.msg.group and rows + len(e.msg.parents) <= MAX_BATCH_ROWS:
                group.append(e)
                rows += len(e.msg.parents)
                backlog.remove(e)
            taken.add(rid)
        return group

    async def _forward_batch(self, loop, executor: ThreadPoolExecutor, group: list[Frame], backlog: deque
                             ) -> list[tuple[DataMessage, Tensors] | None]:
        """Run the Forwards of several requests in one engine call (StageCore.handle_batch), then let the device
        finish them. A batch runs to the end: a prune of one of its requests does not cut the others short (its
        rows are skipped by look-ahead where the prune was queued before the batch started)."""
        start = time.time()
        t0 = time.perf_counter()
        items = [(e.msg, e.tensors, [x.msg for x in backlog if isinstance(x, Frame) and x.link == e.link], e.link)
                 for e in group]
        self._forward_since = t0
        try:
            outs = await loop.run_in_executor(executor, self.core.handle_batch, items)
            compute_s = time.perf_counter() - t0
            rows = sum(o[0].computed_rows for o in outs if o is not None and isinstance(o[0], Forward))
            self._engine_call(rows)
            await self.device.finish(rows, compute_s, t0, len(self.core.shard.layers), False, _hold_until)
        finally:
            self._forward_since = None
        end = time.time()
        self._recent_s.append(end - start)
        self.counters["compute_s"] += compute_s
        self.counters["busy_s"] += end - start
        self.counters["batched_forwards"] = self.counters.get("batched_forwards", 0) + len(group)
        first = group[0].msg
        self.timeline_buffer.append(BusyInterval(start, end, compute_s, first.request_id,
                                                 sum(len(e.msg.parents) for e in group), first.tag, len(group)))
        busy = round(end - start, 6)
        return [o if o is None or not isinstance(o[0], Forward) else
                (o[0].model_copy(update={"stage_s": [*o[0].stage_s, busy]}), o[1]) for o in outs]

    async def _forward(self, loop, executor: ThreadPoolExecutor, ev: Frame, backlog: deque
                       ) -> tuple[DataMessage, Tensors] | None:
        """Run one Forward, then let the device finish it. Frames that arrive meanwhile join ``backlog``; when the
        first prune of this request among them discards every node of the forward, the forward stops at its next
        layer (stage.py) and an emulated device at its next emulated layer boundary."""
        msg = ev.msg
        start = time.time()
        t0 = time.perf_counter()
        upcoming = [e.msg for e in backlog if isinstance(e, Frame) and e.link == ev.link]  # look-ahead (stage.py)
        stop = StopFlag()  # set from this loop, read by the forward between layers
        watch = _DiscardWatch(msg, backlog, ev.link)
        self._forward_since = t0
        try:
            job = loop.run_in_executor(executor, self.core.handle, msg, ev.tensors, upcoming, stop.is_set, ev.link)
            if await self._watch(job, None, watch):
                stop.set()
                await job
            out = job.result()
            if out is None:
                return None
            compute_s = time.perf_counter() - t0
            result = out[0] if isinstance(out[0], Forward) else None  # else a StageError: nothing ran
            rows = len(msg.parents) if result is None else result.computed_rows
            self._engine_call(rows)
            await self.device.finish(rows, compute_s, t0, len(self.core.shard.layers), watch.discarded,
                                     lambda deadline: self._watch(None, deadline, watch))
        finally:
            self._forward_since = None
        if result is not None and (stop.is_set() or watch.discarded):
            result = result.model_copy(update={"dead": list(range(len(msg.parents)))})
            self.counters["cut"] = self.counters.get("cut", 0) + 1
        end = time.time()
        self._recent_s.append(end - start)
        self.counters["compute_s"] += compute_s
        self.counters["busy_s"] += end - start
        self.timeline_buffer.append(BusyInterval(start, end, compute_s, msg.request_id, len(msg.parents), msg.tag))
        if result is None:
            return out
        return result.model_copy(update={"stage_s": [*result.stage_s, round(end - start, 6)]}), out[1]

    def _engine_call(self, rows: int) -> None:
        if rows > 0:
            self.counters["engine_calls"] += 1
            self.counters["engine_rows"] += rows

    async def _watch(self, job: asyncio.Future | None, deadline: float | None, watch: _DiscardWatch) -> bool:
        """Wait until ``job`` is done (or time.perf_counter() reaches ``deadline``), moving arriving frames to the
        backlog. -> True as soon as ``watch`` sees a prune that discards the forward (the wait is cut short)."""
        if watch.discarded:
            return True
        if not watch.armed or len(watch.backlog) >= BACKLOG_FRAMES:
            if job is not None:
                await job
            else:
                await asyncio.sleep(max(0.0, deadline - time.perf_counter()))
            return False
        while True:
            getter = asyncio.ensure_future(self.inbox.get())
            waits = {getter} if job is None else {getter, job}
            timeout = None if deadline is None else max(0.0, deadline - time.perf_counter())
            try:
                done, _ = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                getter.cancel()  # the worker stops: its getter goes with it (not left pending as the loop closes)
                raise
            if getter not in done:
                getter.cancel()
                await asyncio.wait({getter})  # it may have taken a frame before the cancel landed
            if not getter.cancelled():
                watch.arrived(getter.result())
                while not self.inbox.empty() and len(watch.backlog) < BACKLOG_FRAMES:
                    watch.arrived(self.inbox.get_nowait())
            if watch.discarded:
                return True
            if len(watch.backlog) >= BACKLOG_FRAMES:  # taken far enough ahead: wait without reading more
                return await self._watch(job, deadline, watch)
            if (job is not None and job.done()) or (deadline is not None and time.perf_counter() >= deadline):
                return False
            if not watch.armed:  # the deciding message came and keeps some node: nothing more to watch for
                return await self._watch(job, deadline, watch)

    async def _link_down(self, ev: LinkDown) -> None:
        """The requests that came through a lost inbound link end here (their states are freed) and downstream."""
        if ev.direction != "in":
            return
        for rid in [rid for rid, st in self.core.retained.items() if st.link == ev.link]:
            self.core.drop(rid, retained=True)  # their requests' leader cannot reach them through this link any more
        lost = [(rid, st) for rid, st in self.core.requests.items() if st.link == ev.link]
        for rid, state in lost:
            text = f"stage {self.core.index} lost its link from {ev.peer}: {ev.reason}"
            err = StageError(request_id=rid, seq=state.next_seq, stage=self.core.index, reason="link_lost",
                             message=text[:MAX_ERROR_TEXT])
            out = self.core.handle(err, {}, link=ev.link)
            if out is not None:
                await self._out.put(out)
        if lost:
            log.warning("%s: link from %s down (%s); failed %d request(s)", self.name, ev.peer, ev.reason, len(lost))

    async def _send_loop(self) -> None:
        while True:
            msg, tensors = await self._out.get()
            succ = self.successor
            if succ is None:
                self.counters["dropped_out"] += 1
                log.warning("%s: no successor; dropped %s of request %s", self.name, msg.kind, msg.request_id)
                continue
            try:
                await succ.send(msg, tensors)
                self.counters["frames_out"] += 1
            except PeerGone as e:
                self.counters["dropped_out"] += 1
                log.warning("%s: dropped %s of request %s: %s", self.name, msg.kind, msg.request_id, e)
            except Exception as e:
                self.counters["dropped_out"] += 1
                log.warning("%s: cannot send %s of request %s (%s); failing the request", self.name, msg.kind,
                            msg.request_id, e)
                self.core.drop(msg.request_id)
                if not isinstance(msg, StageError):
                    err = StageError(request_id=msg.request_id, seq=msg.seq, stage=self.core.index,
                                     message=f"stage {self.core.index} could not send its result: {e}"[:MAX_ERROR_TEXT])
                    with contextlib.suppress(Exception):
                        await succ.send(err, {})

    # ------------------------------------------------------------------------------------ observability

    def snapshot(self) -> dict:
        """Counters for /cluster: the core's (forwards, tokens, prunes, errors) and the worker's."""
        c = dict(self.counters)
        since = self._forward_since
        # the leader's stall check (coordinator.py): how long the forward in progress has run, against the slowest
        # of the recent ones
        c["forward_running_s"] = 0.0 if since is None else round(time.perf_counter() - since, 3)
        c["forward_slowest_s"] = round(max(self._recent_s, default=0.0), 4)
        c["compute_s"] = round(c["compute_s"], 4)
        c["busy_s"] = round(c["busy_s"], 4)
        return {
            "stage": self.core.index,
            "layers": str(self.core.shard.layers),
            "running": self.running,
            "open_requests": len(self.core.requests),
            "queued": self.inbox.qsize(),
            "emulation": self.device.describe(),
            **self.core.counters,
            **c,
            "successor": None if self.successor is None else self.successor.peer,
        }

    def timeline(self, since: float | None = None) -> list[dict]:
        """Busy intervals (oldest first) that end after ``since`` (time.time())."""
        return [asdict(b) for b in self.timeline_buffer if since is None or b.end > since]
