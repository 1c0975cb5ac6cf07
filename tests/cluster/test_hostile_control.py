"""Control-plane input a buggy or hostile peer may send: refused with a reason, never a crash of the leader or a
member; a manifest that keeps the bytes but changes how they are read is refused."""

import contextlib
import json

import aiohttp
import pytest
from aiohttp import web

from flowspec_p2p.cluster.control import MAX_CONTEXT, Heartbeat, Hello, PeerInfo, decode_message, encode_message
from flowspec_p2p.cluster.device import DeviceProfile
from flowspec_p2p.cluster.weight_server import WeightServer, fetch_range, tensor_from_raw
from flowspec_p2p.errors import ProtocolError, WeightsError
from flowspec_p2p.model.weights import open_source
from flowspec_p2p.types import LayerRange

from .test_weight_server import serve

PROFILE = DeviceProfile(memory_bytes=1 << 30, gflops=12.5, threads=2, link_mbps=100.0)
ME = PeerInfo(id="abc", cluster="home", role="member", host="127.0.0.1", port=4242, pid=7, profile=PROFILE)


def hello_with(**profile) -> bytes:
    d = json.loads(encode_message(Hello(peer=ME)))
    d["peer"]["profile"].update(profile)
    return json.dumps(d).encode().replace(b'"__inf__"', b"1e999")


@pytest.mark.parametrize("profile", [
    {"gflops": "__inf__"}, {"gflops": 1e-300}, {"gflops": 1e300}, {"memory_bytes": 1 << 62},
    {"link_mbps": "__inf__"}, {"latency_ms": 1e300}, {"slowdown": 1e300}, {"threads": 10**9},
])
def test_a_hello_with_a_non_finite_or_out_of_range_profile_is_refused_with_a_reason(profile):
    with pytest.raises(ProtocolError, match="malformed control message"):
        decode_message(hello_with(**profile))


def test_the_planner_takes_every_profile_a_hello_can_carry():
    """Extreme but valid profiles plan or are infeasible; none makes the planner raise anything else."""
    from flowspec_p2p.cluster.device import MAX_GFLOPS, MAX_MEMORY_BYTES, MIN_GFLOPS
    from flowspec_p2p.cluster.planner import plan
    from flowspec_p2p.errors import PlanInfeasible

    from .test_planner import dev, smol

    for g in (MIN_GFLOPS, 1.0, MAX_GFLOPS):
        for mem in (0, 1 << 20, MAX_MEMORY_BYTES):
            devices = [dev(0, 4000, 10.0, leader=True), dev(1, mem / 2**20, g)]
            with contextlib.suppress(PlanInfeasible):
                plan(devices, smol())


def test_heartbeats_and_plans_are_bounded():
    with pytest.raises(ProtocolError):
        decode_message(encode_message(Heartbeat(agent_id="a", epoch=1, state="ready")).replace(
            b'"counters":{}', b'"counters":{' + b",".join(b'"k%d":1.0' % i for i in range(300)) + b"}"))
    assert MAX_CONTEXT == 1 << 20


async def test_a_manifest_that_swaps_a_tensors_dtype_is_refused(tiny_llama, tmp_path):
    """The bytes are the leader's, but the manifest says to read them as another dtype (an f16/bf16 swap
    would load wrong weights silently): the range fingerprint covers every entry's storage info."""
    source = open_source(tiny_llama)
    server = WeightServer(source)
    evil = web.Application()

    async def manifest(request):
        resp = await server._manifest(request)
        d = json.loads(resp.body)
        for t in d["tensors"]:
            if "q_proj" in t["name"]:
                t["info"] = {**t["info"], "dtype": "F32" if t["info"].get("dtype") == "F64" else "F64"}
        return web.json_response(d)

    evil.router.add_get("/weights/manifest", manifest)
    evil.router.add_get("/weights/tensor/{name}", server._tensor)
    runner, url = await serve(evil)
    rng = LayerRange(start=0, end=1)
    try:
        async with aiohttp.ClientSession() as s:
            with pytest.raises(WeightsError, match="fingerprint mismatch"):
                await fetch_range(s, url, rng, embed=True, norm=False, cache_dir=tmp_path,
                                  expected_fingerprint=server.range_fingerprint(rng, embed=True, norm=False))
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("info", [{}, {"format": "safetensors"}, {"format": "safetensors", "dtype": "F32"},
                                  {"format": "safetensors", "dtype": "F32", "shape": "x"},
                                  {"format": "gguf", "qtype": "NOPE"}, {"format": "safetensors", "dtype": 3}])
def test_storage_info_that_does_not_describe_the_bytes_is_a_weights_error(info, tiny_llama):
    cfg = open_source(tiny_llama).config
    with pytest.raises(WeightsError):
        tensor_from_raw(cfg, "model.layers.0.self_attn.q_proj.weight", info, b"\0" * 16)


@pytest.mark.parametrize("host", ["x" * 300, "a..b", "-bad-", "exa mple", "é" * 70])
def test_a_hello_whose_host_is_no_address_is_refused(host):
    """(Found by flowspec fuzz: a 300-character host made idna raise UnicodeError in the leader's invite task,
    which ended the leader.)"""
    d = json.loads(encode_message(Hello(peer=ME)))
    d["peer"]["host"] = host
    with pytest.raises(ProtocolError, match="malformed"):
        decode_message(json.dumps(d).encode())
    for ok in ("127.0.0.1", "::1", "pi-4.local", "fe80::1"):
        assert PeerInfo.model_validate({**ME.model_dump(), "host": ok}).host == ok


async def test_posting_to_an_address_idna_refuses_is_peer_gone():
    from flowspec_p2p.cluster.net import ControlClient
    from flowspec_p2p.errors import PeerGone

    async with aiohttp.ClientSession() as s:
        with pytest.raises(PeerGone):
            await ControlClient(s).post("http://" + "x" * 300 + ":1", Hello(peer=ME))


def test_heartbeat_counters_are_finite():
    raw = encode_message(Heartbeat(agent_id="a", epoch=1, state="ready", counters={"forward_running_s": 1.0}))
    with pytest.raises(ProtocolError):
        decode_message(raw.replace(b"1.0", b"1e999"))
