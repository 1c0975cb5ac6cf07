"""The server end of the mutual authentication (handshake.py): the ``/auth`` endpoints and the middleware that
serves every other route of the agent server only to a sender holding a session it issued.

A refusal says nothing but ``REFUSAL`` (401): no epoch, no id, no reason. The reason goes to this agent's log,
once per remote address and reason (a stranger cannot flood the log). Pending challenges and sessions are bounded
(MAX_PENDING, MAX_SESSIONS; the oldest go first), so a stranger cannot exhaust memory either; pending challenges
are bounded per remote address too (PENDING_PER_ADDRESS: an address's own oldest goes first, and a full table
evicts from the address holding the most), so a flood from one address evicts only its own challenges.

An agent id is the one its certificate proves (identity.id_of): a confirm naming any other id is refused and logged,
so no holder of the key can authenticate as another agent, leader or member, however early it tries.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web
from pydantic import ValidationError

from ..errors import ProtocolError
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
from .identity import Identity, fingerprint_of_pem, id_of, verify_signature
from .keys import ClusterKey

log = logging.getLogger(__name__)

CHALLENGE_TTL_S = 10.0  # a challenge must be answered within this
SESSION_TTL_S = 3600.0  # then the client authenticates again (it does so on the 401)
MAX_PENDING = 256
PENDING_PER_ADDRESS = 16  # pending challenges one remote address may hold
MAX_SESSIONS = 4096
SESSIONS_PER_PEER = 2  # a peer's newest sessions kept (a renewal overlaps the session it replaces)
MAX_AUTH_BYTES = 16 * 1024
MAX_LOGGED = 1024
REFUSAL = "unauthenticated: this agent serves the members of its cluster only"


@dataclass(frozen=True)
class Peer:
    """The authenticated sender of a request: the agent id it proved, and its identity's fingerprint."""

    agent_id: str
    identity: str


PEER = web.RequestKey("flowspec_peer", Peer)


@dataclass(frozen=True)
class _Pending:
    cert_pem: bytes
    client_fp: str
    client_nonce: str
    expires: float
    address: str


@dataclass(frozen=True)
class _Session:
    peer: Peer
    expires: float


