"""Data-plane links between agents: aiohttp websockets carrying codec frames around the ring.

    leader --Link--> /ring of stage 1 --Link--> /ring of stage 2 ... stage N --Link--> /ring of the leader

Every agent's aiohttp app serves ``GET /ring`` (``ring_server.RingServer``): an *inbound* link from its ring
predecessor. Each agent opens one *outbound* ``Link`` to its successor. A link is one-way: data frames only flow
from the dialler to the server, so the FIFO order of a websocket is the order of the ring.

Handshake: the dialler sends a ``RingHello`` (protocol version, cluster name, plan epoch, sender id) as the first
text frame; the server answers a ``RingWelcome`` or closes with a reason (close codes below). A link from another
cluster, another protocol version, or a stale or unknown plan epoch is refused; when the control plane moves to
a new epoch (``ring_server.RingServer.set_epoch``) the server closes its inbound links of older epochs.

Failure handling: a frame that fails validation closes *that* link with a logged reason and never the agent.
Either end's owner is told through its event queue: the server posts ``LinkDown`` to its inbox after the last
frame of the link, and an outbound link posts ``LinkDown`` to the queue its owner gave it. ``Link.send`` on a
link that is down raises ``PeerGone``. Websocket heartbeats (``HEARTBEAT_S``) detect a peer that vanished
without closing its socket.

``QueueSender`` is the in-memory stand-in for a ``Link`` (same ``send``/``close``), for a stage that runs
inside the leader's own process and for tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Literal, Protocol

import aiohttp
import torch
from pydantic import Field, ValidationError

from ..errors import PeerGone, ProtocolError
from ..model.dtypes import DTYPE_NAMES
from ..types import FrozenModel
from . import codec
from .emulation import NO_LINK_EMULATION, LinkEmulation, Pacer

log = logging.getLogger(__name__)

RING_PATH = "/ring"
HANDSHAKE_TIMEOUT_S = 5.0
HEARTBEAT_S = 10.0  # websocket ping interval; a pong must come back within half of it or the link is down
CLOSE_TIMEOUT_S = 2.0

CLOSE_BAD_FRAME = 4400  # a frame failed validation
CLOSE_REFUSED = 4403  # handshake refused: wrong cluster, protocol, sender, or not serving
CLOSE_STALE_EPOCH = 4409  # handshake refused or link retired: the plan epoch is not the current one
CLOSE_SHUTDOWN = 4503  # the agent is stopping



class RingHello(FrozenModel):
    """First frame of a link, dialler -> server."""

    protocol: int
    cluster: str = Field(min_length=1, max_length=128)
    epoch: int = Field(ge=0)
    sender: str = Field(min_length=1, max_length=128)
    # the dtype of every float tensor on this link (None: not fixed; a server whose plan names one refuses that)
    wire_dtype: Literal["float16", "bfloat16", "float32", "float64"] | None = None


class RingWelcome(FrozenModel):
    """The server's answer to an accepted RingHello."""

    protocol: int
    epoch: int
    receiver: str


_link_ids = itertools.count(1)


def next_link_id() -> int:
    """A process-wide id for a new link (either end)."""
    return next(_link_ids)


@dataclass(frozen=True)
class Frame:
    """A decoded data-plane message that arrived on an inbound link (or an in-memory channel) ``link``."""

    msg: object
    tensors: dict[str, torch.Tensor]
    peer: str
    link: int = 0  # serial of the link it came on (unique in this process)
    received_at: float = 0.0  # time.time() when it arrived


@dataclass(frozen=True)
class LinkDown:
    """Link ``link`` (of plan ``epoch``) closed or broke. ``direction``: "in" (from the predecessor) or "out"."""

    peer: str
    reason: str
    direction: str
    link: int = 0
    epoch: int = 0


Event = Frame | LinkDown

INBOX_FRAMES = 64  # frames an Inbox holds; a sender's put waits for room beyond this (backpressure)


