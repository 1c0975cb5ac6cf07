"""The cluster key: one random 32-byte secret that every agent of a cluster holds and none ever sends.

Every proof in the cluster is keyed by it: the mutual authentication of two agents (handshake.py) and the seal on
mDNS adverts. Its text form is ``fsk1-`` and 43 base64url characters (``ClusterKey.text``).

Where an agent gets it (``resolve``), first match wins:

    --cluster-key-file PATH          a file holding the text form (``flowspec keygen --out PATH`` writes one)
    $FLOWSPEC_CLUSTER_KEY            the text form itself
    --secret / $FLOWSPEC_SECRET      a passphrase (the older way): the key is scrypt of it, salted with the cluster's
                                     name (a guessable passphrase stays guessable: every sealed advert lets anyone
                                     who hears it try guesses offline; `flowspec keygen` makes a key that is not)
    <state dir>/cluster.key          kept from an earlier start
    (the leader only) a new key      made on its first start, written to <state dir>/cluster.key with owner-only
                                     permissions; the leader prints the one line a member needs to its terminal
                                     only (never to a log that journald or docker keep: there, the file's path)

``--insecure`` runs without a key (today's open mode, for a lab); the agent warns at every start.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import logging
import os
import secrets
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from ..config import AgentConfig
from ..env import CLUSTER_KEY, KEY_FILE, LEADER_IDENTITY
from ..errors import ConfigError

log = logging.getLogger(__name__)

KEY_PREFIX = "fsk1-"
KEY_BYTES = 32
SECRET_SALT = b"flowspec_p2p cluster key from a passphrase v2\0"  # + the cluster's name
SCRYPT_N, SCRYPT_R, SCRYPT_P = 2**15, 8, 1  # 32 MiB and ~0.1 s per guess (RFC 7914's interactive setting, doubled)
SECRET_WARNING = ("--secret derives the cluster key from a passphrase: anyone who hears a sealed advert of this "
                  "cluster can try guesses offline. `flowspec keygen` makes a key that cannot be guessed.")


@dataclass(frozen=True, repr=False)
class ClusterKey:
    raw: bytes

    def __post_init__(self):
        assert len(self.raw) == KEY_BYTES, "a cluster key is 32 bytes"

    @classmethod
    def generate(cls) -> ClusterKey:
        return cls(secrets.token_bytes(KEY_BYTES))

    @classmethod
    def from_secret(cls, secret: str, cluster: str) -> ClusterKey:
        """The key of a passphrase (``--secret``) for cluster ``cluster``: scrypt (memory-hard), salted with the
        cluster's name, so one table of guesses serves no two clusters."""
        salt = SECRET_SALT + cluster.encode()
        return cls(hashlib.scrypt(secret.encode(), salt=salt, n=SCRYPT_N, r=SCRYPT_R, p=SCRYPT_P, dklen=KEY_BYTES,
                                  maxmem=128 * SCRYPT_R * SCRYPT_N * 2))

    @classmethod
    def parse(cls, text: str, where: str = "the cluster key") -> ClusterKey:
        text = text.strip()
        if not text.startswith(KEY_PREFIX):
            raise ConfigError(f"{where} is not a cluster key: it must start with {KEY_PREFIX!r} (make one with "
                              "`flowspec keygen`)")
        body = text[len(KEY_PREFIX):]
        try:
            raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
        except (binascii.Error, ValueError):
            raise ConfigError(f"{where} is not a cluster key: not base64url after {KEY_PREFIX!r}") from None
        if len(raw) != KEY_BYTES:
            raise ConfigError(f"{where} is not a cluster key: {len(raw)} bytes, not {KEY_BYTES}")
        return cls(raw)

    @property
    def text(self) -> str:
        return KEY_PREFIX + base64.urlsafe_b64encode(self.raw).rstrip(b"=").decode()

    @property
    def key_id(self) -> str:
        """A short public name of the key for logs (an HMAC of a constant: reveals nothing of the key)."""
        return hmac.new(self.raw, b"flowspec key id", hashlib.sha256).hexdigest()[:8]

    def __repr__(self) -> str:
        return f"ClusterKey({self.key_id})"


def write_key(path: Path, key: ClusterKey, *, overwrite: bool = False) -> None:
    """Write the key's text form to ``path``, readable by its owner only (0600 from the moment it exists)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if overwrite else os.O_EXCL)
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        raise ConfigError(f"{path} exists; pass --force to replace it") from None
    with os.fdopen(fd, "w") as f:
        f.write(key.text + "\n")
    os.chmod(path, 0o600)


def read_key(path: Path) -> ClusterKey:
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read the cluster key file {path}: {e.strerror or e}") from None
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("the cluster key file %s is readable by other users (mode %o); `chmod 600 %s`", path,
                    stat.S_IMODE(mode), path)
    return ClusterKey.parse(text, str(path))


def member_line(key: ClusterKey, leader_identity: str = "") -> str:
    """What a member needs: the environment line that gives it the key (and, from a leader, the identity of the
    leader it may join: cluster/member.py)."""
    pin = f" {LEADER_IDENTITY}={leader_identity}" if leader_identity else ""
    return f"export {CLUSTER_KEY}={key.text}{pin}"


def resolve(cfg: AgentConfig, leader_identity: str = "", terminal: TextIO | None = None) -> ClusterKey | None:
    """The agent's cluster key (see the module docstring), or None with ``--insecure``. Raises ConfigError when a
    member has none. ``leader_identity``: a leader's fingerprint, printed in the line its members need; a new key is
    written to ``terminal`` (default: stderr when it is a terminal), never to the log."""
    if cfg.insecure:
        return None
    if cfg.cluster_key_file is not None:
        return read_key(cfg.cluster_key_file.expanduser())
    if cfg.cluster_key is not None:
        return ClusterKey.parse(cfg.cluster_key.get_secret_value(), f"${CLUSTER_KEY}")
    if cfg.secret is not None:
        log.warning(SECRET_WARNING)
        return ClusterKey.from_secret(cfg.secret.get_secret_value(), cfg.cluster)
    stored = cfg.state_path / KEY_FILE
    if stored.exists():
        key = read_key(stored)
        log.info("cluster key %s from %s", key.key_id, stored)
        return key
    if not cfg.leader:
        raise ConfigError(
            f"this agent has no cluster key: give it the line its leader printed on its first start "
            f"(export {CLUSTER_KEY}={KEY_PREFIX}...), or --cluster-key-file PATH "
            f"(the leader keeps it in its state folder, {KEY_FILE}); --insecure joins an open cluster instead")
    key = ClusterKey.generate()
    write_key(stored, key)
    pin = f" {LEADER_IDENTITY}={leader_identity}" if leader_identity else ""
    if terminal is not None or sys.stderr.isatty():
        (terminal or sys.stderr).write(f"\nOn every other device of cluster {cfg.cluster!r}, before `flowspec agent "
                                       f"--cluster {cfg.cluster}`:\n\n    {member_line(key, leader_identity)}\n\n")
    log.warning("made cluster key %s in %s (owner-only). Every other device of cluster %r needs its text: "
                "export %s=\"$(cat %s)\"%s", key.key_id, stored, cfg.cluster, CLUSTER_KEY, stored, pin)
    return key
