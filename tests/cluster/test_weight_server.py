"""Weights without a hub: a member fetches exactly its range's stored tensors, verifies them, caches them, and
builds the same shard as from a local copy; tampered bytes are refused."""

import hashlib
import time

import aiohttp
import pytest
import torch
from aiohttp import web

from flowspec_p2p.cluster.control import RingNode
from flowspec_p2p.cluster.stage_host import build_shard
from flowspec_p2p.cluster.weight_server import WeightServer, fetch_range, stage_fingerprint
from flowspec_p2p.errors import WeightsError
from flowspec_p2p.model.load import get_engine
from flowspec_p2p.model.torch_shard import TorchShard
from flowspec_p2p.model.weights import open_source
from flowspec_p2p.types import LayerRange

F64_ENGINE = get_engine("torch", torch.float64)


async def serve(app: web.Application):
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


@pytest.fixture
async def tiny_server(tiny_llama):
    source = open_source(tiny_llama)
    ws = WeightServer(source)
    app = web.Application()
    ws.install(app)
    runner, url = await serve(app)
    yield source, ws, url
    await runner.cleanup()


async def test_a_fetched_range_builds_the_same_shard_as_a_local_copy(tiny_server, tmp_path):
    source, _, url = tiny_server
    rng = LayerRange(start=1, end=3)
    expected = stage_fingerprint(source, rng, embed=False, norm=True)
    async with aiohttp.ClientSession() as s:
        fetched, n = await fetch_range(s, url, rng, embed=False, norm=True, cache_dir=tmp_path,
                                       expected_fingerprint=expected)
        assert n == fetched.manifest.nbytes > 0
        names = fetched.names()
        assert not any(".layers.0." in name or ".layers.3." in name for name in names)  # only the range ...
        assert "model.embed_tokens.weight" not in names  # ... and no LM head: it stays on the leader
        assert "model.norm.weight" in names
        _, n2 = await fetch_range(s, url, rng, embed=False, norm=True, cache_dir=tmp_path,
                                  expected_fingerprint=expected)
        assert n2 == 0  # served from the content-addressed cache
    node = RingNode(agent_id="a", host="h", port=1, layers=rng, embed=False, head=True, fingerprint=expected)
    local = build_shard(source, node, F64_ENGINE)
    remote = build_shard(fetched, node, F64_ENGINE)
    ref = TorchShard.from_source(source, rng, embed=False, head=True, dtype=torch.float64)
    assert remote.head_t is None
    x = torch.randn(1, 5, 64, dtype=torch.float64)  # [batch, n, hidden]
    assert torch.equal(remote(x, None), ref(x, None))
    assert torch.equal(local(x, None), ref(x, None))


async def test_tampered_bytes_are_rejected(tiny_llama, tmp_path):
    source = open_source(tiny_llama)
    server = WeightServer(source)
    evil = web.Application()

    async def flipped(request):  # a man in the middle flipping bits of the q projections
        data = bytearray(source.raw_bytes(request.match_info["name"]))
        if "q_proj" in request.match_info["name"]:
            data[0] ^= 0xFF
        return web.Response(body=bytes(data))

    evil.router.add_get("/weights/manifest", server._manifest)
    evil.router.add_get("/weights/tensor/{name}", flipped)
    runner, url = await serve(evil)
    try:
        rng = LayerRange(start=0, end=1)
        async with aiohttp.ClientSession() as s:
            with pytest.raises(WeightsError, match="SHA-256 mismatch"):
                await fetch_range(s, url, rng, embed=True, norm=False, cache_dir=tmp_path)
            with pytest.raises(WeightsError, match="fingerprint mismatch"):
                await fetch_range(s, url, LayerRange(start=1, end=2), embed=False, norm=False, cache_dir=tmp_path,
                                  expected_fingerprint="0" * 32)
    finally:
        await runner.cleanup()
    tampered = {server.digest(n) for n in source.names() if "layers.0.self_attn.q_proj" in n}
    kept = {p.name.split(".")[0] for p in (tmp_path / "tensors").iterdir()}
    assert not tampered & kept  # neither kept nor left to resume; other tensors' parts may stay (they resume)


async def test_a_tampered_cache_file_is_fetched_again(tiny_server, tmp_path):
    source, _, url = tiny_server
    rng = LayerRange(start=0, end=1)
    async with aiohttp.ClientSession() as s:
        await fetch_range(s, url, rng, embed=False, norm=False, cache_dir=tmp_path)
        victim = next((tmp_path / "tensors").iterdir())
        victim.write_bytes(b"garbage")
        _, n = await fetch_range(s, url, rng, embed=False, norm=False, cache_dir=tmp_path)
    assert n == len(source.raw_bytes(next(iter(source.names())))) or n > 0
    assert hashlib.sha256(victim.read_bytes()).hexdigest() == victim.stem