class Inbox(asyncio.Queue):
    """A stage's inbound queue: ``put`` of a Frame waits while ``limit`` frames are queued (the ring server then
    stops reading that socket, so TCP pushes back on the sender); a ``LinkDown`` always goes in at once, so the
    news of a lost link is never held back or lost."""

    def __init__(self, limit: int = INBOX_FRAMES):
        super().__init__()
        self.limit = limit
        self.frames = 0  # Frames queued (LinkDowns do not count)
        self._room = asyncio.Event()
        self._room.set()

    async def put(self, item) -> None:
        while isinstance(item, Frame) and self.frames >= self.limit:
            self._room.clear()
            await self._room.wait()
        self.put_nowait(item)

    def put_nowait(self, item) -> None:
        super().put_nowait(item)
        if isinstance(item, Frame):
            self.frames += 1

    def get_nowait(self):
        item = super().get_nowait()
        if isinstance(item, Frame):
            self.frames -= 1
            if self.frames < self.limit:
                self._room.set()
        return item


class Sender(Protocol):
    """What a stage worker or the leader sends through: a ``Link`` or a ``QueueSender``."""

    peer: str

    async def send(self, msg, tensors: dict[str, torch.Tensor] | None = None) -> None: ...

    async def close(self) -> None: ...

    @property
    def closed(self) -> bool: ...


@dataclass
class LinkCounters:
    frames: int = 0
    bytes: int = 0
    errors: int = 0
    opened_at: float = field(default_factory=time.time)

    def as_dict(self) -> dict:
        return {"frames": self.frames, "bytes": self.bytes, "errors": self.errors}


# ------------------------------------------------------------------------------------------------ outbound