class Guard:
    """Authenticates peers for the agent ``agent_id`` holding ``key`` and presenting ``identity``. ``install(app)``
    adds the /auth routes; ``middleware`` goes first in the app's middlewares."""

    def __init__(self, key: ClusterKey, identity: Identity, agent_id: str, *,
                 clock: Callable[[], float] = time.monotonic, vouch: Callable[[web.Request], None] | None = None):
        """``vouch(request)``: told of every request that carries a valid session (gate.Gate.vouch)."""
        self.key = key
        self.vouch = vouch
        self.identity = identity
        self.agent_id = agent_id
        self.clock = clock
        self.refused = 0
        self._pending: OrderedDict[str, _Pending] = OrderedDict()
        self._pending_by: dict[str, list[str]] = {}  # remote address -> its pending nonces, oldest first
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self._by_peer: dict[Peer, list[str]] = {}  # a peer's tokens, oldest first
        self._logged: set[tuple[str, str]] = set()

    def install(self, app: web.Application) -> None:
        app.router.add_post(CHALLENGE_PATH, self._challenge)
        app.router.add_post(CONFIRM_PATH, self._confirm)

    def _log_once(self, request: web.Request, why: str) -> None:
        where = request.remote or "?"
        if (where, why) not in self._logged and len(self._logged) < MAX_LOGGED:
            self._logged.add((where, why))
            log.warning("refused %s %s from %s: %s", request.method, request.path, where, why)

    def _refuse(self, request: web.Request, why: str) -> web.HTTPUnauthorized:
        self.refused += 1
        self._log_once(request, why)
        return web.HTTPUnauthorized(text=REFUSAL)

    def _malformed(self, request: web.Request, why: str) -> web.HTTPBadRequest:
        self.refused += 1
        self._log_once(request, f"a malformed handshake message ({why})")
        return web.HTTPBadRequest(text="malformed handshake message")

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        if request.path in AUTH_PATHS:
            return await handler(request)
        token = request.headers.get(SESSION_HEADER, "")
        s = self._sessions.get(token) if token else None
        if s is None or s.expires < self.clock():
            raise self._refuse(request, "no session" if not token else "unknown or expired session")
        request[PEER] = s.peer
        if self.vouch is not None:
            self.vouch(request)
        return await handler(request)

    def peer_of(self, request: web.Request) -> Peer | None:
        return request.get(PEER)

    async def _body(self, request: web.Request, model):
        if (request.content_length or 0) > MAX_AUTH_BYTES:
            raise web.HTTPRequestEntityTooLarge(max_size=MAX_AUTH_BYTES, actual_size=request.content_length or 0)
        try:
            return model.model_validate_json(await request.content.read(MAX_AUTH_BYTES + 1))
        except ValidationError as e:
            raise self._malformed(request, f"not a {model.__name__}: {e.errors()[0]['msg']}") from None

    async def _challenge(self, request: web.Request) -> web.Response:
        hello = await self._body(request, AuthHello)
        try:
            client_fp = fingerprint_of_pem(hello.cert.encode())
        except ProtocolError as e:
            raise self._malformed(request, str(e)) from None
        now = self.clock()
        address = request.remote or "?"
        self._make_room(address, now)
        nonce = new_nonce()
        self._pending[nonce] = _Pending(hello.cert.encode(), client_fp, hello.nonce, now + CHALLENGE_TTL_S, address)
        self._pending_by.setdefault(address, []).append(nonce)
        mine = self.identity.fingerprint
        reply = AuthChallenge(cert=self.identity.cert_pem.decode(), nonce=nonce,
                              proof=server_proof(self.key, mine, client_fp, hello.nonce, nonce))
        return web.Response(text=reply.model_dump_json(), content_type="application/json")

    def _make_room(self, address: str, now: float) -> None:
        """Drop expired challenges, then one of ``address``'s own when it holds PENDING_PER_ADDRESS, else one of the
        address holding the most when the table is full."""
        while self._pending and next(iter(self._pending.values())).expires < now:
            self._take(next(iter(self._pending)))
        mine = self._pending_by.get(address, [])
        if len(mine) >= PENDING_PER_ADDRESS:
            self._take(mine[0])
        elif len(self._pending) >= MAX_PENDING:
            most = max(self._pending_by.values(), key=len)
            self._take(most[0])

    def _take(self, nonce: str) -> _Pending | None:
        p = self._pending.pop(nonce, None)
        if p is not None:
            nonces = self._pending_by.get(p.address, [])
            if nonce in nonces:
                nonces.remove(nonce)
            if not nonces:
                self._pending_by.pop(p.address, None)
        return p

    def _new_session(self, peer: Peer, now: float) -> str:
        while self._sessions and (len(self._sessions) >= MAX_SESSIONS
                                  or next(iter(self._sessions.values())).expires < now):
            self._forget(*self._sessions.popitem(last=False))
        tokens = self._by_peer.setdefault(peer, [])
        while len(tokens) >= SESSIONS_PER_PEER:
            self._sessions.pop(tokens.pop(0), None)
        token = secrets.token_hex(32)
        self._sessions[token] = _Session(peer, now + SESSION_TTL_S)
        tokens.append(token)
        return token

    def _forget(self, token: str, session: _Session) -> None:
        tokens = self._by_peer.get(session.peer, [])
        if token in tokens:
            tokens.remove(token)
        if not tokens:
            self._by_peer.pop(session.peer, None)

    async def _confirm(self, request: web.Request) -> web.Response:
        c = await self._body(request, AuthConfirm)
        p = self._take(c.nonce)
        if p is None:
            raise self._refuse(request, "a confirm for no pending challenge (a replay, or too late)")
        if p.expires < self.clock():
            raise self._refuse(request, "the challenge expired")
        mine = self.identity.fingerprint
        if not same(c.proof, client_proof(self.key, p.client_fp, mine, c.nonce, p.client_nonce, c.agent_id)):
            raise self._refuse(request, "a wrong proof: the peer does not hold this cluster's key")
        transcript = client_transcript(p.client_fp, mine, c.nonce, p.client_nonce, c.agent_id)
        try:
            signed = verify_signature(p.cert_pem, bytes.fromhex(c.signature), transcript)
        except (ValueError, ProtocolError):
            signed = False
        if not signed:
            raise self._refuse(request, "the signature does not match the peer's certificate")
        if c.agent_id != id_of(p.client_fp):
            log.warning("refused %s: it claims agent id %s, but its identity %s proves agent %s (a key holder "
                        "posing as another agent?)", request.remote, c.agent_id, p.client_fp[:12], id_of(p.client_fp))
            raise self._refuse(request, f"agent id {c.agent_id} is not the one its identity proves")
        now = self.clock()
        token = self._new_session(Peer(c.agent_id, p.client_fp), now)
        log.debug("authenticated agent %s (identity %s) from %s", c.agent_id, p.client_fp[:12], request.remote)
        reply = AuthSession(token=token, agent_id=self.agent_id, ttl_s=SESSION_TTL_S)
        return web.Response(text=reply.model_dump_json(), content_type="application/json")
