"""Connection limits for an agent's servers, so a stranger on the LAN cannot starve an agent of descriptors.

aiohttp's own site accepts every connection and keeps an idle one for about an hour (its keep-alive), and an
idle TLS connection that never finishes its handshake for a minute: a device with the common limit of 1024 open
files stops accepting after ~1000 idle sockets from one stranger, and then serves neither its peers nor its API.
``GatedSite`` accepts connections itself and admits each through a ``Gate``:

    accept          over MAX_CONNECTIONS in all, or over MAX_UNVOUCHED / UNVOUCHED_PER_ADDRESS connections that
                    have not been vouched for: closed at once (the descriptor is freed; counted, logged once)
    TLS handshake   must finish within TLS_HANDSHAKE_TIMEOUT_S
    vouching        a connection is vouched for once it carries a request the server trusts (the agent server: one
                    with a valid session, guard.py; the API: any request); one that is not within UNVOUCHED_TTL_S
                    is closed
    keep-alive      the runner's keepalive_timeout (KEEPALIVE_TIMEOUT_S) ends idle vouched connections

``raise_fd_limit`` lifts the process's soft limit of open files to its hard limit at start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import socket
import ssl
import struct
import time
from collections import Counter
from dataclasses import dataclass

from aiohttp import web

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 768  # connections one server holds at once
MAX_UNVOUCHED = 256  # connections not (yet) vouched for, from anyone
UNVOUCHED_PER_ADDRESS = 16  # of them from one remote address, once lingering (LINGER_GRACE_S)
UNVOUCHED_TTL_S = 15.0  # a connection must carry a trusted request within this
LINGER_GRACE_S = 2.0  # the per-address cap counts connections unvouched for longer than this (a burst of new ones
# from a peer that authenticates at once is no stranger's idle hoard; the caps in all still bound it)
TLS_HANDSHAKE_TIMEOUT_S = 5.0
KEEPALIVE_TIMEOUT_S = 20.0  # idle vouched connections (longer than aiohttp clients' 15 s: they close first)
SWEEP_S = 1.0  # how often connections are looked over
ACCEPT_PAUSE_S = 0.1  # after accept() fails (out of descriptors): try again after this
FD_LIMIT_CAP = 1 << 20  # the soft limit raised to at most this (a hard limit of "unlimited")


def raise_fd_limit() -> int:
    """Raise this process's soft limit of open files to its hard limit. -> the soft limit now"""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = FD_LIMIT_CAP if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as e:
            log.warning("cannot raise the open-files limit from %d to %d: %s", soft, want, e)
    return soft


@dataclass
class _Conn:
    address: str
    since: float
    handler: web.RequestHandler | None = None  # set once its TLS handshake is done
    vouched: bool = False


class Gate:
    """Counts one server's connections and decides which to admit and which to close (see the module docstring).
    ``vouch(request)`` marks the request's connection as trusted."""

    def __init__(self, name: str, *, clock=time.monotonic):
        self.name = name
        self.clock = clock
        self._conns: dict[int, _Conn] = {}
        self._by_handler: dict[int, _Conn] = {}  # id(handler) -> its connection (the handler is held in it)
        self._next = 0
        self.refused = 0
        self.closed_idle = 0
        self._logged: set[str] = set()

    def vouch(self, request: web.Request) -> None:
        c = self._by_handler.get(id(request.protocol))
        if c is not None and c.handler is request.protocol:
            c.vouched = True

    @web.middleware
    async def vouch_all(self, request: web.Request, handler):
        """A middleware that vouches for every connection that carries a request (a server without sessions)."""
        self.vouch(request)
        return await handler(request)

    def _unvouched(self) -> list[_Conn]:
        return [c for c in self._conns.values() if not c.vouched]

    def admit(self, address: str) -> int | None:
        """A new connection from ``address`` -> its ticket, or None (refused: close it)."""
        self.sweep()
        now = self.clock()
        unvouched = self._unvouched()
        why = ""
        if len(self._conns) >= MAX_CONNECTIONS:
            why = f"{len(self._conns)} connections open"
        elif len(unvouched) >= MAX_UNVOUCHED:
            why = f"{len(unvouched)} connections not vouched for"
        elif sum(c.address == address and now - c.since > LINGER_GRACE_S for c in unvouched) >= UNVOUCHED_PER_ADDRESS:
            why = f"{UNVOUCHED_PER_ADDRESS} connections from {address} not vouched for"
        if why:
            self.refused += 1
            if address not in self._logged and len(self._logged) < 1024:
                self._logged.add(address)
                log.warning("%s: refusing connections from %s: %s", self.name, address, why)
            return None
        self._next += 1
        self._conns[self._next] = _Conn(address, self.clock())
        return self._next

    def opened(self, ticket: int, handler: web.RequestHandler) -> None:
        c = self._conns.get(ticket)
        if c is not None:
            c.handler = handler
            self._by_handler[id(handler)] = c

    def closed(self, ticket: int) -> None:
        c = self._conns.pop(ticket, None)
        if c is not None and c.handler is not None:
            self._by_handler.pop(id(c.handler), None)

    def sweep(self) -> None:
        """Forget closed connections; close those not vouched for within UNVOUCHED_TTL_S."""
        now = self.clock()
        for ticket, c in list(self._conns.items()):
            h = c.handler
            if h is None:
                continue  # in its TLS handshake (bounded by TLS_HANDSHAKE_TIMEOUT_S)
            if getattr(h, "transport", None) is None:
                self.closed(ticket)
            elif not c.vouched and now - c.since > UNVOUCHED_TTL_S:
                self.closed_idle += 1
                h.transport.close()
                self.closed(ticket)

    def counts(self) -> Counter:
        return Counter(c.address for c in self._conns.values())