async def test_quantised_gguf_blocks_travel_quantised_and_dequantise_identically(tmp_path):
    source = open_source(None)  # the packaged Q4_1 GGUF
    server = WeightServer(source)
    app = web.Application()
    server.install(app)
    runner, url = await serve(app)
    try:
        rng = LayerRange(start=4, end=5)
        async with aiohttp.ClientSession() as s:
            fetched, n = await fetch_range(s, url, rng, embed=False, norm=False, cache_dir=tmp_path,
                                           expected_fingerprint=stage_fingerprint(source, rng, embed=False, norm=False))
    finally:
        await runner.cleanup()
    float32_bytes = source.config.layer_params() * 4
    assert n < float32_bytes / 4  # quantised on the wire
    for name in fetched.names():
        assert torch.equal(fetched.load(name), source.load(name)), name


def test_a_rebuilt_shard_shares_the_blocks_it_already_had_and_loads_the_rest(tiny_llama):
    source = open_source(tiny_llama)
    old = TorchShard.from_source(source, LayerRange(start=0, end=2), embed=True, head=False, dtype=torch.float64)
    node = RingNode(agent_id="a", host="h", port=1, layers=LayerRange(start=1, end=4), embed=False, head=True,
                    fingerprint="")
    new = build_shard(source, node, F64_ENGINE, [old])
    assert new.blocks[0] is old.blocks[1]
    ref = TorchShard.from_source(source, node.layers, embed=False, head=True, dtype=torch.float64)
    x = torch.randn(1, 3, 64, dtype=torch.float64)
    assert torch.equal(new(x, None), ref(x, None))


async def test_a_fetch_reports_its_progress_in_bytes_up_to_the_total_and_logs_its_rate(tiny_server, tmp_path, caplog):
    _, _, url = tiny_server
    seen: list[tuple[int, int]] = []
    caplog.set_level("INFO", logger="flowspec_p2p.cluster.weight_server")
    async with aiohttp.ClientSession() as s:
        fetched, n = await fetch_range(s, url, LayerRange(start=0, end=2), embed=True, norm=False,
                                       cache_dir=tmp_path, progress=lambda done, total: seen.append((done, total)))
        assert seen[-1] == (n, n) == (fetched.manifest.nbytes, fetched.manifest.nbytes)
        assert [d for d, _ in seen] == sorted(d for d, _ in seen)
        assert "MB/s)" in caplog.text
        seen.clear()
        _, again = await fetch_range(s, url, LayerRange(start=0, end=2), embed=True, norm=False, cache_dir=tmp_path,
                                     progress=lambda done, total: seen.append((done, total)))
    assert (again, seen) == (0, [])  # all from the cache: nothing to report


async def test_partial_files_are_cleaned_and_the_cache_is_bounded_least_recently_used_first(tiny_server, tmp_path):
    import os

    from flowspec_p2p.cluster.weight_server import trim_cache

    _source, _ws, url = tiny_server
    folder = tmp_path / "tensors"
    folder.mkdir()
    (folder / "dead.part999999").write_bytes(b"x" * 100)  # left by an agent killed mid-write
    first, second = LayerRange(start=0, end=1), LayerRange(start=2, end=3)
    async with aiohttp.ClientSession() as s:
        a, _ = await fetch_range(s, url, first, embed=True, norm=False, cache_dir=tmp_path)
        assert not list(folder.glob("*.part*"))
        old = time.time() - 100
        for p in folder.glob("*.bin"):
            os.utime(p, (old, old))  # the first range was used long ago
        b, _ = await fetch_range(s, url, second, embed=False, norm=True, cache_dir=tmp_path, cache_max_bytes=1)
    kept = set(folder.glob("*.bin"))
    # the first range's files went (least recently used); the bound never drops the range in use
    assert kept == {folder / f"{t.sha256}.bin" for t in b.manifest.tensors}
    assert a.manifest.tensors[0].sha256 not in {p.stem for p in kept}
    size = sum(p.stat().st_size for p in kept)
    assert trim_cache(folder, 0, set()) == size
    assert not list(folder.glob("*.bin"))


def test_a_full_disk_leaves_no_partial_file_and_fails_with_a_weights_error(tmp_path, monkeypatch):
    from flowspec_p2p.cluster import weight_cache

    def full(fd, data):
        raise OSError(28, "No space left on device")

    for staged in (False, True):  # bytes written as given, or received into the part's staging buffer
        part = weight_cache.PartFile(tmp_path, hashlib.sha256(b"abcdef").hexdigest(), 6)
        part.open()
        part.write(b"abc")
        if staged:
            part.stage()[:3] = b"def"

        def rest(part=part, staged=staged):
            return part.commit(3) if staged else part.write(b"def")

        with monkeypatch.context() as m:
            m.setattr(weight_cache.os, "write", full)
            with pytest.raises(WeightsError, match="No space left"):
                rest()
        assert list(tmp_path.iterdir()) == []
