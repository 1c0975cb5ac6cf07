"""Weights reach devices without a hub: the leader serves exactly the tensors of a range; a member fetches them.

    GET /weights/manifest?start=A&end=B&embed=0|1&norm=0|1   -> Manifest: config, per tensor size + SHA-256
                                                                 + storage info, and the range fingerprint
    GET /weights/tensor/{name}                                -> the tensor's *stored* bytes (quantised GGUF
                                                                 blocks stay quantised: ~6x smaller than float32)

A stage needs its layers, the token embedding if it is stage 1, and the final norm if it is the last stage
(``stage_tensor_names``); the LM head stays on the leader (as in FlowSpec), so the last stage neither fetches nor
holds it. The fetching side (``fetch_range``) checks each tensor's bytes against its SHA-256, recomputes the range
fingerprint from those digests and compares it with the one the plan names (weights.range_fingerprint), and keeps
every verified tensor under ``<state dir>/tensors/<sha256>.bin`` (content-addressed: a re-plan that hands a member
a range it held before costs no transfer). The result is a ``FetchedSource``: a WeightSource over the cache,
from which the plan's engine builds the shard as from a local file.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import torch
from aiohttp import web
from pydantic import Field
from tqdm import tqdm

from ..errors import PeerGone, WeightsError
from ..model.arch import ModelConfig
from ..model.weights import (
    NORM,
    ROPE_FREQS,
    fingerprint,
    gguf_tensor_from_raw,
    safetensors_dtype,
    shard_tensor_names,
    tensor_digest,
)
from ..types import FrozenModel, LayerRange

log = logging.getLogger(__name__)

MANIFEST_PATH = "/weights/manifest"
TENSOR_PATH = "/weights/tensor/{name}"
CHUNK_BYTES = 1 << 20
FETCH_CONCURRENCY = 4
FETCH_TIMEOUT_S = 300.0


class TensorEntry(FrozenModel):
    name: str
    nbytes: int = Field(ge=0)
    sha256: str
    info: dict  # WeightSource.raw_info: how to turn the stored bytes into a tensor


class Manifest(FrozenModel):
    config: ModelConfig
    layers: LayerRange
    embed: bool
    norm: bool
    fingerprint: str  # weights.fingerprint over exactly stage_tensor_names(config, layers, embed, norm)
    tensors: tuple[TensorEntry, ...]  # those names, plus rope_freqs where the model has it

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def stage_tensor_names(cfg: ModelConfig, layers: LayerRange, *, embed: bool, norm: bool) -> list[str]:
    """The tensors a pipeline stage holds: its layers, the embedding (stage 1), the final norm (the last stage)."""
    return shard_tensor_names(cfg, layers, embed=embed, head=False) + ([NORM] if norm else [])


def covered_names(source, layers: LayerRange, *, embed: bool, norm: bool) -> list[str]:
    """Every tensor a stage of ``layers`` reads from ``source``: its tensors, and rope_freqs where the model has it.
    The range fingerprint covers exactly these, and a manifest holds exactly these."""
    names = stage_tensor_names(source.config, layers, embed=embed, norm=norm)
    return names + ([ROPE_FREQS] if ROPE_FREQS in source.names() else [])


def entry_digest(sha256: str, info: dict) -> str:
    """What the range fingerprint takes for one tensor: its stored bytes' SHA-256 and how to read them (format,
    dtype, shape), so a manifest that keeps the bytes but changes their reading (an f16/bf16 swap) is refused."""
    return hashlib.sha256(f"{sha256}\n{json.dumps(info, sort_keys=True)}".encode()).hexdigest()


def stage_fingerprint(source, layers: LayerRange, *, embed: bool, norm: bool) -> str:
    """weights.fingerprint of exactly a stage's tensors in ``source`` (hashes only those stored bytes, and their
    storage info)."""
    names = covered_names(source, layers, embed=embed, norm=norm)
    return fingerprint(source.config, {n: entry_digest(tensor_digest(source, n), source.raw_info(n)) for n in names})


# ------------------------------------------------------------------------------------------------- serving


class WeightServer:
    """Serves a WeightSource. Digests are computed once per tensor and kept. A tensor's file pages are dropped
    from this process's memory after hashing (tensor_digest) or sending it (``source.release``, where the source
    has one): the leader serves every member's layers, and a whole model's pages would otherwise stay resident."""

    def __init__(self, source):
        self.source = source
        self._digests: dict[str, str] = {}
        self.served_bytes = 0

    def digest(self, name: str) -> str:
        d = self._digests.get(name)
        if d is None:
            d = self._digests[name] = tensor_digest(self.source, name)
        return d

    def _drop(self, name: str) -> None:
        release = getattr(self.source, "release", None)
        if release is not None:
            release(name)

    def range_fingerprint(self, layers: LayerRange, *, embed: bool, norm: bool) -> str:
        names = covered_names(self.source, layers, embed=embed, norm=norm)
        return fingerprint(self.source.config,
                           {n: entry_digest(self.digest(n), self.source.raw_info(n)) for n in names})

    def manifest(self, layers: LayerRange, *, embed: bool, norm: bool) -> Manifest:
        cfg = self.source.config
        if layers.end > cfg.num_layers:
            raise WeightsError(f"layer range {layers} exceeds the model's {cfg.num_layers} layers")
        names = covered_names(self.source, layers, embed=embed, norm=norm)
        entries = tuple(
            TensorEntry(name=n, nbytes=len(self.source.raw_bytes(n)), sha256=self.digest(n),
                        info=self.source.raw_info(n))
            for n in names
        )
        return Manifest(config=cfg, layers=layers, embed=embed, norm=norm,
                        fingerprint=self.range_fingerprint(layers, embed=embed, norm=norm), tensors=entries)

    def install(self, app: web.Application) -> None:
        app.router.add_get(MANIFEST_PATH, self._manifest)
        app.router.add_get(TENSOR_PATH, self._tensor)

    async def _manifest(self, request: web.Request) -> web.Response:
        q = request.query
        try:
            layers = LayerRange(start=int(q["start"]), end=int(q["end"]))
            embed, norm = q.get("embed", "0") == "1", q.get("norm", "0") == "1"
        except (KeyError, ValueError) as e:
            raise web.HTTPBadRequest(text=f"manifest needs start, end (integers), embed, norm: {e}") from None
        try:
            manifest = await asyncio.to_thread(self.manifest, layers, embed=embed, norm=norm)
        except WeightsError as e:
            raise web.HTTPBadRequest(text=str(e)) from None
        return web.Response(text=manifest.model_dump_json(), content_type="application/json")

    async def _tensor(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        if name not in self.source.names():
            raise web.HTTPNotFound(text=f"no tensor {name!r}")
        data = self.source.raw_bytes(name)
        resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream", "X-Sha256": self.digest(name)})
        resp.content_length = len(data)
        await resp.prepare(request)
        try:
            for a in range(0, len(data), CHUNK_BYTES):
                await resp.write(bytes(data[a : a + CHUNK_BYTES]))
        finally:
            self._drop(name)
        await resp.write_eof()
        self.served_bytes += len(data)
        return resp


# ------------------------------------------------------------------------------------------------ fetching


def tensor_from_raw(config: ModelConfig, name: str, info: dict, raw: bytes | memoryview) -> torch.Tensor:
    """Turn stored bytes (as WeightSource.raw_bytes gave them, described by raw_info) into a float tensor.
    Storage info that does not describe the bytes raises WeightsError."""
    try:
        return _tensor_from_raw(config, name, info, raw)
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as e:
        raise WeightsError(f"tensor {name}: storage info {info!r} does not describe its bytes ({e})") from None


def _tensor_from_raw(config: ModelConfig, name: str, info: dict, raw: bytes | memoryview) -> torch.Tensor:
    if info.get("format") == "gguf":
        return gguf_tensor_from_raw(config, name, info, raw)
    if info.get("format") == "safetensors":
        dtype = safetensors_dtype(info["dtype"])
        if dtype is None:
            raise WeightsError(f"tensor {name} has unsupported dtype {info['dtype']}")
        if len(raw) == 0:
            return torch.empty(info["shape"], dtype=dtype)
        return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(info["shape"])
    raise WeightsError(f"tensor {name}: unknown storage format {info.get('format')!r}")


class FetchedSource:
    """A WeightSource over verified, cached tensor files (only the tensors of one range)."""

    def __init__(self, manifest: Manifest, files: dict[str, Path]):
        self.config = manifest.config
        self.path = next(iter(files.values())).parent if files else Path(".")
        self.manifest = manifest
        self._entries = {t.name: t for t in manifest.tensors}
        self._files = files

    def names(self) -> list[str]:
        return list(self._entries)

    def raw_bytes(self, name: str) -> memoryview:
        try:
            return memoryview(self._files[name].read_bytes())
        except KeyError:
            raise WeightsError(f"tensor {name!r} was not fetched") from None

    def raw_info(self, name: str) -> dict:
        return self._entries[name].info

    def load(self, name: str) -> torch.Tensor:
        return tensor_from_raw(self.config, name, self.raw_info(name), self.raw_bytes(name))


def _cached(path: Path, sha256: str) -> bool:
    if not path.is_file():
        return False
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK_BYTES), b""):
            h.update(chunk)
    if h.hexdigest() != sha256:
        return False
    os.utime(path)  # used now: the modification time orders the cache, least recently used first
    return True


def remove_partial(folder: Path) -> int:
    """Delete the partial files (``*.part<pid>``) a fetch left behind (a killed agent; another process's, or this
    one's older than FETCH_TIMEOUT_S: never a write in progress here). -> how many."""
    n = 0
    mine = f".part{os.getpid()}"
    for p in folder.glob("*.part*"):
        with contextlib.suppress(OSError):
            if p.suffix == mine and time.time() - p.stat().st_mtime < FETCH_TIMEOUT_S:
                continue
            p.unlink()
            n += 1
    if n:
        log.info("removed %d partial weight file(s) in %s", n, folder)
    return n


def trim_cache(folder: Path, max_bytes: int, keep: set[Path]) -> int:
    """Delete cached tensor files, least recently used first, until the folder holds at most ``max_bytes`` (the
    files in ``keep``, the range being served, stay whatever their size). -> bytes freed."""
    entries = []
    for p in folder.glob("*.bin"):
        with contextlib.suppress(OSError):
            st = p.stat()
            entries.append((st.st_mtime, p, st.st_size))
    total = sum(size for _, _, size in entries)
    freed = 0
    for _, p, size in sorted(entries, key=lambda e: e[0]):
        if total - freed <= max_bytes:
            break
        if p in keep:
            continue
        with contextlib.suppress(OSError):
            p.unlink()
            freed += size
    if freed:
        log.info("weight cache: dropped %.1f MB of least recently used tensors (bound %.1f MB)", freed / 1e6,
                 max_bytes / 1e6)
    return freed


def verify_manifest(manifest: Manifest, expected_fingerprint: str | None) -> None:
    """The manifest's digests must give the range fingerprint the plan names."""
    names = stage_tensor_names(manifest.config, manifest.layers, embed=manifest.embed, norm=manifest.norm)
    entries = {t.name: t for t in manifest.tensors}
    if len(entries) != len(manifest.tensors):
        raise WeightsError("the manifest names a tensor twice")
    missing = [n for n in names if n not in entries]
    if missing:
        raise WeightsError(f"the manifest lacks {len(missing)} tensor(s) of the range, e.g. {missing[0]}")
    extra = set(entries) - set(names) - {ROPE_FREQS}
    if extra:
        raise WeightsError(f"the manifest holds {len(extra)} tensor(s) outside the range, e.g. {sorted(extra)[0]}")
    covered = [*names, *([ROPE_FREQS] if ROPE_FREQS in entries else [])]
    fp = fingerprint(manifest.config, {n: entry_digest(entries[n].sha256, entries[n].info) for n in covered})
    if fp != manifest.fingerprint or (expected_fingerprint and fp != expected_fingerprint):
        raise WeightsError(f"range fingerprint mismatch: digests give {fp}, expected "
                           f"{expected_fingerprint or manifest.fingerprint}")


async def fetch_range(
    session: aiohttp.ClientSession,
    base_url: str,
    layers: LayerRange,
    *,
    embed: bool,
    norm: bool,
    cache_dir: Path,
    expected_fingerprint: str | None = None,
    progress: Callable[[int, int], None] | None = None,
    cache_max_bytes: int | None = None,
) -> tuple[FetchedSource, int]:
    """Fetch (or find in the cache) exactly the tensors of a range; verify them. -> (source, bytes transferred).
    A progress bar (bytes, rate, time left) goes to stderr when it is a terminal; ``progress(done, total)`` is
    called as bytes arrive. Partial files of earlier fetches are removed first; with ``cache_max_bytes`` the cache
    is trimmed afterwards, least recently used first, never below this range's tensors (trim_cache)."""
    params = {"start": str(layers.start), "end": str(layers.end), "embed": "1" if embed else "0",
              "norm": "1" if norm else "0"}
    timeout = aiohttp.ClientTimeout(total=FETCH_TIMEOUT_S)
    try:
        async with session.get(base_url + MANIFEST_PATH, params=params, timeout=timeout) as r:
            if r.status != 200:
                raise WeightsError(f"{base_url} refused the manifest of {layers}: {r.status} {await r.text()}")
            manifest = Manifest.model_validate_json(await r.read())
    except (aiohttp.ClientError, OSError, TimeoutError) as e:
        raise PeerGone(f"cannot reach the weight server {base_url}: {e or type(e).__name__}") from e
    verify_manifest(manifest, expected_fingerprint)
    folder = cache_dir / "tensors"
    folder.mkdir(parents=True, exist_ok=True)
    await asyncio.to_thread(remove_partial, folder)
    files = {t.name: folder / f"{t.sha256}.bin" for t in manifest.tensors}
    missing = await asyncio.to_thread(lambda: [t for t in manifest.tensors if not _cached(files[t.name], t.sha256)])
    total = sum(t.nbytes for t in missing)
    transferred = 0
    sem = asyncio.Semaphore(FETCH_CONCURRENCY)
    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=f"fetching layers {layers}",
               disable=None if total else True, leave=False)

    def arrived(n: int) -> None:
        nonlocal transferred
        transferred += n
        bar.update(n)
        if progress is not None:
            progress(transferred, total)

    async def one(entry: TensorEntry) -> None:
        async with sem:
            await _download(session, f"{base_url}/weights/tensor/{entry.name}", entry, files[entry.name], timeout,
                            arrived)

    t0 = time.perf_counter()
    try:
        async with asyncio.TaskGroup() as tg:
            for entry in missing:
                tg.create_task(one(entry))
    except ExceptionGroup as eg:  # report the first failure as itself
        raise eg.exceptions[0] from None
    finally:
        bar.close()
    took = time.perf_counter() - t0
    if cache_max_bytes is not None:
        await asyncio.to_thread(trim_cache, folder, cache_max_bytes, set(files.values()))
    log.info("range %s: %d tensors, %.1f MB, %.1f MB transferred in %.2f s (%.1f MB/s)", layers, len(files),
             manifest.nbytes / 1e6, transferred / 1e6, took, transferred / 1e6 / max(took, 1e-9))
    return FetchedSource(manifest, files), transferred


