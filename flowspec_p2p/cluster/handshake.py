"""The proofs keyed by the cluster key: the mutual authentication of two agents, and the seal on mDNS adverts.

Mutual authentication (client C dials server S; ``fp`` = an identity's certificate fingerprint, identity.py;
``K`` = the cluster key; every message travels inside TLS to S's certificate)::

    C -> S  POST /auth/challenge  AuthHello      C's certificate, a fresh nonce nC
    S -> C                        AuthChallenge  S's certificate, a fresh nonce nS,
                                                 proof = HMAC(K, "server" | fpS | fpC | nC | nS)
            C checks the proof (S holds K and the certificate it presents), and from now on sends only over
            connections whose TLS certificate has fingerprint fpS (pinning.py)
    C -> S  POST /auth/confirm    AuthConfirm    nS, C's agent id,
                                                 proof = HMAC(K, "client" | fpC | fpS | nS | nC | id),
                                                 C's ECDSA signature of the same transcript (C holds its key)
    S -> C                        AuthSession    a random session token, S's agent id, its lifetime

S accepts each nS once, within CHALLENGE_TTL_S: a recorded confirm is refused when replayed, and a recorded
challenge answers no fresh nC. C then sends the token with every request (``SESSION_HEADER``), over connections
pinned to fpS; S serves a request only with a token it issued, and knows the request's sender as the identity
that token was issued to (guard.py). The key itself never leaves either agent. Fields are length-prefixed and
labelled, so no proof of one kind is ever valid as another.

Advert seal: an mDNS advert (discovery.py) carries ``ts`` (unix seconds) and ``p`` = HMAC(K, "advert" | every
other TXT field | port); agents ignore adverts without a valid seal or older (or newer) than ADVERT_MAX_AGE_S.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import secrets
from collections.abc import Mapping
from typing import Annotated

from pydantic import Field

from ..errors import ProtocolError
from ..types import FrozenModel
from .identity import MAX_CERT_BYTES
from .keys import ClusterKey

AUTH_VERSION = 1
CHALLENGE_PATH = "/auth/challenge"
CONFIRM_PATH = "/auth/confirm"
AUTH_PATHS = frozenset({CHALLENGE_PATH, CONFIRM_PATH})  # the only routes served without a session
SESSION_HEADER = "X-Flowspec-Session"
NONCE_BYTES = 32
ADVERT_MAX_AGE_S = 600.0  # an advert's timestamp may be this far off the receiver's clock, either way
SEAL_FIELDS = ("ts", "p")

Hex64 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class AuthHello(FrozenModel):
    v: int = AUTH_VERSION
    cert: str = Field(max_length=MAX_CERT_BYTES)
    nonce: Hex64


class AuthChallenge(FrozenModel):
    v: int = AUTH_VERSION
    cert: str = Field(max_length=MAX_CERT_BYTES)
    nonce: Hex64
    proof: Hex64


class AuthConfirm(FrozenModel):
    v: int = AUTH_VERSION
    nonce: Hex64  # the server's nonce this answers
    agent_id: str = Field(min_length=1, max_length=64)
    proof: Hex64
    signature: str = Field(pattern=r"^[0-9a-f]{16,512}$")


class AuthSession(FrozenModel):
    v: int = AUTH_VERSION
    token: Hex64
    agent_id: str = Field(min_length=1, max_length=64)
    ttl_s: float = Field(gt=0, le=86400.0, allow_inf_nan=False)


def new_nonce() -> str:
    return secrets.token_hex(NONCE_BYTES)


def _fields(label: str, *fields: str) -> bytes:
    out = bytearray(b"flowspec_p2p " + label.encode() + b"\0")
    for f in fields:
        b = f.encode()
        out += len(b).to_bytes(4, "big") + b
    return bytes(out)


def _mac(key: ClusterKey, label: str, *fields: str) -> str:
    return hmac.new(key.raw, _fields(label, *fields), hashlib.sha256).hexdigest()


def server_proof(key: ClusterKey, server_fp: str, client_fp: str, client_nonce: str, server_nonce: str) -> str:
    return _mac(key, "auth server v1", server_fp, client_fp, client_nonce, server_nonce)


def client_proof(key: ClusterKey, client_fp: str, server_fp: str, server_nonce: str, client_nonce: str,
                 agent_id: str) -> str:
    return _mac(key, "auth client v1", client_fp, server_fp, server_nonce, client_nonce, agent_id)


def client_transcript(client_fp: str, server_fp: str, server_nonce: str, client_nonce: str, agent_id: str) -> bytes:
    """What the client signs with its identity's key."""
    return _fields("auth client signature v1", client_fp, server_fp, server_nonce, client_nonce, agent_id)


def same(a: str, b: str) -> bool:
    """Constant-time comparison of two proofs."""
    return hmac.compare_digest(a.encode(), b.encode())


class AdvertSeal:
    """Seals and checks mDNS adverts with the cluster key (see the module docstring)."""

    def __init__(self, key: ClusterKey, max_age_s: float = ADVERT_MAX_AGE_S):
        self.key = key
        self.max_age_s = max_age_s

    def _proof(self, props: Mapping[str, str], port: int) -> str:
        items = sorted((k, v) for k, v in props.items() if k != "p")
        return _mac(self.key, "advert v1", str(port), *(x for kv in items for x in kv))

    def seal(self, props: Mapping[str, str], port: int, now: float) -> dict[str, str]:
        out = {k: v for k, v in props.items() if k not in SEAL_FIELDS}
        out["ts"] = str(int(now))
        out["p"] = self._proof(out, port)
        return out

    def check(self, props: Mapping[str, str], port: int, now: float) -> None:
        """Raise ProtocolError (the reason) unless ``props`` carry a valid, fresh seal for ``port``."""
        proof = props.get("p") or ""
        if not proof:
            raise ProtocolError("no proof of the cluster key")
        if not same(proof, self._proof(props, port)):
            raise ProtocolError("its proof does not match this agent's cluster key")
        try:
            age = now - float(props.get("ts") or "")
        except ValueError:
            raise ProtocolError("malformed timestamp") from None
        if not math.isfinite(age):  # "nan" and "inf" parse as floats, and NaN passes every comparison
            raise ProtocolError("malformed timestamp (not a finite number)")
        if abs(age) > self.max_age_s:
            raise ProtocolError(f"sealed {age:.0f} s ago (limit {self.max_age_s:.0f} s): is either clock wrong?")