class Link:
    """An outbound link to the successor's ``/ring``. Use ``await Link.connect(...)``; ``close()`` when done
    (the owner's ``finally``). ``send`` encodes and sends one frame, in order; with link emulation the frame is
    paced (emulation.py) and ``send`` returns at once."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse, session: aiohttp.ClientSession | None, peer: str, *,
                 epoch: int, owns_session: bool, events: asyncio.Queue | None, emulation: LinkEmulation,
                 float_dtype: torch.dtype | None):
        self.ws = ws
        self.peer = peer
        self.epoch = epoch
        self.id = next_link_id()
        self.counters = LinkCounters()
        self.float_dtype = float_dtype
        self.emulation = emulation
        self.down_reason: str | None = None
        self._session = session if owns_session else None
        self._events = events
        self._pacer = Pacer(emulation, self._send_frame) if emulation.enabled else None
        self._reader: asyncio.Task | None = None

    @classmethod
    async def connect(
        cls,
        url: str,
        hello: RingHello,
        *,
        session: aiohttp.ClientSession | None = None,
        events: asyncio.Queue | None = None,
        emulation: LinkEmulation = NO_LINK_EMULATION,
        float_dtype: torch.dtype | None = None,
        timeout_s: float = HANDSHAKE_TIMEOUT_S,
    ) -> Link:
        """Dial ``url`` (``ws://host:port/ring``) and handshake, each within ``timeout_s``. Raises PeerGone
        (unreachable, no answer) or ProtocolError (refused: the reason says why, e.g. a stale plan epoch)."""
        if float_dtype is not None and hello.wire_dtype is None:
            hello = hello.model_copy(update={"wire_dtype": DTYPE_NAMES[float_dtype]})
        owns = session is None
        session = session or aiohttp.ClientSession()
        try:
            async with asyncio.timeout(timeout_s):  # connect + upgrade
                ws = await session.ws_connect(url, heartbeat=HEARTBEAT_S, max_msg_size=codec.MAX_FRAME_BYTES,
                                              compress=0, timeout=aiohttp.ClientWSTimeout(ws_close=CLOSE_TIMEOUT_S))
            try:
                await ws.send_str(hello.model_dump_json())
                reply = await asyncio.wait_for(ws.receive(), timeout_s)
                if reply.type == aiohttp.WSMsgType.CLOSE:
                    raise ProtocolError(f"{url} refused the link (code {reply.data}): {reply.extra}")
                if reply.type != aiohttp.WSMsgType.TEXT:
                    raise PeerGone(f"{url} answered the hello with {reply.type.name}")
                welcome = RingWelcome.model_validate_json(reply.data)
            except BaseException:
                await ws.close()
                raise
        except (aiohttp.ClientError, OSError, TimeoutError, ValidationError) as e:
            if owns:
                await session.close()
            raise PeerGone(f"cannot open a link to {url}: {e or type(e).__name__}") from e
        except BaseException:
            if owns:
                await session.close()
            raise
        link = cls(ws, session, welcome.receiver, epoch=hello.epoch, owns_session=owns, events=events,
                   emulation=emulation, float_dtype=float_dtype)
        link._start()
        log.info("link to %s (%s) open, epoch %d, %s", welcome.receiver, url, hello.epoch, emulation.describe())
        return link

    def _start(self) -> None:
        loop = asyncio.get_running_loop()
        self._reader = loop.create_task(self._watch(), name=f"link-to-{self.peer}")
        if self._pacer is not None:
            self._pacer.start()

    @property
    def closed(self) -> bool:
        return self.down_reason is not None

    async def send(self, msg, tensors: dict[str, torch.Tensor] | None = None) -> None:
        if self.down_reason is not None:
            raise PeerGone(f"link to {self.peer} is down: {self.down_reason}")
        frame = codec.encode(msg, tensors, float_dtype=self.float_dtype)
        self.counters.frames += 1
        self.counters.bytes += len(frame)
        if self._pacer is not None:
            try:
                self._pacer.submit(frame)
            except Exception as e:
                raise PeerGone(f"link to {self.peer} is down: {e}") from e
        else:
            await self._send_frame(frame)

    async def _send_frame(self, frame: bytes) -> None:
        try:
            await self.ws.send_bytes(frame)
        except (aiohttp.ClientError, ConnectionError, RuntimeError) as e:
            self._down(f"send failed: {e or type(e).__name__}")
            raise PeerGone(f"link to {self.peer} is down: {self.down_reason}") from e

    async def drain(self) -> None:
        """Wait until paced frames have been handed to the socket (no-op without emulation)."""
        if self._pacer is not None:
            await self._pacer.drain()

    async def _watch(self) -> None:
        """Read the (otherwise silent) return direction: it carries pongs and the server's close."""
        reason = "closed"
        try:
            async for m in self.ws:
                if m.type in (aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.BINARY):
                    log.warning("link to %s: unexpected frame from the receiver; ignored", self.peer)
            code = self.ws.close_code
            extra = self.ws.exception()
            reason = f"closed by {self.peer} (code {code})" if extra is None else f"broken: {extra}"
        except asyncio.CancelledError:
            raise
        except Exception as e:  # any socket failure ends this link only
            reason = f"broken: {e}"
        self._down(reason)

    def _down(self, reason: str) -> None:
        if self.down_reason is not None:
            return
        self.down_reason = reason
        self.counters.errors += 1
        log.warning("link to %s down: %s", self.peer, reason)
        if self._events is not None:
            self._events.put_nowait(LinkDown(self.peer, reason, "out", self.id, self.epoch))

    async def close(self) -> None:
        """Close the link (idempotent). Frames still held by the emulation pacer are dropped."""
        if self.down_reason is None:
            self.down_reason = "closed locally"
        if self._pacer is not None:
            await self._pacer.close()
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.wait([self._reader])  # never swallows the caller's own cancellation
            self._reader = None
        with contextlib.suppress(Exception):
            await self.ws.close()
        if self._session is not None:
            await self._session.close()
            self._session = None


class QueueSender:
    """In-memory stand-in for a Link: puts ``Frame``s on ``queue``. ``roundtrip=True`` passes every message
    through the codec (tests of the wire path without sockets)."""

    def __init__(self, queue: asyncio.Queue, peer: str = "local", *, roundtrip: bool = False,
                 float_dtype: torch.dtype | None = None):
        self.queue = queue
        self.peer = peer
        self.id = next_link_id()
        self.roundtrip = roundtrip
        self.float_dtype = float_dtype
        self.counters = LinkCounters()
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    async def send(self, msg, tensors: dict[str, torch.Tensor] | None = None) -> None:
        if self._closed:
            raise PeerGone(f"channel to {self.peer} is closed")
        tensors = tensors or {}
        if self.roundtrip:
            frame = codec.encode(msg, tensors, float_dtype=self.float_dtype)
            self.counters.bytes += len(frame)
            msg, tensors = codec.decode(frame)
        elif self.float_dtype is not None:
            tensors = {k: v.to(self.float_dtype) if v.is_floating_point() else v for k, v in tensors.items()}
        self.counters.frames += 1
        await self.queue.put(Frame(msg, tensors, self.peer, self.id, time.time()))  # a bounded inbox: backpressure

    async def close(self) -> None:
        self._closed = True
