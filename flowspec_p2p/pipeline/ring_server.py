"""The server end of the ring's links: ``GET /ring`` on every agent (see transport.py for the link protocol).

An accepted link's decoded frames go to the owner's inbox in arrival order, followed by a ``LinkDown`` when the link
ends; a frame that fails validation closes that link (``CLOSE_BAD_FRAME``) with a logged reason, never the agent.

Where the agent authenticates its peers (``authenticated``: the sender a request proved, cluster/guard.py), a
link's sender is that authenticated agent: a hello naming another sender is refused.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web
from pydantic import ValidationError

from ..errors import ProtocolError
from . import codec
from .messages import PROTOCOL_VERSION
from .transport import (
    CLOSE_BAD_FRAME,
    CLOSE_REFUSED,
    CLOSE_SHUTDOWN,
    CLOSE_STALE_EPOCH,
    HANDSHAKE_TIMEOUT_S,
    HEARTBEAT_S,
    RING_PATH,
    Frame,
    LinkCounters,
    LinkDown,
    RingHello,
    RingWelcome,
    next_link_id,
)

log = logging.getLogger(__name__)

MAX_INBOUND_LINKS = 8  # open inbound links at once (a ring has one per epoch; a switch overlaps two)


@dataclass
class _Inbound:
    ws: web.WebSocketResponse
    hello: RingHello
    id: int = field(default_factory=next_link_id)
    counters: LinkCounters = field(default_factory=LinkCounters)


class RingServer:
    """The ``/ring`` endpoint of one agent. Decoded frames of every accepted link go to ``inbox`` (set by the
    owner: the stage worker's queue, or the leader's return queue), in arrival order, followed by a
    ``LinkDown`` when the link ends. ``install(app)`` adds the route and closes the links on shutdown."""

    def __init__(self, agent_id: str, cluster: str, *, epoch: int = 0, inbox: asyncio.Queue | None = None,
                 allowed: Callable[[RingHello], bool] | None = None, max_frame_bytes: int = codec.MAX_FRAME_BYTES,
                 authenticated: Callable[[web.Request], str | None] | None = None):
        self.agent_id = agent_id
        self.cluster = cluster
        self.epoch = epoch
        self.inbox = inbox
        self.allowed = allowed  # optional extra check (e.g. "is the sender my planned predecessor?")
        self.authenticated = authenticated  # the agent id a request proved (None: the hello's word is taken)
        self.max_frame_bytes = max_frame_bytes
        self.wire_dtype: str | None = None  # the plan's wire dtype: every link must carry exactly it (None: any)
        self.links: dict[int, _Inbound] = {}
        self.refused = 0
        self.bad_frames = 0

    def install(self, app: web.Application) -> None:
        app.router.add_get(RING_PATH, self.handle)
        app.on_shutdown.append(self._on_shutdown)

    async def set_epoch(self, epoch: int) -> None:
        """Adopt a new plan epoch: inbound links of other epochs are closed."""
        self.epoch = epoch
        for link in list(self.links.values()):
            if link.hello.epoch != epoch:
                await link.ws.close(code=CLOSE_STALE_EPOCH, message=f"plan epoch {epoch} replaced yours".encode())

    def snapshot(self) -> list[dict]:
        return [{"peer": x.hello.sender, "epoch": x.hello.epoch, "link": x.id, **x.counters.as_dict()}
                for x in self.links.values()]

    async def _on_shutdown(self, app: web.Application) -> None:
        for link in list(self.links.values()):
            await link.ws.close(code=CLOSE_SHUTDOWN, message=b"agent stopping")

    def _refusal(self, hello: RingHello, sender: str | None) -> tuple[int, str] | None:
        if self.authenticated is not None and hello.sender != sender:
            return CLOSE_REFUSED, f"the hello names sender {hello.sender}, the link authenticated as {sender}"
        if hello.protocol != PROTOCOL_VERSION:
            return CLOSE_REFUSED, f"protocol {hello.protocol} != {PROTOCOL_VERSION}"
        if hello.cluster != self.cluster:
            return CLOSE_REFUSED, f"cluster {hello.cluster!r} != {self.cluster!r}"
        if hello.epoch != self.epoch:
            return CLOSE_STALE_EPOCH, f"plan epoch {hello.epoch} is not the current epoch {self.epoch}"
        if self.inbox is None:
            return CLOSE_REFUSED, "this agent serves no stage"
        if self.wire_dtype is not None and hello.wire_dtype != self.wire_dtype:
            return CLOSE_REFUSED, f"wire dtype {hello.wire_dtype} is not the plan's {self.wire_dtype}"
        if len(self.links) >= MAX_INBOUND_LINKS:
            return CLOSE_REFUSED, f"already {len(self.links)} inbound links"
        if self.allowed is not None and not self.allowed(hello):
            return CLOSE_REFUSED, f"{hello.sender} is not this agent's planned predecessor"
        return None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        ws = web.WebSocketResponse(heartbeat=HEARTBEAT_S, max_msg_size=self.max_frame_bytes, compress=False)
        await ws.prepare(request)
        peer = request.remote or "?"
        try:
            first = await ws.receive(timeout=HANDSHAKE_TIMEOUT_S)
            if first.type != aiohttp.WSMsgType.TEXT:
                raise ProtocolError(f"expected a hello, got {first.type.name}")
            hello = RingHello.model_validate_json(first.data)
        except (ProtocolError, ValidationError, TimeoutError) as e:
            self.refused += 1
            log.warning("ring: refused a link from %s: bad hello (%s)", peer, str(e).splitlines()[0])
            await ws.close(code=CLOSE_REFUSED, message=b"bad hello")
            return ws
        refusal = self._refusal(hello, self.authenticated(request) if self.authenticated is not None else None)
        if refusal is not None:
            self.refused += 1
            log.warning("ring: refused a link from %s (%s): %s", hello.sender, peer, refusal[1])
            await ws.close(code=refusal[0], message=refusal[1].encode()[:120])
            return ws
        inbox = self.inbox
        assert inbox is not None
        await ws.send_str(RingWelcome(protocol=PROTOCOL_VERSION, epoch=self.epoch, receiver=self.agent_id)
                          .model_dump_json())
        link = _Inbound(ws, hello)
        self.links[id(ws)] = link
        log.info("ring: link from %s (%s) open, epoch %d", hello.sender, peer, hello.epoch)
        reason = "closed"
        try:
            async for m in ws:
                if m.type == aiohttp.WSMsgType.ERROR:
                    break
                if m.type != aiohttp.WSMsgType.BINARY:
                    raise ProtocolError(f"unexpected {m.type.name} frame")
                msg, tensors = codec.decode(m.data, max_frame_bytes=self.max_frame_bytes,
                                            float_dtype=hello.wire_dtype)
                link.counters.frames += 1
                link.counters.bytes += len(m.data)
                # a bounded inbox (stage_host.TapQueue) makes this wait: the socket is not read meanwhile
                await inbox.put(Frame(msg, tensors, hello.sender, link.id, time.time()))
            reason = f"closed by {hello.sender} (code {ws.close_code})"
            if ws.exception() is not None:
                reason = f"broken: {ws.exception()}"
        except ProtocolError as e:
            self.bad_frames += 1
            link.counters.errors += 1
            reason = f"bad frame: {e}"
            log.warning("ring: closing the link from %s: %s", hello.sender, reason)
            await ws.close(code=CLOSE_BAD_FRAME, message=str(e).encode()[:120])
        finally:
            self.links.pop(id(ws), None)
            inbox.put_nowait(LinkDown(hello.sender, reason, "in", link.id, hello.epoch))
            log.info("ring: link from %s ended: %s", hello.sender, reason)
        return ws
