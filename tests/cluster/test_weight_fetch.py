"""Fetching weights at GB scale, on a small synthetic model: streamed to the cache while hashed, resumed with a range
request where an interrupted fetch stopped, durable (fsync of file and folder), digests checked before they name a
file, the server sending from its mapped file a chunk at a time, and the fetched files packed in place."""

import asyncio
import json
import os

import aiohttp
import pytest
import torch
from aiohttp import web

from flowspec_p2p.cluster import weight_cache, weight_server
from flowspec_p2p.cluster.control import RingNode
from flowspec_p2p.cluster.stage_host import build_shard
from flowspec_p2p.cluster.weight_server import WeightServer, fetch_range, stage_fingerprint
from flowspec_p2p.errors import PeerGone, WeightsError
from flowspec_p2p.model.load import get_engine
from flowspec_p2p.model.weights import EMBED, open_source
from flowspec_p2p.types import LayerRange

from .test_weight_server import serve

FIRST = LayerRange(start=0, end=2)


@pytest.fixture
async def synth_server(synth_model):
    source = open_source(synth_model)
    ws = WeightServer(source)
    seen: list[tuple[str, str | None]] = []  # (tensor, Range header) of every tensor request
    cut: dict[str, int] = {}  # tensor -> bytes to send before the connection drops (once)

    async def tensor(request):
        name = request.match_info["name"]
        seen.append((name, request.headers.get("Range")))
        if name not in cut:
            return await ws._tensor(request)
        n = cut.pop(name)
        data = source.raw_bytes(name)
        resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        resp.content_length = len(data)
        await resp.prepare(request)
        await resp.write(bytes(data[:n]))
        request.transport.close()  # the member's link (or the leader) went away mid-tensor
        return resp

    app = web.Application()
    app.router.add_get(weight_server.MANIFEST_PATH, ws._manifest)
    app.router.add_get(weight_server.TENSOR_PATH, tensor)
    runner, url = await serve(app)
    yield source, ws, url, seen, cut
    await runner.cleanup()


async def test_an_interrupted_fetch_resumes_where_it_stopped_with_a_range_request(synth_server, tmp_path):
    source, ws, url, seen, cut = synth_server
    size = len(source.raw_bytes(EMBED))
    cut[EMBED] = size // 2
    digests = {ws.digest(n): len(source.raw_bytes(n))
               for n in weight_server.covered_names(source, FIRST, embed=True, norm=False)}
    total = sum(digests.values())  # (equal tensors share a cache file)
    async with aiohttp.ClientSession() as s:
        with pytest.raises(PeerGone, match=r"connection closed|failed after"):
            await fetch_range(s, url, FIRST, embed=True, norm=False, cache_dir=tmp_path)
        part = tmp_path / "tensors" / f"{ws.digest(EMBED)}.part"
        held = sum(p.stat().st_size for p in (tmp_path / "tensors").iterdir())
        assert part.stat().st_size == size // 2
        seen.clear()
        fetched, n = await fetch_range(s, url, FIRST, embed=True, norm=False, cache_dir=tmp_path,
                                       expected_fingerprint=stage_fingerprint(source, FIRST, embed=True, norm=False))
    assert n == total - held  # only what was missing crossed the link again
    assert (EMBED, f"bytes={size // 2}-") in seen
    assert not list((tmp_path / "tensors").glob("*.part"))
    assert torch.equal(fetched.load(EMBED), source.load(EMBED))


async def test_the_server_sends_the_rest_of_a_range_and_refuses_one_past_the_end(synth_server):
    source, _, url, _, _ = synth_server
    raw = bytes(source.raw_bytes(EMBED))
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{url}/weights/tensor/{EMBED}", headers={"Range": "bytes=1000-"}) as r:
            assert r.status == 206
            assert r.headers["Content-Range"] == f"bytes 1000-{len(raw) - 1}/{len(raw)}"
            assert await r.read() == raw[1000:]
        for bad in (f"bytes={len(raw) + 1}-", "bytes=0-10", "bytes=-5", "lines=3-"):
            async with s.get(f"{url}/weights/tensor/{EMBED}", headers={"Range": bad}) as r:
                assert r.status == 416, bad


