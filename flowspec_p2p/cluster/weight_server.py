"""Weights reach devices without a hub: the leader serves exactly the tensors of a range; a member fetches them.

    GET /weights/manifest?start=A&end=B&embed=0|1&norm=0|1   -> Manifest: config, per tensor size + SHA-256
                                                                 + storage info, and the range fingerprint
    GET /weights/tensor/{name}                                -> the tensor's *stored* bytes (quantised GGUF
                                                                 blocks stay quantised: ~6x smaller than float32);
                                                                 ``Range: bytes=N-`` -> 206 and the rest from N

A stage needs its layers, the token embedding if it is stage 1, and the final norm if it is the last stage
(``stage_tensor_names``); the LM head stays on the leader (as in FlowSpec), so the last stage neither fetches nor
holds it. The server sends a tensor from its memory-mapped file a chunk at a time, each chunk's pages dropped once
sent, so serving a 4 GB model never holds more than a few chunks of it.

The fetching side (``fetch_range``) recomputes the range fingerprint from the manifest's digests and compares it
with the one the plan names (weights.range_fingerprint), then streams each missing tensor into the cache
(weight_cache.py: ``<state dir>/tensors/<sha256>.bin``, hashed on the way, resumed with a range request where an
earlier fetch stopped, verified before use), showing its progress (bytes, rate, time left) on a terminal and in the
log. The result is a ``FetchedSource``: a WeightSource over the memory-mapped cache, from which the plan's engine
builds the shard as from a local file.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import mmap
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp
from aiohttp import web
from pydantic import Field, ValidationError
from tqdm import tqdm
from yarl import URL

from ..errors import PeerGone, WeightsError
from ..model.arch import ModelConfig
from ..model.weights import NORM, ROPE_FREQS, fingerprint, shard_tensor_names, tensor_digest
from ..types import FrozenModel, LayerRange
from .handshake import SESSION_HEADER
from .pinning import pinned_identity
from .weight_cache import (  # noqa: F401 - FetchedSource, tensor_from_raw and trim_cache are this module's API too
    SHA256_HEX,
    FetchedSource,
    PartFile,
    bin_path,
    cached,
    remove_partial,
    tensor_from_raw,
    trim_cache,
)
from .weight_stream import Link, Receiver, Unauthorized

log = logging.getLogger(__name__)

MANIFEST_PATH = "/weights/manifest"
TENSOR_PATH = "/weights/tensor/{name}"
CHUNK_BYTES = 4 << 20  # bytes the server sends at a time (its per-write costs: a thread hop, an madvise, a TLS flush)
PAGE_BYTES = mmap.PAGESIZE
FETCH_CONCURRENCY = 4  # tensors fetched at once
CONNECT_TIMEOUT_S = 30.0
STALL_TIMEOUT_S = 60.0  # a fetch that receives nothing for this long fails (it resumes on the next try)
PROGRESS_LOG_S = 5.0  # a fetch logs its progress this often
_RANGE = re.compile(r"^bytes=(\d+)-$")


class TensorEntry(FrozenModel):
    name: str
    nbytes: int = Field(ge=0)
    sha256: str = Field(pattern=SHA256_HEX.pattern)  # 64 hex digits: the cache's file name
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
    from this process's memory after hashing (tensor_digest) and, chunk by chunk, as it is sent (``source.release``,
    where the source has one): the leader serves every member's layers, and a whole model's pages would otherwise
    stay resident."""

    def __init__(self, source):
        self.source = source
        self._digests: dict[str, str] = {}
        self.served_bytes = 0

    def digest(self, name: str) -> str:
        d = self._digests.get(name)
        if d is None:
            d = self._digests[name] = tensor_digest(self.source, name)
        return d

    def _drop(self, name: str, start: int = 0, end: int | None = None) -> None:
        release = getattr(self.source, "release", None)
        if release is not None:
            release(name, start, end)

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
        data = memoryview(self.source.raw_bytes(name)).cast("B")  # a view of the mapped file: nothing read yet
        total = len(data)
        start = 0
        asked = request.headers.get("Range")
        if asked is not None:
            m = _RANGE.match(asked.strip())
            if m is None or int(m.group(1)) > total:
                raise web.HTTPRequestRangeNotSatisfiable(headers={"Content-Range": f"bytes */{total}"})
            start = int(m.group(1))
        headers = {"Content-Type": "application/octet-stream", "X-Sha256": await asyncio.to_thread(self.digest, name),
                   "Accept-Ranges": "bytes"}
        if asked is not None:
            headers["Content-Range"] = f"bytes {start}-{total - 1}/{total}"
        resp = web.StreamResponse(status=206 if asked is not None else 200, headers=headers)
        resp.content_length = total - start
        await resp.prepare(request)

        def page_in(a: int) -> None:  # off the event loop (a slow disk must not hold up heartbeats): each page of the
            data[a:min(total, a + CHUNK_BYTES):PAGE_BYTES].tobytes()  # chunk mapped, one byte of each copied

        offsets = range(start, total, CHUNK_BYTES)
        ahead = None
        try:
            ahead = asyncio.ensure_future(asyncio.to_thread(page_in, offsets[0])) if offsets else None
            for i, a in enumerate(offsets):
                await ahead
                ahead = asyncio.ensure_future(asyncio.to_thread(page_in, offsets[i + 1])) if i + 1 < len(offsets) \
                    else None
                b = min(total, a + CHUNK_BYTES)
                await resp.write(data[a:b])  # TLS encrypts straight from the mapped pages, while the next are mapped
                self._drop(name, a, b)
                self.served_bytes += b - a
        finally:
            if ahead is not None:  # a page-in in flight ends before the view goes (a client gone mid-tensor)
                await asyncio.gather(ahead, return_exceptions=True)
            data.release()
        await resp.write_eof()
        return resp


