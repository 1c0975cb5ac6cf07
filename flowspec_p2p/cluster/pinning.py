"""The client end of the mutual authentication (handshake.py): certificate pins, the connector that enforces them,
and the client middleware that authenticates before the first request to an agent and sends the session token with
every one after.

    Pins             the identity each agent address must present. ``expect`` records what an authenticated source
                     said (a sealed advert, a member's Hello, the leader's plan): the address is then refused with
                     any other certificate. Without one, a handshake learns the identity (it proves the key) and
                     the address is pinned to it for as long as that session lasts.
    PinningConnector checks every TLS connection (new or pooled) against the pin of its address before a request
                     goes out on it; a mismatch closes it and raises ProtocolError.
    AuthClient       the session middleware: a handshake per address (one at a time), the token on every request,
                     and one fresh handshake when a server answers 401 (it restarted, or the session expired);
                     nothing goes out over plain http.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
from pydantic import ValidationError

from ..errors import PeerGone, ProtocolError
from .handshake import (
    AUTH_PATHS,
    CHALLENGE_PATH,
    CONFIRM_PATH,
    SESSION_HEADER,
    AuthChallenge,
    AuthConfirm,
    AuthHello,
    AuthSession,
    client_proof,
    client_transcript,
    new_nonce,
    same,
    server_proof,
)
from .identity import Identity, client_context, fingerprint_of_der, fingerprint_of_pem
from .keys import ClusterKey

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 5.0
RENEW_BEFORE_S = 60.0  # a session this close to its end is renewed before the next request

Address = tuple[str, int]


@dataclass(frozen=True)
class Pin:
    identity: str
    asserted: bool  # said by an authenticated source (else: learned by this address's current session)


class Pins:
    def __init__(self):
        self._pins: dict[Address, Pin] = {}

    def get(self, address: Address) -> Pin | None:
        return self._pins.get(address)

    def expect(self, host: str, port: int, identity: str) -> Pin | None:
        """Agent address ``host:port`` must present ``identity`` from now on. -> the pin it replaces"""
        key = _normal(host, port)
        old = self._pins.get(key)
        if identity:
            self._pins[key] = Pin(identity, True)
        return old

    def restore(self, host: str, port: int, pin: Pin | None) -> None:
        key = _normal(host, port)
        if pin is None:
            self._pins.pop(key, None)
        else:
            self._pins[key] = pin

    def learn(self, address: Address, identity: str) -> None:
        if address not in self._pins:
            self._pins[address] = Pin(identity, False)

    def forget_learned(self, address: Address) -> None:
        pin = self._pins.get(address)
        if pin is not None and not pin.asserted:
            del self._pins[address]


def _normal(host: str, port: int) -> Address:
    host = host.strip("[]").rstrip(".").lower()
    with contextlib.suppress(ValueError):
        host = str(ipaddress.ip_address(host))
    return (host, port)


def _address(url) -> Address:
    """A URL's (host, port) as pins key it: host names in lower case, IP addresses canonical (control.check_host)."""
    return _normal(url.raw_host or "", url.port or 443)


class PinningConnector(aiohttp.TCPConnector):
    """A TCPConnector whose TLS connections must present the pinned certificate of their address."""

    def __init__(self, pins: Pins, **kw):
        super().__init__(ssl=client_context(), **kw)
        self.pins = pins

    async def connect(self, req: aiohttp.ClientRequest, traces, timeout) -> aiohttp.connector.Connection:  # noqa: ASYNC109 - aiohttp's signature
        conn = await super().connect(req, traces, timeout)
        if req.is_ssl():
            pin = self.pins.get(_address(req.url))
            if pin is not None:
                transport = conn.transport
                ssl_object = transport.get_extra_info("ssl_object") if transport is not None else None
                der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
                got = fingerprint_of_der(der) if der else ""
                if got != pin.identity:
                    conn.close()
                    raise ProtocolError(f"{req.url.host}:{req.url.port} presents certificate {got[:12] or 'none'}, "
                                        f"not the identity {pin.identity[:12]} this agent expects there")
        return conn


def pinned_identity(session: aiohttp.ClientSession, url) -> str | None:
    """The identity ``session`` requires of the agent serving ``url`` (a yarl URL): the pin its connector checks
    there, or None (an open session, or an address it has not authenticated with). For a connection made outside
    the session (weight_stream.py), which must check the same certificate before it sends the session's token."""
    connector = session.connector
    if not isinstance(connector, PinningConnector):
        return None
    pin = connector.pins.get(_address(url))
    return pin.identity if pin is not None else None


@dataclass(frozen=True)
class Session:
    token: str
    agent_id: str  # the server's
    identity: str  # the server's
    renew_at: float


