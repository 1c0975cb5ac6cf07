"""How an agent's network is secured: the one object the composition root (agent.py) asks.

    secure (a cluster key, keys.py)   the agent server speaks TLS with this agent's identity (identity.py) and
                                      serves every route but /auth only within a session (guard.py); every
                                      request the agent makes authenticates first and is pinned (pinning.py);
                                      adverts are sealed and leadership claims confirmed with the claimant itself
                                      (discovery.py); a control message must name the sender that authenticated,
                                      and a ring link's sender is the authenticated one
    open (--insecure)                 plain http and no checks: the lab mode, with a warning at every start

The pins learn where each agent is from authenticated statements only: a member's Hello (at the leader), the
leader's plan (at a member, once it accepted it), and leadership claims the claimant confirmed.

Ids are self-certifying (identity.py): a keyed agent's id is derived from its certificate, so an authenticated
sender's id *is* its identity, and no holder of the key can speak, plan or link in another agent's name.
"""

from __future__ import annotations

import logging
import ssl

import aiohttp
from aiohttp import web

from ..config import AgentConfig
from ..env import LEADER_IDENTITY
from ..errors import ProtocolError
from . import keys
from .control import ControlMessage, Hello, PeerInfo, PlanUpdate, claimed_sender
from .gate import Gate
from .guard import Guard, Peer
from .handshake import AdvertSeal
from .identity import Identity, agent_id
from .net import ControlClient
from .pinning import AuthClient

log = logging.getLogger(__name__)

INSECURE_WARNING = ("--insecure: this agent runs an OPEN cluster. Anyone on the network can join it, read its "
                    "weights and hidden states, feed it frames and forge its control messages. Use it in a lab only.")


class Security:
    def __init__(self, agent_id: str, key: keys.ClusterKey | None = None, identity: Identity | None = None):
        assert (key is None) == (identity is None)
        self.agent_id = agent_id
        self.key = key
        self.identity = identity
        self.gate = Gate("agent server")  # connection limits of the agent server (gate.py)
        self.guard = Guard(key, identity, agent_id, vouch=self.gate.vouch) if key is not None else None
        self.auth = AuthClient(key, identity, agent_id) if key is not None else None
        self.seal = AdvertSeal(key) if key is not None else None

    @classmethod
    def load(cls, cfg: AgentConfig) -> Security:
        """The agent's key (made on a leader's first start), identity (made on any agent's first start) and id
        (derived from the identity; in the open mode the one kept in the state folder)."""
        if cfg.insecure:
            log.warning(INSECURE_WARNING)
            return cls(agent_id(cfg.state_path))
        identity = Identity.load_or_create(cfg.state_path)
        key = keys.resolve(cfg, identity.fingerprint if cfg.leader else "")
        assert key is not None
        log.info("cluster key %s; this agent's identity %s (TLS on every agent link)", key.key_id,
                 identity.fingerprint[:12])
        if cfg.leader:
            log.info("members that should join only this leader: %s=%s", LEADER_IDENTITY, identity.fingerprint)
        return cls(agent_id(cfg.state_path, identity), key, identity)

    @property
    def secure(self) -> bool:
        return self.key is not None

    @property
    def fingerprint(self) -> str:
        """This agent's identity as peers pin it ("" in the open mode)."""
        return self.identity.fingerprint if self.identity is not None else ""

    def server_ssl(self) -> ssl.SSLContext | None:
        return self.identity.server_context() if self.identity is not None else None

    def middlewares(self) -> list:
        return [self.guard.middleware] if self.guard is not None else [self.gate.vouch_all]

    def install(self, app: web.Application) -> None:
        if self.guard is not None:
            self.guard.install(app)

    def client_session(self) -> aiohttp.ClientSession:
        return self.auth.open() if self.auth is not None else aiohttp.ClientSession()

    def control_client(self, session: aiohttp.ClientSession) -> ControlClient:
        return ControlClient(session, identity_at=self.auth.identity_at if self.auth is not None else None)

    def sender(self, request: web.Request) -> Peer | None:
        """Who sent ``request`` (None in the open mode: nobody knows)."""
        return self.guard.peer_of(request) if self.guard is not None else None

    def sender_id(self, request: web.Request) -> str | None:
        peer = self.sender(request)
        return peer.agent_id if peer is not None else None

    def check_control(self, request: web.Request, msg: ControlMessage) -> None:
        """Raise ProtocolError when ``msg`` names a sender other than the one that authenticated."""
        peer = self.sender(request)
        if peer is None:
            return
        aid, identity = claimed_sender(msg)
        if aid is not None and aid != peer.agent_id:
            raise ProtocolError(f"a {msg.kind} message naming agent {aid} came from agent {peer.agent_id}")
        if identity is not None and identity != peer.identity:
            raise ProtocolError(f"a {msg.kind} message names identity {identity[:12]}, not the sender's "
                                f"{peer.identity[:12]}")

    def learn(self, msg: ControlMessage) -> None:
        """Pin the addresses an accepted (checked) control message names."""
        if self.auth is None:
            return
        pins = self.auth.pins
        if isinstance(msg, Hello):
            pins.expect(msg.peer.host, msg.peer.port, msg.peer.identity)
        elif isinstance(msg, PlanUpdate):
            pins.expect(msg.leader.host, msg.leader.port, msg.leader.identity)
            for node in msg.ring:
                pins.expect(node.host, node.port, node.identity)

    async def confirm(self, claim: PeerInfo, client: ControlClient) -> PeerInfo | None:
        """Ask the agent a (sealed) advert describes whether it says the same, over a session pinned to the
        advertised identity. -> the claim when it does (its address stays pinned), else None."""
        if self.auth is None:
            return claim
        before = self.auth.pins.expect(claim.host, claim.port, claim.identity)
        info = await client.fetch_info(claim.host, claim.port)
        same = info is not None and (info.id, info.role, info.cluster, info.started, info.identity) == (
            claim.id, claim.role, claim.cluster, claim.started, claim.identity)
        if not same:
            self.auth.pins.restore(claim.host, claim.port, before)
            return None
        return claim