# ------------------------------------------------------------------------------------------------ fetching


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


class Progress:
    """A fetch's progress: a bar on a terminal (bytes, rate, time left), a log line every PROGRESS_LOG_S, and the
    caller's ``progress(done, total)``."""

    def __init__(self, layers: LayerRange, total: int, progress: Callable[[int, int], None] | None):
        self.layers, self.total, self.callback = layers, total, progress
        self.done = 0
        self.t0 = self.logged = time.monotonic()
        self.bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=f"fetching layers {layers}",
                        disable=None if total else True, leave=False)

    def __call__(self, n: int) -> None:
        self.done += n
        self.bar.update(n)
        if self.callback is not None:
            self.callback(self.done, self.total)
        now = time.monotonic()
        if now - self.logged >= PROGRESS_LOG_S:
            self.logged = now
            rate = self.done / max(now - self.t0, 1e-9)
            log.info("fetching layers %s: %.0f of %.0f MB (%.0f%%), %.1f MB/s, %.0f s left", self.layers,
                     self.done / 1e6, self.total / 1e6, 100 * self.done / max(self.total, 1), rate / 1e6,
                     (self.total - self.done) / max(rate, 1e-9))

    def close(self) -> None:
        self.bar.close()


# part files being fetched in this process -> [their lock, how many fetches want them]: one writer each
_FETCHING: dict[Path, list] = {}


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
    Progress goes to a terminal's bar and the log; ``progress(done, total)`` is called as bytes arrive (``total``:
    the bytes still missing when the fetch began, resumed parts included). Tensors an interrupted fetch left
    partly are resumed where they stopped; with ``cache_max_bytes`` the cache is trimmed afterwards, least recently
    used first, never below this range's tensors (trim_cache)."""
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S, sock_read=STALL_TIMEOUT_S)
    body, link = await _manifest_request(session, base_url, layers, embed=embed, norm=norm, client_timeout=timeout)
    try:
        manifest = Manifest.model_validate_json(body)
    except ValidationError as e:  # e.g. a digest that is no SHA-256 (it would become a file name)
        raise WeightsError(f"{base_url} sent a malformed manifest of {layers}: {e.errors()[0]['msg']} at "
                           f"{'.'.join(map(str, e.errors()[0]['loc']))}") from None
    verify_manifest(manifest, expected_fingerprint)
    folder = cache_dir / "tensors"
    folder.mkdir(parents=True, exist_ok=True)
    await asyncio.to_thread(remove_partial, folder)
    files = {t.name: bin_path(folder, t.sha256) for t in manifest.tensors}
    unique = list({t.sha256: t for t in manifest.tensors}.values())  # equal tensors (norms of ones) share a file
    missing = await asyncio.to_thread(lambda: [t for t in unique if not cached(files[t.name], t.sha256)])
    total = sum(t.nbytes for t in missing)
    sem = asyncio.Semaphore(FETCH_CONCURRENCY)
    arrived = Progress(layers, total, progress)
    loop = asyncio.get_running_loop()

    def stored(n: int) -> None:  # (on a receiving thread)
        loop.call_soon_threadsafe(arrived, n)

    async def one(entry: TensorEntry) -> None:
        nonlocal link
        async with sem:
            for attempt in (1, 2):
                used = link
                try:
                    await _download(pool, used, entry, folder, stored)
                    return
                except Unauthorized:
                    if attempt == 2:
                        raise
                    if link is used:  # the session expired, or the leader restarted: authenticate afresh
                        _, link = await _manifest_request(session, base_url, layers, embed=embed, norm=norm,
                                                          client_timeout=timeout)

    # the receiving threads block for as long as a tensor takes: a pool of their own leaves the loop's default
    # executor to everything else (the leader's own weight server among it, where agents share a process)
    pool = ThreadPoolExecutor(FETCH_CONCURRENCY, thread_name_prefix="weight-fetch")
    t0 = time.perf_counter()
    try:
        async with asyncio.TaskGroup() as tg:
            for entry in missing:
                tg.create_task(one(entry))
    except ExceptionGroup as eg:  # report the first failure as itself
        raise eg.exceptions[0] from None
    finally:
        pool.shutdown(wait=False)  # (every call on it has ended: _blocking waits for its thread)
        arrived.close()
    took = time.perf_counter() - t0
    if cache_max_bytes is not None:
        await asyncio.to_thread(trim_cache, folder, cache_max_bytes, set(files.values()))
    transferred = arrived.done
    log.info("range %s: %d tensors, %.1f MB, %.1f MB transferred in %.2f s (%.1f MB/s)", layers, len(files),
             manifest.nbytes / 1e6, transferred / 1e6, took, transferred / 1e6 / max(took, 1e-9))
    return FetchedSource(manifest, files), transferred


