"""Failover's preparation: the standby (chosen by ``choose_standby``) holds a replica of the leader's model files
and draft head ahead of need, so that it can lead when the leader is lost.

    leader    ReplicaServer: GET /replica/manifest (the files, their sizes and SHA-256), GET /replica/file?name=
              (one file), on the agent server (authenticated peers only, guard.py)
    standby   fetch_replica: every file into <state>/replica/<fingerprint>/, checked against its digest while it
              streams, skipped when already there (a restart fetches nothing); then the model's fingerprint must be
              the plan's

The replica is the model's own files (a GGUF file, or a folder's config, weights and tokenizer), so the standby's
copy is the leader's: the same tokenizer, the same fingerprint, and a weight server for any layer a re-plan moves.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from aiohttp import web
from pydantic import Field, ValidationError

from ..errors import PeerGone, ProtocolError, WeightsError
from ..types import FrozenModel
from .control import PeerInfo
from .plans import ModelSizes, Plan

log = logging.getLogger(__name__)

MANIFEST_PATH = "/replica/manifest"
FILE_PATH = "/replica/file"
REPLICA_DIR = "replica"
DRAFT_DIR = "draft"
CHUNK = 1 << 20
FETCH_TIMEOUT_S = 3600.0  # a whole file; the socket read must progress within READ_TIMEOUT_S
READ_TIMEOUT_S = 60.0
MAX_FILES = 64
NAME = re.compile(r"^(draft/)?[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def choose_standby(plan: Plan, members: Mapping[str, PeerInfo], model: ModelSizes, leader_id: str) -> str:
    """The member best able to hold the leader's parts (embedding, LM head, draft head) beside the stage the plan
    gives it: the most memory left, then the fastest; "" when no member has room."""
    need = model.head_bytes + model.draft_bytes + (0 if model.tied_embeddings else model.embed_bytes)
    used = {s.agent_id: s.memory_bytes for s in plan.stages}
    best, best_key = "", None
    for aid, info in members.items():
        if aid == leader_id:
            continue
        free = info.profile.memory_bytes - used.get(aid, 0)
        key = (free, info.profile.gflops, aid)
        if free >= need and (best_key is None or key > best_key):
            best, best_key = aid, key
    return best


class ReplicaFile(FrozenModel):
    name: str = Field(pattern=NAME.pattern)
    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class ReplicaManifest(FrozenModel):
    fingerprint: str = Field(max_length=128)
    model: str = Field(pattern=NAME.pattern)  # the file or folder name the model opens from
    folder: bool  # the model is a folder of files (else one file)
    files: tuple[ReplicaFile, ...] = Field(max_length=MAX_FILES)
    draft: str = Field(default="", max_length=128)  # the draft bundle's stem under draft/ ("" = none)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def model_files(model_path: Path, draft_stem: Path | None) -> dict[str, Path]:
    """The files of a replica: name -> path (a GGUF file; a folder's regular files; the draft bundle's two)."""
    out: dict[str, Path] = {}
    if model_path.is_dir():
        for p in sorted(model_path.iterdir()):
            if p.is_file() and NAME.match(p.name):
                out[p.name] = p
    else:
        out[model_path.name] = model_path
    if draft_stem is not None:
        for suffix in (".json", ".safetensors"):
            p = draft_stem.with_suffix(suffix)
            if p.is_file():
                out[f"{DRAFT_DIR}/{p.name}"] = p
    if len(out) > MAX_FILES:
        raise WeightsError(f"{model_path} has {len(out)} files; a replica takes at most {MAX_FILES}")
    return out


class ReplicaServer:
    """Serves the leader's model files and draft head to its standby."""

    def __init__(self, model_path: Path, fingerprint: str, draft_stem: Path | None = None):
        self.model_path = model_path
        self.fingerprint = fingerprint
        self.draft_stem = draft_stem
        self.files = model_files(model_path, draft_stem)
        self._digests: dict[str, tuple[tuple[int, float], str]] = {}
        self._manifest: ReplicaManifest | None = None
        self._lock = asyncio.Lock()

    def _digest(self, name: str) -> str:
        path = self.files[name]
        st = path.stat()
        key = (st.st_size, st.st_mtime)
        known = self._digests.get(name)
        if known is None or known[0] != key:
            known = self._digests[name] = (key, _sha256(path))
        return known[1]

    def manifest(self) -> ReplicaManifest:
        files = tuple(ReplicaFile(name=n, size=p.stat().st_size, sha256=self._digest(n)) for n, p in self.files.items())
        draft = self.draft_stem.name if self.draft_stem is not None and any(
            n.startswith(DRAFT_DIR + "/") for n in self.files) else ""
        return ReplicaManifest(fingerprint=self.fingerprint, model=self.model_path.name,
                               folder=self.model_path.is_dir(), files=files, draft=draft)

    async def prepare(self) -> ReplicaManifest:
        """The manifest, its digests computed once (off the event loop), not by every asker at once. The leader
        calls it as it starts to lead, so that its standby's first ask does not wait for the SHA-256 of a
        multi-GB file."""
        async with self._lock:
            if self._manifest is None:
                self._manifest = await asyncio.to_thread(self.manifest)
        return self._manifest

    async def handle_manifest(self, request: web.Request) -> web.Response:
        manifest = await self.prepare()
        return web.Response(text=manifest.model_dump_json(), content_type="application/json")

    async def handle_file(self, request: web.Request) -> web.StreamResponse:
        path = self.files.get(request.query.get("name", ""))
        if path is None:
            raise web.HTTPNotFound(text="no such replica file")
        return web.FileResponse(path)