class AuthClient:
    """Authenticates agent ``agent_id`` (``identity``, holding ``key``) to the agents it talks to. ``open()`` makes
    the ClientSession every request of the agent goes through. The id is the identity's own (identity.id_of) unless
    given: servers refuse any other, so only a test passes one."""

    def __init__(self, key: ClusterKey, identity: Identity, agent_id: str | None = None, pins: Pins | None = None, *,
                 clock: Callable[[], float] = time.monotonic):
        self.key = key
        self.identity = identity
        self.agent_id = agent_id or identity.agent_id
        self.pins = pins or Pins()
        self.clock = clock
        self.sessions: dict[Address, Session] = {}
        self._locks: dict[Address, asyncio.Lock] = {}
        self._http: aiohttp.ClientSession | None = None

    def open(self, **kw) -> aiohttp.ClientSession:
        assert self._http is None, "one ClientSession per AuthClient"
        self._http = aiohttp.ClientSession(connector=PinningConnector(self.pins), middlewares=(self.middleware,),
                                           **kw)
        return self._http

    def identity_at(self, host: str, port: int) -> str | None:
        """The identity the agent at ``host:port`` proved in this client's session with it."""
        s = self.sessions.get(_normal(host, port))
        return s.identity if s is not None else None

    async def middleware(self, req: aiohttp.ClientRequest, handler) -> aiohttp.ClientResponse:
        if not req.is_ssl():  # a keyed agent sends nothing in the clear, to anyone
            raise ProtocolError(f"refusing to send {req.method} {req.url} over plain http: this agent's cluster is "
                                "keyed (every agent speaks TLS)")
        if req.url.path in AUTH_PATHS:
            return await handler(req)
        address = _address(req.url)
        for attempt in (1, 2):
            s = await self.session(req.url)
            req.headers[SESSION_HEADER] = s.token
            try:
                resp = await handler(req)
            except ProtocolError:  # another certificate: where it was only learned, the agent there restarted
                pin = self.pins.get(address)
                if attempt == 2 or pin is None or pin.asserted:
                    raise
                self._drop(address, s)
                continue
            if resp.status != 401 or attempt == 2:
                return resp
            resp.release()
            self._drop(address, s)  # the server restarted or forgot us: authenticate once more
        raise AssertionError("unreachable")

    def _drop(self, address: Address, s: Session) -> None:
        if self.sessions.get(address) is s:
            del self.sessions[address]
            self.pins.forget_learned(address)

    async def session(self, url) -> Session:
        """This client's session with the agent serving ``url`` (a handshake first if there is none)."""
        address = _address(url)
        lock = self._locks.setdefault(address, asyncio.Lock())
        async with lock:
            s = self.sessions.get(address)
            pin = self.pins.get(address)
            if s is not None and s.renew_at > self.clock() and pin is not None and pin.identity == s.identity:
                return s
            if s is not None:
                self._drop(address, s)
            s = await self._handshake(url.origin(), address)
            self.sessions[address] = s
            return s

    async def _handshake(self, origin, address: Address) -> Session:
        assert self._http is not None
        http = self._http
        timeout = aiohttp.ClientTimeout(total=HANDSHAKE_TIMEOUT_S)
        nonce = new_nonce()
        mine = self.identity.fingerprint
        self.pins.forget_learned(address)  # a new handshake learns the identity afresh
        try:
            hello = AuthHello(cert=self.identity.cert_pem.decode(), nonce=nonce)
            async with http.post(origin.with_path(CHALLENGE_PATH), data=hello.model_dump_json(),
                                 headers={"Content-Type": "application/json"}, timeout=timeout) as r:
                if r.status != 200:
                    raise ProtocolError(f"{origin} refused the handshake ({r.status})")
                ch = AuthChallenge.model_validate_json(await r.read())
            theirs = fingerprint_of_pem(ch.cert.encode())
            pin = self.pins.get(address)
            if pin is not None and pin.identity != theirs:
                raise ProtocolError(f"{origin} proves identity {theirs[:12]}, not the {pin.identity[:12]} this "
                                    "agent expects there")
            if not same(ch.proof, server_proof(self.key, theirs, mine, nonce, ch.nonce)):
                raise ProtocolError(f"{origin} does not hold this cluster's key")
            self.pins.learn(address, theirs)  # the confirm goes only to the holder of that certificate
            signature = self.identity.sign(client_transcript(mine, theirs, ch.nonce, nonce, self.agent_id))
            confirm = AuthConfirm(nonce=ch.nonce, agent_id=self.agent_id,
                                  proof=client_proof(self.key, mine, theirs, ch.nonce, nonce, self.agent_id),
                                  signature=signature.hex())
            async with http.post(origin.with_path(CONFIRM_PATH), data=confirm.model_dump_json(),
                                 headers={"Content-Type": "application/json"}, timeout=timeout) as r:
                if r.status != 200:
                    raise ProtocolError(f"{origin} refused this agent's proof ({r.status}): does it hold another "
                                        "cluster key?")
                got = AuthSession.model_validate_json(await r.read())
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            self.pins.forget_learned(address)
            raise PeerGone(f"cannot authenticate with {origin}: {e or type(e).__name__}") from e
        except ValidationError:
            self.pins.forget_learned(address)
            raise ProtocolError(f"{origin}: a malformed handshake reply") from None
        except ProtocolError:
            self.pins.forget_learned(address)
            raise
        log.debug("authenticated with agent %s at %s (identity %s)", got.agent_id, origin, theirs[:12])
        return Session(got.token, got.agent_id, theirs, self.clock() + max(0.0, got.ttl_s - RENEW_BEFORE_S))