async def _manifest_request(session: aiohttp.ClientSession, base_url: str, layers: LayerRange, *, embed: bool,
                            norm: bool, client_timeout: aiohttp.ClientTimeout) -> tuple[bytes, Link]:
    """GET the manifest of a range through the session (which authenticates and pins, pinning.py). -> (its body, the
    Link its tensors are fetched over: the address, the identity pinned there, the token the request carried)"""
    params = {"start": str(layers.start), "end": str(layers.end), "embed": "1" if embed else "0",
              "norm": "1" if norm else "0"}
    try:
        async with session.get(base_url + MANIFEST_PATH, params=params, timeout=client_timeout) as r:
            if r.status != 200:
                raise WeightsError(f"{base_url} refused the manifest of {layers}: {r.status} {await r.text()}")
            body = await r.read()
            sent = r.request_info.headers
    except (aiohttp.ClientError, OSError, TimeoutError) as e:
        raise PeerGone(f"cannot reach the weight server {base_url}: {e or type(e).__name__}") from e
    url = URL(base_url)
    tls = url.scheme == "https"
    link = Link(host=url.raw_host or "", port=url.port or (443 if tls else 80), tls=tls,
                identity=pinned_identity(session, url) if tls else None, token=sent.get(SESSION_HEADER),
                connect_timeout_s=CONNECT_TIMEOUT_S, stall_timeout_s=STALL_TIMEOUT_S)
    return body, link


async def _blocking(pool: ThreadPoolExecutor, fn, *args, cancel: Callable[[], None] | None = None):
    """``fn(*args)`` on a thread of ``pool``. A cancelled caller calls ``cancel`` and still waits for it to end, so
    no two threads ever touch one part file."""
    fut = asyncio.get_running_loop().run_in_executor(pool, fn, *args)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        if cancel is not None:
            cancel()
        with contextlib.suppress(Exception):
            await fut
        raise


async def _download(pool: ThreadPoolExecutor, link: Link, entry: TensorEntry, folder: Path,
                    stored: Callable[[int], None]) -> int:
    """Stream one tensor into its part file (from where an earlier fetch stopped) on a worker thread, verify it, put
    it in place. -> bytes transferred"""
    part = PartFile(folder, entry.sha256, entry.nbytes)
    held = _FETCHING.setdefault(part.path, [asyncio.Lock(), 0])
    held[1] += 1
    try:
        async with held[0]:
            try:
                have = await _blocking(pool, part.open)
                if have < entry.nbytes:
                    receiver = Receiver(link, entry.name, part, stored)
                    got = await _blocking(pool, receiver.run, cancel=receiver.cancel)
                else:  # complete, but not yet renamed when the last fetch stopped
                    got = 0
                try:
                    await _blocking(pool, part.finish)
                except WeightsError as e:
                    raise WeightsError(f"tensor {entry.name}: {e}") from None
                return got
            finally:
                await _blocking(pool, part.close)
    finally:
        held[1] -= 1
        if not held[1]:
            del _FETCHING[part.path]
