"""Fuzzing a live cluster: structurally valid input with hostile fields, fed to a running stage, coordinator, member and
API over loopback, with the outcome of every input counted. ``flowspec fuzz`` runs it for minutes; the test suite
runs it for a few dozen inputs per target (tests/test_fuzz.py). Either way the run ends with a greedy request whose
reply must equal single-device decoding.

    frames()            data-plane frames: a valid prefix and JSON header (forward, prune, release, error) whose
                        fields are hostile (ids, seqs, parents, positions, node counts, dtypes, shapes, payloads)
    control_messages()  control-plane JSON: every message kind with hostile fields, and near-misses of the schema
    api_bodies()        completion and chat bodies with hostile values

Inputs are drawn by hypothesis (``draw``: a batch per call, reproducible from a seed) and replayed against the live
target by the async drivers; hypothesis does no shrinking here (an input that breaks a target is logged as it is).
Outcomes: a stage ``link_closed`` (the codec refused the frame), ``request_error`` (a StageError for that request),
``dropped_foreign`` (a frame for a request another link holds), ``applied``; control and API inputs by HTTP status.
A target that dies, or an API 500, is a failure.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from dataclasses import dataclass

import aiohttp
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from ..cluster.control import CONTROL_PATH
from ..pipeline import codec
from ..pipeline.messages import PROTOCOL_VERSION, WIRE_DTYPES
from ..pipeline.ring_server import RingServer
from ..pipeline.transport import RingHello
from ..pipeline.worker import StageWorker

log = logging.getLogger(__name__)

SETTLE_S = 2.0  # how long one frame's effect on the stage is waited for
REQUEST_IDS = ("f0", "f1", "f2", "f3")  # a few ids, so runs of frames open, grow and end request states

# ------------------------------------------------------------------------------------------------ generators

_HOSTILE_INTS = [-(2**63), -(2**31), -2, -1, 0, 1, 2, 3, 63, 64, 127, 4095, 4096, 4097, 2**20, 2**31, 2**40 + 1,
                 2**63, 10**30]
_ints = st.one_of(st.integers(-2, 40), st.sampled_from(_HOSTILE_INTS))
_rids = st.one_of(st.sampled_from(REQUEST_IDS), st.text(max_size=6), st.text(min_size=60, max_size=70),
                  st.just("x" * 70_000))


_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int64": 8, "int32": 4}


@st.composite
def _payload(draw, dtype: str, shape: tuple[int, ...]) -> bytes:
    n = _ITEMSIZE[dtype]
    for d in shape:
        n *= d
    fill = draw(st.sampled_from(["zeros", "zeros", "random", "huge", "nan", "ones"]))
    if fill == "random":
        out = draw(st.binary(min_size=n, max_size=n)) if n <= 4096 else bytes(n)
    elif fill == "huge" and dtype == "float64":
        out = bytes.fromhex("f2d6364f63db7c7e") * (n // 8)  # 1e300: beyond float32, so beyond the shard's dtype
    elif fill == "nan" and dtype in ("float32", "float64"):
        out = (b"\x00\x00\xc0\x7f" if dtype == "float32" else b"\x00" * 6 + b"\xf8\x7f") * (n // _ITEMSIZE[dtype])
    elif fill == "ones" and dtype == "int64":
        out = (1).to_bytes(8, "little") * (n // 8)
    else:
        out = bytes(n)
    return out


FORWARD_MUTATIONS = ("request_id", "seq", "first", "parents", "positions", "dead", "rows", "dtype", "shape",
                     "payload", "name", "size", "version", "extra", "stage_s", "tag", "nodes")


@st.composite
def frames(draw, hidden: int = 64, takes: str = "hidden", wire: str = "float64", max_rows: int = 24) -> bytes:
    """One data-plane frame: a valid prefix and JSON header, the message well-formed for a stage that takes
    ``takes`` ("hidden" or "tokens") on a ``wire`` link, with 0-3 of its fields made hostile."""
    kind = draw(st.sampled_from(["forward"] * 6 + ["prune"] * 2 + ["release", "error"]))
    rid = draw(st.sampled_from(REQUEST_IDS))
    seq = draw(st.integers(0, 3))
    mutations = set(draw(st.lists(st.sampled_from(FORWARD_MUTATIONS), max_size=3)))
    payload = b""
    if kind == "forward":
        m = draw(st.integers(1, max_rows))
        if "nodes" in mutations:
            m = draw(st.sampled_from([0, 200, 4097]))
        commit = draw(st.booleans())
        parents = [i - 1 for i in range(m)] if commit or draw(st.booleans()) else [
            draw(st.integers(-1, i - 1)) for i in range(m)]
        positions = list(range(m))
        msg: dict = {"kind": kind, "request_id": rid, "seq": seq, "first": 0, "parents": parents,
                     "positions": positions, "commit": commit}
        if "first" in mutations:
            msg["first"] = draw(_ints)
        if "parents" in mutations:
            msg["parents"] = draw(st.lists(_ints, min_size=m, max_size=m))
        if "positions" in mutations:
            msg["positions"] = draw(st.lists(_ints, min_size=m, max_size=m))
        if "dead" in mutations:
            msg["dead"] = draw(st.lists(_ints, max_size=6))
        if "stage_s" in mutations:
            msg["stage_s"] = draw(st.lists(st.floats(0, 10), max_size=300))
        if "tag" in mutations:
            msg["tag"] = draw(_ints)
        name = "tokens" if takes == "tokens" else "hidden"
        if "name" in mutations:
            name = draw(st.sampled_from(["hidden", "tokens", "features"]))
        dtype = "int64" if name == "tokens" else wire
        if "dtype" in mutations:
            dtype = draw(st.sampled_from(WIRE_DTYPES))
        rows = draw(st.integers(0, m + 2)) if "rows" in mutations else m
        rows = min(rows, max_rows + 2)
        shape = (rows,) if name == "tokens" else (rows, hidden)
        if "shape" in mutations:
            shape = draw(st.sampled_from([(rows,), (rows, hidden + 1), (rows, hidden, 1), (rows, 0)]))
        if name == "tokens" and dtype == "int64" and "payload" not in mutations:
            blob = b"".join(draw(st.integers(0, 95)).to_bytes(8, "little") for _ in range(rows))
        elif "payload" in mutations or dtype != wire:
            blob = draw(_payload(dtype, shape))
        else:
            blob = bytes(_ITEMSIZE[dtype] * rows * (hidden if len(shape) > 1 else 1))
        if len(blob) != _ITEMSIZE[dtype] * _numel(shape):
            blob = draw(_payload(dtype, shape))
        msg["tensors"] = [{"name": name, "dtype": dtype, "shape": list(shape)}]
        payload = blob + (draw(st.sampled_from([b"\x00", b"\x00" * 7])) if "size" in mutations else b"")
    elif kind == "prune":
        msg = {"kind": kind, "request_id": rid, "seq": seq, "accept": draw(st.integers(0, 3)),
               "keep": draw(st.lists(st.integers(0, 8), max_size=6, unique=True).map(sorted))}
        if "parents" in mutations or "dead" in mutations:
            msg["keep"] = draw(st.one_of(st.lists(_ints, max_size=12), st.just(list(range(5000)))))
        if "first" in mutations:
            msg["accept"] = draw(_ints)
    elif kind == "release":
        msg = {"kind": kind, "request_id": rid, "seq": seq}
    else:
        msg = {"kind": kind, "request_id": rid, "seq": seq, "stage": draw(_ints), "message": draw(st.text(max_size=20)),
               "reason": draw(st.sampled_from(["failed", "link_lost", "other"]))}
    if "request_id" in mutations:
        msg["request_id"] = draw(_rids)
    if "seq" in mutations:
        msg["seq"] = draw(_ints)
    if "extra" in mutations:  # a field the schema does not know, or a wrong type
        msg[draw(st.sampled_from(["extra", "seq", "request_id"]))] = draw(st.one_of(st.text(max_size=3), st.none()))
    version = draw(st.sampled_from([0, 2, 99])) if "version" in mutations else PROTOCOL_VERSION
    header = json.dumps({"v": version, "msg": msg}).encode()
    return codec.PREFIX.pack(codec.MAGIC, len(header)) + header + payload


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


_finite = st.one_of(st.floats(-1e3, 1e6), st.sampled_from([0.0, -1.0, 1e-300, 1e300]))


def _profile():
    return st.fixed_dictionaries({"memory_bytes": _ints, "gflops": _finite, "threads": _ints},
                                 optional={"link_mbps": _finite, "latency_ms": _finite, "slowdown": _finite})


def _peer(ids: list[str], cluster: str = "fuzz"):
    return st.fixed_dictionaries({
        "id": st.one_of(st.sampled_from(ids), st.text(max_size=70)), "cluster": st.sampled_from([cluster, "other", ""]),
        "role": st.sampled_from(["leader", "member", "boss"]), "host": st.sampled_from(["127.0.0.1", "::1", "x" * 300]),
        "port": _ints, "profile": _profile()},
        optional={"started": _finite, "pid": _ints, "model": st.text(max_size=4)})


def control_messages(ids: list[str], cluster: str = "fuzz"):
    """Control-plane JSON bodies (bytes). ``ids`` and ``cluster``: the target cluster's, so some messages name them
    (a hello of the right cluster joins a fake member, which the leader then finds unreachable)."""
    aid = st.one_of(st.sampled_from(ids), st.text(max_size=70))
    counters = st.dictionaries(st.sampled_from(["forwards", "errors", "forward_running_s", "forward_slowest_s", "x"]),
                               _finite, max_size=5)
    state = st.sampled_from(["idle", "loading", "loaded", "ready", "failed", "exploded"])
    body = st.one_of(
        st.fixed_dictionaries({"kind": st.just("hello"), "peer": _peer(ids, cluster)}),
        st.fixed_dictionaries({"kind": st.just("heartbeat"), "agent_id": aid, "epoch": _ints, "state": state,
                               "counters": counters}),
        st.fixed_dictionaries({"kind": st.just("status"), "agent_id": aid, "epoch": _ints, "state": state,
                               "detail": st.text(max_size=10)}),
        st.fixed_dictionaries({"kind": st.just("activate"), "epoch": _ints}),
        st.fixed_dictionaries({"kind": st.just("plan"), "cluster": st.just("fuzz"), "epoch": _ints,
                               "leader": _peer(["not-the-leader"]), "context": _ints, "ring": st.just([]),
                               "plan": st.just({}), "config": st.just({}), "model_fingerprint": st.just("")}),
        st.fixed_dictionaries({"kind": st.sampled_from(["ack", "welcome", "refused", "launch"]), "epoch": _ints}),
        st.dictionaries(st.text(max_size=5), st.one_of(st.text(max_size=5), _ints), max_size=4),
    )

    @st.composite
    def build(draw):
        d = draw(body)
        if draw(st.integers(0, 7)):
            d.setdefault("v", 1)
        raw = json.dumps(d).encode()
        return raw.replace(b"1e+300", b"1e999") if draw(st.booleans()) else raw  # inf where a float goes
    return build()


def api_bodies():
    """(path, JSON body bytes): a valid short completion or chat request with 0-3 of its fields made hostile."""
    num = st.one_of(_ints, _finite, st.text(max_size=3), st.none(), st.booleans())
    content = st.one_of(st.text(max_size=40), st.just(""), st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=10)}), max_size=2), _ints)
    message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
                                     "content": content})
    hostile = {
        "max_tokens": num, "temperature": num, "seed": num, "top_p": num, "top_k": num, "n": num,
        "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=6), num),
        "stream": st.one_of(st.booleans(), num), "logprobs": st.one_of(st.booleans(), num), "top_logprobs": num,
        "decoding": st.one_of(st.sampled_from(["ar", "chunk", "flowspec", "pipedec", "fast"]), num),
        "tools": st.just([{}]), "logit_bias": st.just({"1": 5}), "stream_options": st.one_of(num, st.just(
            {"include_usage": True})), "messages": st.one_of(st.lists(message, max_size=3), num),
        "prompt": st.one_of(st.text(max_size=40), st.lists(_ints, max_size=8), num),
    }

    @st.composite
    def build(draw):
        chat = draw(st.booleans())
        d: dict = {"max_tokens": draw(st.integers(1, 6)), "temperature": draw(st.sampled_from([0, 0, 0.7])),
                   "stream": draw(st.booleans())}
        if chat:
            d["messages"] = [{"role": "user", "content": draw(st.text(min_size=1, max_size=30))}]
        else:
            d["prompt"] = draw(st.one_of(st.text(min_size=1, max_size=30), st.lists(st.integers(0, 95), min_size=1,
                                                                                      max_size=8)))
        for field in draw(st.lists(st.sampled_from(sorted(hostile)), max_size=3, unique=True)):
            d[field] = draw(hostile[field])
        return ("/v1/chat/completions" if chat else "/v1/completions"), json.dumps(d).encode()
    return build()


def draw(strategy, n: int, seed: int) -> list:
    """``n`` inputs from ``strategy``, reproducible from ``seed`` (generation only, no shrinking)."""
    out: list = []

    @settings(max_examples=n, database=None, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))
    @hypothesis_seed(seed)
    @given(strategy)
    def collect(x):
        out.append(x)

    collect()
    return out[:n]


# ------------------------------------------------------------------------------------------------ drivers


@dataclass
class StageTarget:
    """A live stage: its /ring URL, the hello a link to it sends, and its worker and ring server (in this process,
    read for the outcome of each frame)."""

    url: str
    hello: RingHello
    worker: StageWorker
    server: RingServer


async def _open(session: aiohttp.ClientSession, t: StageTarget) -> aiohttp.ClientWebSocketResponse:
    ws = await session.ws_connect(t.url, max_msg_size=codec.MAX_FRAME_BYTES, compress=0)
    await ws.send_str(t.hello.model_dump_json())
    reply = await ws.receive(timeout=5)
    if reply.type != aiohttp.WSMsgType.TEXT:
        raise RuntimeError(f"the stage refused the fuzz link: {reply.type.name} {reply.extra}")
    return ws


def _stage_marks(t: StageTarget) -> tuple[int, int, int, int]:
    c, w = t.worker.core.counters, t.worker.counters
    return t.server.bad_frames, w["frames_in"], c.get("errors", 0), c.get("foreign", 0)


async def fuzz_stage(t: StageTarget, inputs: list[bytes]) -> Counter:
    """Send each frame over one link to the stage (a new link after each refusal) -> outcome counts."""
    counts: Counter = Counter()
    async with aiohttp.ClientSession() as session:
        ws = None
        try:
            for frame in inputs:
                if not t.worker.running:
                    counts["stage_dead"] += 1
                    break
                if ws is None or ws.closed:
                    ws = await _open(session, t)
                before = _stage_marks(t)
                await ws.send_bytes(frame)
                counts[await _settle(t, before)] += 1
                if t.server.bad_frames > before[0]:
                    await ws.close()
                    ws = None
        finally:
            if ws is not None:
                await ws.close()
    return counts


async def _settle(t: StageTarget, before: tuple[int, int, int, int]) -> str:
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline:
        bad, frames_in, errors, foreign = _stage_marks(t)
        if bad > before[0]:
            return "link_closed"
        if frames_in > before[1] and not t.worker.inbox.qsize():
            await asyncio.sleep(0.002)  # the message is being applied: let the core count it
            _, _, errors, foreign = _stage_marks(t)
            if errors > before[2]:
                return "request_error"
            if foreign > before[3]:
                return "dropped_foreign"
            return "applied"
        await asyncio.sleep(0.002)
    return "no_effect"


async def fuzz_http(url: str, inputs: list[tuple[str, bytes]], timeout_s: float = 30.0) -> Counter:
    """POST each (path, body) to ``url`` -> counts by status ("200", "400", ...; "error: ..." without a reply)."""
    counts: Counter = Counter()
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for path, body in inputs:
            try:
                async with session.post(url + path, data=body, headers={"Content-Type": "application/json"}) as r:
                    await r.read()
                    counts[str(r.status)] += 1
                    if r.status >= 500 and r.status != 503:
                        log.warning("fuzz: %s answered %d to %r", path, r.status, body[:300])
            except (aiohttp.ClientError, TimeoutError) as e:
                counts[f"error: {type(e).__name__}"] += 1
    return counts


def control_inputs(ids: list[str], n: int, seed: int, cluster: str = "fuzz") -> list[tuple[str, bytes]]:
    return [(CONTROL_PATH, b) for b in draw(control_messages(ids, cluster), n, seed)]


def report(counts: dict[str, Counter]) -> str:
    """One line per target and outcome."""
    lines = []
    for target, c in counts.items():
        total = sum(c.values())
        lines.append(f"{target}: {total} inputs")
        lines += [f"  {k:<18} {v:>7}" for k, v in sorted(c.items(), key=lambda kv: -kv[1])]
    return "\n".join(lines)
