"""A member's cache of fetched tensors: ``<state dir>/tensors/<sha256>.bin``, content-addressed, each file one
tensor's stored bytes (a re-plan that hands a member a range it held before costs no transfer).

    part file     ``<sha256>.part``: a tensor being fetched. Bytes are appended as they arrive and hashed on the way
                  (no buffer of the whole tensor, no second copy); an interrupted fetch leaves it behind, and the
                  next one re-hashes what it holds and asks only for the rest (weight_server's HTTP range request).
                  Complete and matching its SHA-256, it is fsync'ed, renamed to ``.bin`` and its folder fsync'ed,
                  so a power cut leaves either a verified file or a part to resume, never a wrong ``.bin``
    FetchedSource a WeightSource over verified files, each memory-mapped: the engine packs straight from the page
                  cache and drops each tensor's pages once packed (``release``), so loading holds at most the shard
                  being built plus one tensor

Every digest is checked to be 64 hex digits before it becomes a file name (a manifest is a peer's word).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import mmap
import os
import re
from pathlib import Path

import torch

from ..errors import WeightsError
from ..model.arch import ModelConfig
from ..model.weights import gguf_tensor_from_raw, safetensors_dtype

log = logging.getLogger(__name__)

READ_BYTES = 4 << 20  # bytes hashed at a time when re-reading a file
STAGE_BYTES = 1 << 20  # bytes a fetch receives, hashes and writes at a time (stays in the CPU's cache between them)
ALIGN = 4096  # O_DIRECT's alignment of file offsets, lengths and buffers (the page size: the usual block sizes)
DIRECT_IO = hasattr(os, "O_DIRECT")  # write aligned staged bytes past the page cache where the OS has it
SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
LEGACY_PART = re.compile(r"\.part\d+$")  # older versions' per-process partial files (never resumable)


def check_digest(sha256: str) -> str:
    """``sha256`` if it is 64 lowercase hex digits (the only names the cache gives files), else WeightsError."""
    if not isinstance(sha256, str) or not SHA256_HEX.match(sha256):
        raise WeightsError(f"not a SHA-256 digest: {str(sha256)[:80]!r}")
    return sha256


def bin_path(folder: Path, sha256: str) -> Path:
    return folder / f"{check_digest(sha256)}.bin"


def fsync_dir(folder: Path) -> None:
    """Make the folder's entries (a rename) durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _hash_file(path: Path, h, limit: int | None = None) -> int:
    """Feed ``path``'s bytes (the first ``limit``) to ``h``. -> bytes read"""
    n = 0
    with open(path, "rb") as f:
        while limit is None or n < limit:
            chunk = f.read(READ_BYTES if limit is None else min(READ_BYTES, limit - n))
            if not chunk:
                break
            h.update(chunk)
            n += len(chunk)
    return n


def cached(path: Path, sha256: str) -> bool:
    """Whether ``path`` holds bytes of digest ``sha256`` (read and hashed: a damaged file is not used). A hit
    counts as a use (the modification time orders the cache, least recently used first)."""
    if not path.is_file():
        return False
    h = hashlib.sha256()
    _hash_file(path, h)
    if h.hexdigest() != sha256:
        return False
    os.utime(path)
    return True