class _Listener:
    """What BaseRunner.addresses and BaseSite.stop expect of a site's server."""

    def __init__(self, sock: socket.socket, task: asyncio.Task):
        self.sockets = [sock]
        self._task = task

    def close(self) -> None:
        sock = self.sockets[0]
        with contextlib.suppress(ValueError, OSError, RuntimeError):  # no reader left on a descriptor reused later
            asyncio.get_running_loop().remove_reader(sock.fileno())
        self._task.cancel()
        sock.close()


class GatedSite(web.BaseSite):
    """A TCP (optionally TLS) site whose connections pass through ``gate``."""

    __slots__ = ("_gate", "_host", "_port", "_reuse_port", "_tasks")

    def __init__(self, runner: web.BaseRunner, host: str, port: int, *, gate: Gate,
                 ssl_context: ssl.SSLContext | None = None, reuse_port: bool = False, backlog: int = 128):
        super().__init__(runner, ssl_context=ssl_context, backlog=backlog)
        self._host, self._port, self._gate, self._reuse_port = host, port, gate, reuse_port
        self._tasks: set[asyncio.Task] = set()

    @property
    def name(self) -> str:
        scheme = "https" if self._ssl_context else "http"
        return f"{scheme}://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if self._reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((self._host, self._port))
            sock.listen(self._backlog)
            sock.setblocking(False)
        except OSError:
            sock.close()
            self._runner._unreg_site(self)
            raise
        self._port = sock.getsockname()[1]
        loop = asyncio.get_running_loop()
        self._server = _Listener(sock, loop.create_task(self._accept(sock), name=f"accept-{self._port}"))

    async def stop(self) -> None:
        await super().stop()
        for t in list(self._tasks):
            t.cancel()

    async def _accept(self, sock: socket.socket) -> None:
        """Accept what the listening socket holds whenever it is readable (asyncio's own way, which uvloop runs too;
        ``loop.sock_accept`` stalls under uvloop with many connections at once)."""
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()
        loop.add_reader(sock.fileno(), ready.set)
        sweeper = loop.create_task(self._sweep())
        try:
            while True:
                await ready.wait()
                ready.clear()
                for _ in range(self._backlog):
                    try:
                        conn, addr = sock.accept()
                    except (BlockingIOError, InterruptedError):
                        break
                    except OSError as e:  # out of descriptors, or the peer reset before accept: pause, go on
                        log.debug("%s: accept failed: %s", self._gate.name, e)
                        await asyncio.sleep(ACCEPT_PAUSE_S)
                        break
                    try:
                        self._admit(loop, conn, str(addr[0]))
                    except Exception:  # a bug here must not stop the agent accepting
                        log.exception("%s: admitting a connection failed", self._gate.name)
                        conn.close()
                else:
                    ready.set()  # more may wait: after the others had their turn
                    await asyncio.sleep(0)
        finally:
            if sock.fileno() != -1:
                with contextlib.suppress(ValueError, OSError):
                    loop.remove_reader(sock.fileno())
            sweeper.cancel()

    def _admit(self, loop: asyncio.AbstractEventLoop, conn: socket.socket, address: str) -> None:
        ticket = self._gate.admit(address)
        if ticket is None:
            with contextlib.suppress(OSError):  # a reset, not a FIN: nothing lingers
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()
            return
        task = loop.create_task(self._serve(conn, ticket))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            self._gate.sweep()

    async def _serve(self, conn: socket.socket, ticket: int) -> None:
        loop = asyncio.get_running_loop()
        server = self._runner.server
        try:
            conn.setblocking(False)
            if server is None:
                raise ConnectionAbortedError("the server is stopping")
            kw = {"ssl_handshake_timeout": TLS_HANDSHAKE_TIMEOUT_S} if self._ssl_context is not None else {}
            # the loop gets a socket of its own (uvloop closes the descriptor it was given when the connection ends,
            # and ``conn`` would close it again: by then, possibly another connection's)
            own = conn.dup()
            conn.close()
            conn = own
            handler = server()  # ours, not what the loop returns (uvloop returns its TLS wrapper)
            await loop.connect_accepted_socket(lambda: handler, own, ssl=self._ssl_context, **kw)
        except (OSError, ssl.SSLError, TimeoutError, ConnectionError, asyncio.CancelledError):
            self._gate.closed(ticket)
            conn.close()
            return
        self._gate.opened(ticket, handler)