async def _download(session: aiohttp.ClientSession, url: str, entry: TensorEntry, path: Path,
                    client_timeout: aiohttp.ClientTimeout, arrived: Callable[[int], None]) -> int:
    buf = bytearray()
    try:
        async with session.get(url, timeout=client_timeout) as r:
            if r.status != 200:
                raise WeightsError(f"{url}: {r.status} {await r.text()}")
            async for chunk in r.content.iter_chunked(CHUNK_BYTES):
                buf += chunk
                arrived(len(chunk))
                if len(buf) > entry.nbytes:
                    raise WeightsError(f"tensor {entry.name}: more than the {entry.nbytes} bytes announced")
    except (aiohttp.ClientError, OSError, TimeoutError) as e:
        raise PeerGone(f"fetching {entry.name} from {url} failed: {e or type(e).__name__}") from e
    digest = hashlib.sha256(buf).hexdigest()
    if digest != entry.sha256:
        raise WeightsError(f"tensor {entry.name}: SHA-256 mismatch (got {digest[:16]}..., expected "
                           f"{entry.sha256[:16]}...): refusing tampered or corrupt weights")
    await asyncio.to_thread(_write_atomic, path, bytes(buf))
    return len(buf)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(f".part{os.getpid()}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError as e:  # a full disk: no partial file stays behind, and the load fails with the reason
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise WeightsError(f"cannot store {path.name}: {e}") from e
