"""One tensor's bytes from the weight server into its part file, on a worker thread of its own (weight_server's
fetching side runs several at once).

The event loop makes the authenticated request for the manifest (the session's handshake, certificate pin and token,
pinning.py); the tensors' bytes then flow on plain blocking sockets in worker threads, each holding the GIL only
between TLS records: a ``Link`` carries what the loop's session proved (the address, the leader's pinned identity and
the session token), and a ``Receiver`` opens a connection of its own with it:

    connect    TCP, TLS 1.3 (identity.client_context), and the server's certificate must be the pinned identity
               before anything is sent (as pinning.PinningConnector checks the session's connections): the token
               goes to the authenticated leader only
    request    GET /weights/tensor/NAME with the token, and ``Range: bytes=N-`` when the part holds N bytes
    body       read straight into the part's staging buffer (TLS decrypts into it), hashed and written from there
               while it is still in the CPU's cache (weight_cache.PartFile.stage/commit: no whole-tensor buffer, no
               copy into the page cache where O_DIRECT works)

TLS runs over memory BIOs (``TlsStream``): the kernel's bytes are taken RECV_BYTES at a time and decrypted record by
record into the caller's buffer. An ``ssl.SSLSocket`` reads each 16 KiB record with system calls of its own (its
5-byte header, then the rest, each after a poll where the socket has a timeout) behind three Python frames: about
40% more CPU per GB received. On the asyncio streams the same bytes cost about twice the CPU again: copied into a TLS
memory BIO, decrypted into a new bytes object per read, parsed, queued, joined for the writer. ``Receiver.cancel``
(from the loop) shuts the socket so a blocked read ends at once. A 401 (the session expired or the leader restarted)
raises ``Unauthorized``: the caller renews the link through the session and tries again.
"""

from __future__ import annotations

import contextlib
import http.client
import io
import socket
import ssl
import threading
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import PeerGone, ProtocolError, WeightsError
from .handshake import SESSION_HEADER
from .identity import client_context, fingerprint_of_der
from .weight_cache import PartFile

TENSOR_PREFIX = "/weights/tensor/"
ERROR_BODY_BYTES = 2000  # of a refusal's text, kept for its error
RECV_BYTES = 256 << 10  # bytes taken from the kernel at a time (about 16 TLS records)


class Unauthorized(PeerGone):
    """The weight server refused the link's session (401)."""


@dataclass(frozen=True)
class Link:
    """Where and how a member reaches the weight server outside its aiohttp session."""

    host: str
    port: int
    tls: bool
    identity: str | None  # the certificate fingerprint the server must present (None: plain http, the open mode)
    token: str | None  # the session token (None in the open mode)
    connect_timeout_s: float
    stall_timeout_s: float

    def __post_init__(self):
        if self.tls and not self.identity:
            raise ProtocolError(f"no pinned identity for {self.host}:{self.port}: weights are fetched only from "
                                "an agent this one authenticated")

    def connect(self) -> tuple[socket.socket, socket.socket | TlsStream]:
        """A connection to the server, TLS with the pinned certificate checked. -> (the TCP socket, what HTTP is
        spoken over: a TlsStream, or the socket itself in the open mode)"""
        try:
            sock = socket.create_connection((self.host, self.port), timeout=self.connect_timeout_s)
        except OSError as e:
            raise PeerGone(f"cannot reach the weight server {self.host}:{self.port}: {e}") from e
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            stream: socket.socket | TlsStream = sock
            if self.tls:
                stream = TlsStream(sock, client_context())
                try:
                    stream.handshake()
                except (OSError, ssl.SSLError) as e:
                    raise PeerGone(f"TLS with the weight server {self.host}:{self.port} failed: {e}") from e
                der = stream.peer_der()
                got = fingerprint_of_der(der) if der else ""
                if got != self.identity:
                    raise ProtocolError(f"{self.host}:{self.port} presents certificate {got[:12] or 'none'}, not the "
                                        f"identity {self.identity[:12]} this agent authenticated there")
            sock.settimeout(self.stall_timeout_s)
        except BaseException:
            sock.close()
            raise
        return sock, stream


