"""Who an agent is: its id, and its identity -- an ECDSA P-256 key pair and a self-signed certificate.

Both are made on the agent's first start and kept in its state folder::

    <state dir>/agent_id       the agent's id: with an identity (every keyed agent), the first ID_HEX hex digits of
                               its fingerprint (``id_of``); in the open mode of --insecure, 12 random hex digits
    <state dir>/identity.key   the private key (PEM, owner-only permissions)
    <state dir>/identity.crt   the self-signed certificate (PEM)
    <state dir>/lock           held while an agent runs: one agent per state folder

An identity is named by its *fingerprint*: the SHA-256 of the certificate's DER bytes, 64 hex digits. The agent
server presents the certificate in TLS; peers pin the fingerprint an agent proved in the handshake (handshake.py).
The certificate names no host and no agent (its subject is a constant): a stranger that connects learns nothing
but a public key.

An agent's id is *self-certifying*: it is derived from the identity's fingerprint, so only the holder of that
identity's private key can prove it (guard.py refuses a handshake whose agent id is not its certificate's). A holder
of the cluster key can make identities at will, but never one whose id is another agent's: that would take a
second preimage of ID_HEX * 4 = 96 bits of SHA-256.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import os
import ssl
import uuid
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from ..errors import ConfigError, ProtocolError

KEY_FILE = "identity.key"
CERT_FILE = "identity.crt"
ID_FILE = "agent_id"
CERT_SUBJECT = "flowspec_p2p agent"
CERT_DAYS = 3650
MAX_CERT_BYTES = 8192
ID_HEX = 24  # hex digits of the fingerprint that make an agent's id (96 bits)


@dataclass(frozen=True, repr=False)
class Identity:
    """An agent's key pair and certificate; ``cert_path``/``key_path`` are set when they live in files (the TLS
    server context loads them from there)."""

    key: ec.EllipticCurvePrivateKey
    cert_pem: bytes
    cert_path: Path | None = None
    key_path: Path | None = None

    @cached_property
    def fingerprint(self) -> str:
        return fingerprint_of_pem(self.cert_pem)

    @property
    def agent_id(self) -> str:
        """The id this identity proves (``id_of`` its fingerprint)."""
        return id_of(self.fingerprint)

    @classmethod
    def generate(cls) -> Identity:
        """A fresh identity in memory (clients that serve nothing, e.g. a local cluster's controller; tests)."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, CERT_SUBJECT)])
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(days=1))
                .not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
                .sign(key, hashes.SHA256()))
        return cls(key, cert.public_bytes(serialization.Encoding.PEM))

    @classmethod
    def load_or_create(cls, folder: Path) -> Identity:
        """The identity kept in ``folder``, made there on first use."""
        key_path, cert_path = folder / KEY_FILE, folder / CERT_FILE
        if key_path.exists() and cert_path.exists():
            try:
                key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
                cert_pem = cert_path.read_bytes()
                load_cert(cert_pem)
            except (OSError, ValueError, ProtocolError) as e:
                raise ConfigError(f"cannot read this agent's identity in {folder}: {e}; remove {KEY_FILE} and "
                                  f"{CERT_FILE} to make a new one") from None
            if not isinstance(key, ec.EllipticCurvePrivateKey):
                raise ConfigError(f"{key_path} is not an EC private key")
            return cls(key, cert_pem, cert_path, key_path)
        made = cls.generate()
        folder.mkdir(parents=True, exist_ok=True)
        pem = made.key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                     serialization.NoEncryption())
        fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
        cert_path.write_bytes(made.cert_pem)
        return cls(made.key, made.cert_pem, cert_path, key_path)

    def sign(self, data: bytes) -> bytes:
        return self.key.sign(data, ec.ECDSA(hashes.SHA256()))

    def server_context(self) -> ssl.SSLContext:
        """TLS 1.3 server context presenting this identity (clients are authenticated by the handshake, not TLS)."""
        assert self.cert_path is not None, "a serving identity lives in files"
        assert self.key_path is not None, "a serving identity lives in files"
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.load_cert_chain(self.cert_path, self.key_path)
        return ctx


def client_context() -> ssl.SSLContext:
    """TLS 1.3 client context that accepts any certificate: the pinning connector (pinning.py) checks the
    fingerprint of every connection before a request goes out on it."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def load_cert(pem: bytes) -> x509.Certificate:
    if len(pem) > MAX_CERT_BYTES:
        raise ProtocolError(f"certificate of {len(pem)} bytes exceeds {MAX_CERT_BYTES}")
    try:
        cert = x509.load_pem_x509_certificate(pem)
        key = cert.public_key()
    except (ValueError, UnsupportedAlgorithm) as e:
        raise ProtocolError(f"not a PEM certificate with a key this agent reads: {e}") from None
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise ProtocolError("the certificate's key is not an EC key")
    return cert


def fingerprint_of_der(der: bytes) -> str:
    return hashlib.sha256(der).hexdigest()


def fingerprint_of_pem(pem: bytes) -> str:
    return fingerprint_of_der(load_cert(pem).public_bytes(serialization.Encoding.DER))


def verify_signature(cert_pem: bytes, signature: bytes, data: bytes) -> bool:
    """Is ``signature`` the certificate's key's ECDSA-SHA256 signature of ``data``?"""
    key = load_cert(cert_pem).public_key()
    assert isinstance(key, ec.EllipticCurvePublicKey)
    try:
        key.verify(signature, data, ec.ECDSA(hashes.SHA256()))
    except InvalidSignature:
        return False
    return True


def id_of(fingerprint: str) -> str:
    """The agent id an identity with this fingerprint proves."""
    return fingerprint[:ID_HEX]


def agent_id(state: Path, identity: Identity | None = None) -> str:
    """The agent's id: ``identity``'s (written to ``state`` for tools that read it), else (open mode) the one kept in
    ``state``, made there on first use."""
    path = state / ID_FILE
    if identity is not None:
        aid = identity.agent_id
        with contextlib.suppress(OSError):
            if path.read_text().strip() == aid:
                return aid
        path.write_text(aid + "\n")
        return aid
    try:
        aid = path.read_text().strip()
        if aid:
            return aid
    except OSError:
        pass
    aid = uuid.uuid4().hex[:12]
    path.write_text(aid + "\n")
    return aid


@contextlib.contextmanager
def state_lock(state: Path):
    """One agent per state folder (its id must be unique)."""
    fh = open(state / "lock", "a+")  # noqa: SIM115 - held for the agent's lifetime
    try:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"another agent is running with state folder {state}; give each agent its own "
                              "--state-dir") from None
        yield
    finally:
        fh.close()