class PartFile:
    """One tensor being fetched into the cache, resumable (blocking I/O: run its methods off the event loop).

    ``open()`` -> bytes already held (re-hashed); bytes arrive either through ``write(chunk)`` (appended and hashed)
    or, copy-free, into the part's staging buffer: ``stage()`` is where the next bytes go, ``commit(n)`` hashes and
    appends the first ``n`` of them; ``finish()`` checks size and digest, makes the file durable and renames it into
    place; ``discard()`` deletes it.

    Staged bytes that keep the file aligned (a whole STAGE_BYTES at an offset that is a multiple of ALIGN) are written
    with O_DIRECT where the file system has it: straight from the buffer to the disk, without a copy into the page
    cache (on a small device that copy costs as much CPU as the hashing); the rest (the tensor's tail, the first bytes
    after resuming at an odd offset) goes through the page cache."""

    def __init__(self, folder: Path, sha256: str, nbytes: int):
        self.final = bin_path(folder, sha256)
        self.path = folder / f"{sha256}.part"
        self.sha256, self.nbytes = sha256, nbytes
        self.have = 0
        self._h = hashlib.sha256()
        self._fd: int | None = None
        self._direct = False  # whether the descriptor has O_DIRECT now
        self._can_direct = DIRECT_IO  # whether to try it (cleared once the file system refuses it)
        self._buf: mmap.mmap | None = None  # the staging buffer: page-aligned, as O_DIRECT wants
        self._view: memoryview | None = None

    def open(self) -> int:
        """Open for appending after the bytes a previous fetch left (too many: start again). -> bytes held"""
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            size = 0
        if size > self.nbytes:
            size = 0
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | (0 if size else os.O_TRUNC), 0o644)
        if size:
            self.have = _hash_file(self.path, self._h, size)
            os.ftruncate(self._fd, self.have)
        os.lseek(self._fd, self.have, os.SEEK_SET)
        return self.have

    def restart(self) -> None:
        """Drop what is held (the server sent the whole tensor instead of the rest)."""
        os.ftruncate(self._fd, 0)
        os.lseek(self._fd, 0, os.SEEK_SET)
        self.have, self._h = 0, hashlib.sha256()

    def write(self, chunk: bytes | memoryview) -> None:
        if self.have + len(chunk) > self.nbytes:
            raise WeightsError(f"more than the {self.nbytes} bytes announced for {self.sha256[:16]}...")
        self._h.update(chunk)
        self._append(memoryview(chunk).cast("B"), direct=False)
        self.have += len(chunk)

    def stage(self) -> memoryview:
        """Where the next bytes go: a view of the staging buffer, as long as the bytes that keep the file aligned
        once written (and never past the tensor's end). Valid until the next ``stage``."""
        if self._buf is None:
            self._buf = mmap.mmap(-1, STAGE_BYTES)
            self._view = memoryview(self._buf)
        return self._view[:min(STAGE_BYTES - self.have % ALIGN, self.nbytes - self.have)]

    def commit(self, n: int) -> None:
        """Hash and append the first ``n`` bytes of the view ``stage()`` gave."""
        if n <= 0:
            return
        data = self._view[:n]
        self._h.update(data)
        self._append(data, direct=self._can_direct and self.have % ALIGN == 0 and n % ALIGN == 0)
        self.have += n

    def _append(self, data: memoryview, *, direct: bool) -> None:
        try:
            if direct != self._direct:
                direct = self._set_direct(direct)
            while data:
                try:
                    k = os.write(self._fd, data)
                except OSError as e:
                    if e.errno != errno.EINVAL or not self._direct:
                        raise
                    self._can_direct = self._set_direct(False)  # a device with larger blocks: the page cache then
                    continue
                data = data[k:]
        except OSError as e:  # a full disk: the part is not trusted, the load fails with the reason
            self.close()
            self.discard()
            raise WeightsError(f"cannot store {self.final.name}: {e}") from e

    def _set_direct(self, on: bool) -> bool:
        """Turn O_DIRECT on or off for the descriptor. -> whether it is on (a file system without it says no)."""
        flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
        try:
            fcntl.fcntl(self._fd, fcntl.F_SETFL, (flags | os.O_DIRECT) if on else (flags & ~os.O_DIRECT))
        except OSError:
            self._can_direct = False
            on = False
        self._direct = on
        return on

    def finish(self) -> Path:
        """Verify the whole tensor, make it durable, rename it into place. A digest mismatch deletes the part and
        raises WeightsError."""
        if self.have != self.nbytes:
            raise WeightsError(f"{self.final.name}: {self.have} of {self.nbytes} bytes")
        got = self._h.hexdigest()
        if got != self.sha256:
            self.close()
            self.discard()
            raise WeightsError(f"SHA-256 mismatch (got {got[:16]}..., expected {self.sha256[:16]}...): refusing "
                               "tampered or corrupt weights")
        try:
            os.fsync(self._fd)
            self.close()
            os.replace(self.path, self.final)
            fsync_dir(self.final.parent)
        except OSError as e:
            self.close()
            raise WeightsError(f"cannot store {self.final.name}: {e}") from e
        return self.final

    def close(self) -> None:
        """Close the file (what was written stays for the next fetch to resume from) and free the buffer."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
            self._direct = False
        self._buf = self._view = None  # (unmapped once the last view of it goes)

    def discard(self) -> None:
        with contextlib.suppress(OSError):
            self.path.unlink()


def remove_partial(folder: Path) -> int:
    """Delete partial files no fetch can resume: older versions' ``*.part<pid>`` and parts not named by a digest
    (``<sha256>.part`` files stay: the next fetch of that tensor resumes them). -> how many"""
    n = 0
    for p in folder.glob("*.part*"):
        if p.suffix == ".part" and SHA256_HEX.match(p.stem):
            continue
        with contextlib.suppress(OSError):
            p.unlink()
            n += 1
    if n:
        log.info("removed %d partial weight file(s) in %s", n, folder)
    return n


def trim_cache(folder: Path, max_bytes: int, keep: set[Path]) -> int:
    """Delete cached tensor files and parts, least recently used first, until the folder holds at most ``max_bytes``
    (the files in ``keep``, the range being served, stay whatever their size). -> bytes freed."""
    entries = []
    for p in [*folder.glob("*.bin"), *folder.glob("*.part")]:
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
    """A WeightSource over verified, cached tensor files (only the tensors of one range), each memory-mapped.
    ``manifest``: weight_server.Manifest (config, and each tensor's storage info)."""

    def __init__(self, manifest, files: dict[str, Path]):
        self.config = manifest.config
        self.path = next(iter(files.values())).parent if files else Path(".")
        self.manifest = manifest
        self._entries = {t.name: t for t in manifest.tensors}
        self._files = files
        self._maps: dict[str, mmap.mmap | None] = {}

    def names(self) -> list[str]:
        return list(self._entries)

    def _map(self, name: str) -> mmap.mmap | None:
        if name not in self._maps:
            try:
                path = self._files[name]
            except KeyError:
                raise WeightsError(f"tensor {name!r} was not fetched") from None
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size != self._entries[name].nbytes:
                    raise WeightsError(f"cached {path.name} holds {size} bytes, not {self._entries[name].nbytes}")
                # copy-on-write, as GGUFSource: torch may view it writable; nothing writes
                self._maps[name] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
        return self._maps[name]

    def raw_bytes(self, name: str) -> memoryview:
        mm = self._map(name)
        return memoryview(mm) if mm is not None else memoryview(b"")

    def raw_info(self, name: str) -> dict:
        return self._entries[name].info

    def load(self, name: str) -> torch.Tensor:
        return tensor_from_raw(self.config, name, self.raw_info(name), self.raw_bytes(name))

    def release(self, name: str, start: int = 0, end: int | None = None) -> None:
        """Drop the file pages of ``name``'s bytes [start, end) from this process's memory (packed now; they are
        read again from the page cache if used)."""
        mm = self._maps.get(name)
        if mm is None:
            return
        end = len(mm) if end is None else min(end, len(mm))
        page = mmap.PAGESIZE
        a = start // page * page
        b = min(-(-end // page) * page, len(mm))
        if b > a:
            mm.madvise(mmap.MADV_DONTNEED, a, b - a)

    def close(self) -> None:
        for mm in self._maps.values():
            if mm is not None:
                with contextlib.suppress(BufferError):  # a tensor still viewing it keeps it open
                    mm.close()
        self._maps.clear()