def test_the_server_drops_each_chunks_pages_once_sent(synth_model, monkeypatch):
    source = open_source(synth_model)
    dropped: list[tuple[int, int]] = []
    monkeypatch.setattr(weight_server, "CHUNK_BYTES", 1 << 16)
    ws = WeightServer(source)
    ws._drop = lambda name, a=0, b=None: dropped.append((a, b))

    async def go():
        app = web.Application()
        ws.install(app)
        runner, url = await serve(app)
        try:
            async with aiohttp.ClientSession() as s, s.get(f"{url}/weights/tensor/{EMBED}") as r:
                return await r.read()
        finally:
            await runner.cleanup()

    import asyncio

    body = asyncio.run(go())
    assert len(body) == len(source.raw_bytes(EMBED))
    assert len(dropped) == -(-len(body) // (1 << 16))  # every chunk's pages, as it went
    assert all(b - a <= 1 << 16 for a, b in dropped)


async def test_a_manifest_digest_that_is_no_sha256_never_names_a_file(synth_model, tmp_path):
    source = open_source(synth_model)
    ws = WeightServer(source)

    async def manifest(request):
        d = json.loads((await ws._manifest(request)).body)
        d["tensors"][0]["sha256"] = "../../escaped"
        return web.json_response(d)

    app = web.Application()
    app.router.add_get(weight_server.MANIFEST_PATH, manifest)
    app.router.add_get(weight_server.TENSOR_PATH, ws._tensor)
    runner, url = await serve(app)
    try:
        async with aiohttp.ClientSession() as s:
            with pytest.raises(WeightsError, match="malformed manifest"):
                await fetch_range(s, url, FIRST, embed=True, norm=False, cache_dir=tmp_path / "state")
    finally:
        await runner.cleanup()
    assert not (tmp_path / "escaped").exists()
    with pytest.raises(WeightsError, match="not a SHA-256"):
        weight_cache.bin_path(tmp_path, "../x")


async def test_each_fetched_tensor_is_fsynced_with_its_folder_and_packs_in_place(synth_server, tmp_path,
                                                                               monkeypatch):
    source, _, url, _, _ = synth_server
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(weight_cache.os, "fsync", fsync)
    rng = LayerRange(start=2, end=4)
    async with aiohttp.ClientSession() as s:
        fetched, _ = await fetch_range(s, url, rng, embed=False, norm=True, cache_dir=tmp_path)
    folder = str(tmp_path / "tensors")
    files = {str(p) for p in (tmp_path / "tensors").glob("*.bin")}
    assert {p.replace(".part", ".bin") for p in synced if p != folder} == files  # each file before its rename
    assert synced.count(folder) == len(files)  # and the folder after it
    # the native engine packs from the mapped cache files: the same shard as from the model file
    engine = get_engine("native", torch.float32)
    node = RingNode(agent_id="a", host="h", port=1, layers=rng, embed=False, head=True,
                    fingerprint=stage_fingerprint(source, rng, embed=False, norm=True))
    remote, local = build_shard(fetched, node, engine), build_shard(source, node, engine)
    x = torch.randn(1, 3, 256)
    assert torch.equal(remote(x, remote.new_cache(8)), local(x, local.new_cache(8)))
    fetched.close()


async def test_a_keyed_fetch_reads_tls_from_the_pinned_leader_only_and_with_a_valid_session(synth_model, tmp_path):
    """The tensors' bytes travel on links of their own (weight_stream: TLS over memory BIOs): they reach a member
    that authenticated, from the identity it pinned, and a link cut mid-tensor resumes where it stopped; another
    certificate gets no token, a wrong token no bytes."""
    from flowspec_p2p.cluster.identity import Identity
    from flowspec_p2p.cluster.keys import ClusterKey
    from flowspec_p2p.cluster.net import bind
    from flowspec_p2p.cluster.security import Security
    from flowspec_p2p.cluster.weight_stream import Link, Receiver, Unauthorized
    from flowspec_p2p.errors import ProtocolError

    key = ClusterKey.generate()
    leader = Identity.load_or_create(tmp_path / "leader")
    sec = Security(leader.agent_id, key, leader)
    source = open_source(synth_model)
    ws = WeightServer(source)
    raw = bytes(source.raw_bytes(EMBED))
    cut = [len(raw) // 2]  # bytes of the embedding sent before the connection drops (once)

    async def tensor(request):
        if request.match_info["name"] != EMBED or not cut:
            return await ws._tensor(request)
        resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        resp.content_length = len(raw)
        await resp.prepare(request)
        await resp.write(raw[:cut.pop()])
        request.transport.close()  # the leader went away mid-tensor
        return resp

    app = web.Application(middlewares=sec.middlewares())
    sec.install(app)
    app.router.add_get(weight_server.MANIFEST_PATH, ws._manifest)
    app.router.add_get(weight_server.TENSOR_PATH, tensor)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        port = await bind(runner, ["127.0.0.1"], 0, sec.server_ssl(), gate=sec.gate)
        url = f"https://127.0.0.1:{port}"
        member = Identity.generate()
        async with Security(member.agent_id, key, member).client_session() as s:
            with pytest.raises(PeerGone, match=r"connection closed|failed after"):
                await fetch_range(s, url, FIRST, embed=True, norm=False, cache_dir=tmp_path / "m")
            held = sum(p.stat().st_size for p in (tmp_path / "m" / "tensors").iterdir())
            assert (tmp_path / "m" / "tensors" / f"{ws.digest(EMBED)}.part").stat().st_size == len(raw) // 2
            fetched, n = await fetch_range(s, url, FIRST, embed=True, norm=False, cache_dir=tmp_path / "m",
                                           expected_fingerprint=stage_fingerprint(source, FIRST, embed=True,
                                                                                  norm=False))
        total = sum({ws.digest(x): len(source.raw_bytes(x)) for x in fetched.names()}.values())
        assert n == total - held  # only what was missing, over TLS with a range request
        assert torch.equal(fetched.load(EMBED), source.load(EMBED))
        fetched.close()

        def link(**kw):
            return Link(**{"host": "127.0.0.1", "port": port, "tls": True, "identity": leader.fingerprint,
                           "token": "x" * 43, "connect_timeout_s": 5.0, "stall_timeout_s": 5.0, **kw})

        with pytest.raises(ProtocolError, match="presents certificate"):
            await asyncio.to_thread(link(identity="0" * 64).connect)
        part = weight_cache.PartFile(tmp_path, ws.digest(EMBED), len(source.raw_bytes(EMBED)))
        part.open()
        with pytest.raises(Unauthorized):
            await asyncio.to_thread(Receiver(link(), EMBED, part, lambda n: None).run)
        assert part.have == 0
        part.close()
    finally:
        await runner.cleanup()