@dataclass(frozen=True)
class Replica:
    """A standby's copy: where the model opens from, and its draft head's stem (None: none came)."""

    model: Path
    draft: Path | None


async def fetch_replica(session: aiohttp.ClientSession, leader_url: str, state: Path, fingerprint: str) -> Replica:
    """Fetch the leader's model files (those not already here) into ``state``/replica/. Raises PeerGone (the
    leader went away: the files fetched so far stay), ProtocolError (a malformed manifest) or WeightsError (a digest
    or the model's fingerprint does not match)."""
    try:
        async with session.get(leader_url + MANIFEST_PATH, timeout=aiohttp.ClientTimeout(total=FETCH_TIMEOUT_S)) as r:
            if r.status != 200:
                raise PeerGone(f"{leader_url} answered {r.status} for its replica manifest")
            manifest = ReplicaManifest.model_validate_json(await r.read())
    except ValidationError as e:
        raise ProtocolError(f"a malformed replica manifest: {str(e).splitlines()[0]}") from None
    except (aiohttp.ClientError, OSError, TimeoutError) as e:
        raise PeerGone(f"cannot fetch the replica manifest from {leader_url}: {e or type(e).__name__}") from e
    if manifest.fingerprint != fingerprint:
        raise WeightsError(f"the leader's replica is of model {manifest.fingerprint[:12]}, not {fingerprint[:12]}")
    root = state / REPLICA_DIR / fingerprint[:32]
    (root / DRAFT_DIR).mkdir(parents=True, exist_ok=True)
    done_path = root / "done.json"
    try:
        done = json.loads(done_path.read_text())
    except (OSError, ValueError):
        done = {}
    base = root / manifest.model if manifest.folder else root
    fetched = 0
    for f in manifest.files:
        dest = (root / f.name) if f.name.startswith(DRAFT_DIR + "/") else base / f.name
        if done.get(f.name) == f.sha256 and dest.is_file() and dest.stat().st_size == f.size:
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        await _download(session, leader_url, f, dest)
        fetched += f.size
        done[f.name] = f.sha256
        done_path.write_text(json.dumps(done))
    model = root / manifest.model
    draft = (root / DRAFT_DIR / manifest.draft) if manifest.draft else None
    log.info("replica of model %s ready in %s (%.1f MB fetched)", fingerprint[:12], root, fetched / 1e6)
    return Replica(model, draft)


async def _download(session: aiohttp.ClientSession, leader_url: str, f: ReplicaFile, dest: Path) -> None:
    part = dest.with_name(dest.name + ".part")
    h = hashlib.sha256()
    got = 0
    timeout = aiohttp.ClientTimeout(total=FETCH_TIMEOUT_S, sock_read=READ_TIMEOUT_S)
    try:
        async with session.get(leader_url + FILE_PATH, params={"name": f.name}, timeout=timeout) as r:
            if r.status != 200:
                raise PeerGone(f"{leader_url} answered {r.status} for replica file {f.name}")
            out = await asyncio.to_thread(open, part, "wb")
            try:
                async for chunk in r.content.iter_chunked(CHUNK):
                    got += len(chunk)
                    if got > f.size:
                        raise WeightsError(f"replica file {f.name} is longer than its manifest's {f.size} bytes")
                    h.update(chunk)
                    await asyncio.to_thread(out.write, chunk)
                await asyncio.to_thread(_sync, out)
            finally:
                out.close()
    except (aiohttp.ClientError, OSError, TimeoutError) as e:
        raise PeerGone(f"fetching replica file {f.name} from {leader_url} failed: {e or type(e).__name__}") from e
    if got != f.size or h.hexdigest() != f.sha256:
        part.unlink(missing_ok=True)
        raise WeightsError(f"replica file {f.name}: {got} bytes with digest {h.hexdigest()[:12]}, not the "
                           f"manifest's {f.size} bytes and {f.sha256[:12]}")
    os.replace(part, dest)


def _sync(f) -> None:
    f.flush()
    os.fsync(f.fileno())