class TlsStream:
    """TLS 1.3 (client side) over a connected blocking socket through memory BIOs, as much of a socket as http.client
    needs (``sendall``, ``makefile``, ``close``). ``readinto(b)`` decrypts what the kernel holds into ``b``, record
    by record, taking RECV_BYTES from the socket at a time; it returns once ``b`` is full or no whole record is
    left, 0 at the end of the stream."""

    def __init__(self, sock: socket.socket, context: ssl.SSLContext):
        self.sock = sock
        self._in, self._out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._tls = context.wrap_bio(self._in, self._out, server_hostname=None)
        self._buf = memoryview(bytearray(RECV_BYTES))
        self._eof = False  # the socket's end was read

    def handshake(self) -> None:
        while True:
            try:
                self._tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                self._flush()
                if not self._fill():
                    raise ConnectionResetError("the server closed the connection during the TLS handshake") from None
        self._flush()

    def peer_der(self) -> bytes | None:
        return self._tls.getpeercert(binary_form=True)

    def _flush(self) -> None:
        if self._out.pending:
            self.sock.sendall(self._out.read())

    def _fill(self) -> bool:
        """Move what the kernel holds (RECV_BYTES at most; waits for some) into the TLS input. -> False at its end"""
        n = self.sock.recv_into(self._buf)
        if not n:
            self._in.write_eof()
            return False
        self._in.write(self._buf[:n])
        return True

    def readinto(self, b) -> int:
        view = memoryview(b).cast("B")
        n = 0
        while n < len(view):
            try:
                k = self._tls.read(len(view) - n, view[n:])
            except ssl.SSLWantReadError:
                if n or self._eof:
                    break
                self._flush()  # (an answer to a post-handshake message, a key update)
                self._eof = not self._fill()
                continue
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):  # the end (a cut short tensor fails on its length)
                break
            if not k:
                break
            n += k
        return n

    def sendall(self, data: bytes) -> None:
        self._tls.write(data)
        self._flush()

    def makefile(self, mode: str = "rb") -> io.BufferedReader:
        assert mode == "rb"
        return io.BufferedReader(_Reader(self))

    def close(self) -> None:
        self.sock.close()


class _Reader(io.RawIOBase):
    """A TlsStream as a raw file to buffer (as socket.makefile's SocketIO: closing it leaves the stream open)."""

    def __init__(self, stream: TlsStream):
        super().__init__()
        self.stream = stream

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        return self.stream.readinto(b)


class Receiver:
    """Fetch one tensor into ``part`` (opened, holding ``part.have`` bytes) over ``link``: ``run()`` on a worker
    thread -> bytes received; ``arrived(n)`` is called (on that thread) as bytes are stored."""

    def __init__(self, link: Link, name: str, part: PartFile, arrived: Callable[[int], None]):
        self.link, self.name, self.part, self.arrived = link, name, part, arrived
        self.path = TENSOR_PREFIX + urllib.parse.quote(name, safe="")
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._cancelled = False

    def cancel(self) -> None:
        """End a ``run`` in progress (from any thread): its socket is shut, a blocked read returns."""
        with self._lock:
            self._cancelled = True
            if self._sock is not None:
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_RDWR)

    def run(self) -> int:
        part, nbytes = self.part, self.part.nbytes
        where = f"{self.link.host}:{self.link.port}{self.path}"
        sock, stream = self.link.connect()
        with self._lock:
            if self._cancelled:
                stream.close()
                raise PeerGone(f"fetching {self.name}: cancelled")
            self._sock = sock
        conn = http.client.HTTPConnection(self.link.host, self.link.port)
        conn.sock = stream  # connected and checked: http.client only speaks HTTP over it
        got = 0
        try:
            headers = {"Accept-Encoding": "identity"}
            if self.link.token is not None:
                headers[SESSION_HEADER] = self.link.token
            if part.have:
                headers["Range"] = f"bytes={part.have}-"
            try:
                conn.request("GET", self.path, headers=headers)
                r = conn.getresponse()
            except (OSError, http.client.HTTPException) as e:
                raise PeerGone(f"fetching {self.name} from {where} failed: {e or type(e).__name__}") from e
            if r.status == 401:
                raise Unauthorized(f"{where}: the weight server refused this agent's session")
            if r.status == 200 and part.have:  # a server without ranges: the whole tensor again
                part.restart()
            elif r.status == 206:
                want = f"bytes {part.have}-{nbytes - 1}/{nbytes}"
                if r.getheader("Content-Range") != want:
                    raise WeightsError(f"{where}: asked for {want}, got {r.getheader('Content-Range')!r}")
            elif r.status != 200:
                raise WeightsError(f"{where}: {r.status} {r.read(ERROR_BODY_BYTES).decode(errors='replace')}")
            if r.length is not None and r.length != nbytes - part.have:
                raise WeightsError(f"tensor {self.name}: {where} announced {r.length} bytes, not the "
                                   f"{nbytes - part.have} missing")
            while part.have < nbytes:
                view = part.stage()
                n = 0
                try:
                    while n < len(view):  # fill the stage: one commit (hash + write) per STAGE_BYTES
                        k = r.readinto(view[n:])
                        if not k:
                            break
                        n += k
                except (OSError, http.client.HTTPException) as e:
                    part.commit(n)  # keep what came, for the next try to resume from
                    self.arrived(n)
                    got += n
                    if self._cancelled:
                        raise PeerGone(f"fetching {self.name}: cancelled") from None
                    raise PeerGone(f"fetching {self.name} from {where} failed after {part.have} of {nbytes} "
                                   f"bytes: {e or type(e).__name__}") from e
                part.commit(n)
                self.arrived(n)
                got += n
                if n < len(view):
                    if self._cancelled:
                        raise PeerGone(f"fetching {self.name}: cancelled")
                    raise PeerGone(f"fetching {self.name} from {where}: the connection closed after {part.have} "
                                   f"of {nbytes} bytes")
        finally:
            with self._lock:
                self._sock = None
            conn.close()
        return got
