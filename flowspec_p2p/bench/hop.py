"""Data-path benchmarks: the cost of one pipeline hop, and ar vs chunk (vs flowspec) through a loopback ring.

``hop``   encode + websocket (loopback) + decode of one Forward segment, timed from before the sender encodes to
          after the receiver's RingServer has decoded it and queued it for the stage: the overhead a hop adds on
          top of the link's own transfer time. Both ends share one event loop (one process, as a worst case: the
          sender and receiver work never overlap). Goal: < 1 ms for a 16-token float16 segment of hidden 576.
          Per transport, side by side (hops interleaved): ``ws`` (the open mode) and ``wss`` (TLS 1.3 and the
          session of a keyed cluster, as agents link by default).
``ring``  the real default model cut into N stages in one process (LoopbackRing), the leader holding only the
          embedding, final norm and LM head; every prompt runs through every mode side by side (interleaved),
          greedy; decode tokens/s per mode, medians over prompts, and speedups relative to ``ar``.

Only ratios measured in the same run mean anything (docs/TEAM.md); absolute numbers depend on the host's load.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from aiohttp import web

from ..cluster.guard import Guard
from ..cluster.identity import Identity
from ..cluster.keys import ClusterKey
from ..cluster.pinning import AuthClient
from ..decoding.ar import AR
from ..decoding.context import DecodingMode
from ..decoding.leader import Leader
from ..decoding.settings import LeaderSettings
from ..ledger import Ledger, reply_stats
from ..model.generate import ARDecoder, generate_ids
from ..model.sampling import SamplingParams
from ..pipeline import codec
from ..pipeline.emulation import ComputeEmulation, LinkEmulation
from ..pipeline.messages import PROTOCOL_VERSION, Forward
from ..pipeline.ring_server import RingServer
from ..pipeline.transport import RING_PATH, Link, RingHello

log = logging.getLogger(__name__)

HOP_GOAL_MS = 1.0
SINGLE = "single-device ar"  # the reference row of bench-ring
MODE_COLORS = {SINGLE: "#bbbbbb", "ar": "#888888", "chunk": "#4c72b0", "flowspec": "#dd8452"}
GREEDY = SamplingParams(temperature=0.0)
RING_PROMPTS = (
    "Explain why the sky is blue in two sentences.",
    "Write a short Python function that reverses a string.",
    "List three facts about the Moon.",
    "What is the capital of France, and what is it famous for?",
    "Summarize the plot of Romeo and Juliet.",
    "Give me a recipe for pancakes.",
)


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


# ---------------------------------------------------------------------------------------------------- hop


TRANSPORTS = ("ws", "wss")  # plain websockets (--insecure), and TLS with the mutual authentication of a keyed cluster


async def _endpoint(transport: str, stack: contextlib.AsyncExitStack) -> tuple[Link, asyncio.Queue]:
    """A RingServer on loopback port 0 and a Link to it, as agents open them: ``wss`` over TLS, the sender
    authenticated (guard/pinning, a fresh cluster key and identities), ``ws`` as in the open mode."""
    inbox: asyncio.Queue = asyncio.Queue()
    session, ssl_context, sender = None, None, "sender"
    if transport == "wss":
        key = ClusterKey.generate()
        server_id = Identity.load_or_create(Path(stack.enter_context(tempfile.TemporaryDirectory())))
        guard = Guard(key, server_id, "receiver")
        app = web.Application(middlewares=[guard.middleware])
        guard.install(app)
        server = RingServer("receiver", "bench", inbox=inbox, authenticated=lambda r: guard.peer_of(r).agent_id)
        client = AuthClient(key, Identity.generate())  # its id is its identity's (identity.id_of)
        sender = client.agent_id
        session = await stack.enter_async_context(client.open())
        ssl_context = server_id.server_context()
    else:
        app = web.Application()
        server = RingServer("receiver", "bench", inbox=inbox)
    server.install(app)
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    stack.push_async_callback(runner.cleanup)
    await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ssl_context).start()
    port = runner.addresses[0][1]
    link = await Link.connect(f"{transport}://127.0.0.1:{port}{RING_PATH}",
                              RingHello(protocol=PROTOCOL_VERSION, cluster="bench", epoch=0, sender=sender),
                              session=session)
    stack.push_async_callback(link.close)
    return link, inbox


async def bench_hops(tokens: int = 16, hidden: int = 576, dtype: str = "float16", iters: int = 500,
                     warmup: int = 50, transports: tuple[str, ...] = TRANSPORTS) -> list[dict]:
    """One hop over a real loopback websocket per transport, the transports' hops interleaved (so the host's load
    weighs on each alike) -> per transport {median_ms, p90_ms, encode_us, decode_us, frame_bytes, ...}."""
    act = torch.randn(tokens, hidden).to(codec.wire_dtype(dtype))  # [m, hidden] as a stage sends it
    msg = Forward(request_id="bench", seq=0, first=0, parents=[-1, *range(tokens - 1)],
                  positions=list(range(100, 100 + tokens)))
    async with contextlib.AsyncExitStack() as stack:
        ends = [await _endpoint(t, stack) for t in transports]
        hops: list[list[float]] = [[] for _ in transports]
        for i in range(warmup + iters):
            for (link, inbox), times in zip(ends, hops, strict=True):
                t0 = time.perf_counter()
                await link.send(msg, {"hidden": act})
                await inbox.get()
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
    frame = codec.encode(msg, {"hidden": act})
    enc, dec = [], []
    for _ in range(iters):
        t0 = time.perf_counter()
        codec.encode(msg, {"hidden": act})
        t1 = time.perf_counter()
        codec.decode(frame)
        enc.append(t1 - t0)
        dec.append(time.perf_counter() - t1)
    out = []
    for transport, times in zip(transports, hops, strict=True):
        med = statistics.median(times) * 1e3
        out.append({
            "transport": transport, "tokens": tokens, "hidden": hidden, "dtype": dtype, "iters": iters,
            "frame_bytes": len(frame), "median_ms": round(med, 4), "p90_ms": round(_quantile(times, 0.9) * 1e3, 4),
            "encode_us": round(statistics.median(enc) * 1e6, 1), "decode_us": round(statistics.median(dec) * 1e6, 1),
            "goal_ms": HOP_GOAL_MS, "meets_goal": med < HOP_GOAL_MS, "load_average": os.getloadavg()[0],
        })
    return out


async def bench_hop(tokens: int = 16, hidden: int = 576, dtype: str = "float16", iters: int = 500,
                    warmup: int = 50, transport: str = "ws") -> dict:
    """One hop over one transport (see bench_hops)."""
    [result] = await bench_hops(tokens, hidden, dtype, iters, warmup, (transport,))
    return result


# --------------------------------------------------------------------------------------------------- ring


def _ring_parts(stages: int, model_path: str | None):
    from ..model.load import get_engine, load_model
    from ..types import LayerRange

    lm = load_model(model_path, dtype=torch.float32)
    src, n = lm.source, lm.source.config.num_layers
    torch_engine = get_engine("torch")  # the ring's shards on the reference engine
    cuts = [round(i * n / stages) for i in range(stages + 1)]
    shards = [torch_engine.load(src, LayerRange(start=a, end=b), embed=a == 0, head=b == n)
              for a, b in itertools.pairwise(cuts)]
    for s in shards:
        s.warm_up()  # as an agent's stage does at load
    head = torch_engine.load(src, LayerRange(start=0, end=0), embed=True, head=True)
    return lm, shards, head


def _drafter(kind: str, lm, head):
    """-> (drafter or None, description)."""
    from ..speculative.drafter import HeadDrafter, OracleDrafter
    from ..speculative.head import DraftBundle, find_draft

    if kind == "oracle":
        return OracleDrafter(lm.shard), "oracle (the target drafts for itself: an upper bound on acceptance)"
    stem = find_draft(lm.fingerprint())
    if stem is not None:
        bundle = DraftBundle.load(stem)
        from ..speculative.ngram import LookupDrafter

        drafter = LookupDrafter(HeadDrafter(bundle.head, head, bundle.draft_vocab))
        return drafter, f"trained EAGLE head {stem.name} + prompt lookup"
    if kind == "head":
        from ..speculative.head import DraftHead

        torch.manual_seed(0)
        return HeadDrafter(DraftHead(lm.source.config).eval(), head), "UNTRAINED random head (no trained draft found)"
    return None, "none (no trained draft head found; chunk skipped)"


def _modes(names: list[str]) -> list[DecodingMode]:
    specs = [AR]
    if "chunk" in names:
        from ..decoding.chunk import CHUNK

        specs.append(CHUNK)
    if "flowspec" in names:
        try:
            from ..decoding.flowspec import make_flowspec
        except ImportError:
            log.warning("the flowspec mode is not available in this checkout")
        else:
            specs.append(make_flowspec())
    return specs


async def bench_ring(*, stages: int = 3, modes: tuple[str, ...] = ("ar", "chunk"), prompts: int = 4,
                     max_tokens: int = 64, wire: str = "float16", drafter: str = "auto", hops: str = "ws",
                     link: LinkEmulation | None = None, compute: ComputeEmulation | None = None,
                     model_path: str | None = None, single: bool = True) -> dict:
    from ..decoding.loopback import LoopbackRing

    link, compute = link or LinkEmulation(), compute or ComputeEmulation()
    lm, shards, head = _ring_parts(stages, model_path)
    draft, draft_desc = _drafter(drafter, lm, head)
    specs = _modes(list(modes))
    leader = Leader(head, lm.tokenizer, drafter=draft, modes=specs,
                    settings=LeaderSettings(max_context=2048, wire_dtype=wire))
    run_modes = [m for m in modes if m in leader.available_modes()]
    texts = [RING_PROMPTS[i % len(RING_PROMPTS)] for i in range(prompts)]
    names = [SINGLE, *run_modes] if single else run_modes
    per_mode: dict[str, list[dict]] = {m: [] for m in names}
    outputs: dict[str, list[list[int]]] = {m: [] for m in names}
    async with LoopbackRing(shards, leader, hops=hops, wire_dtype=codec.wire_dtype(wire), link=link,
                            compute=compute, capacity=2048) as ring:
        await _generate(leader, lm.tokenizer.chat([{"role": "user", "content": "Hi"}]), "ar", 4)  # warm-up
        for i, text in enumerate(texts):
            ids = lm.tokenizer.chat([{"role": "user", "content": text}])
            if single:  # the same model on one device, no pipeline: what the ring's overhead is measured against
                out, stats = await asyncio.to_thread(_single_device, lm.shard, ids, max_tokens)
                per_mode[SINGLE].append(reply_stats(stats))
                outputs[SINGLE].append(out)
            for mode in run_modes:
                out, stats = await _generate(leader, ids, mode, max_tokens)
                per_mode[mode].append(reply_stats(stats))
                outputs[mode].append(out)
                log.info("prompt %d/%d %-8s %3d tokens, tau %.2f, decode %.1f tok/s", i + 1, len(texts), mode,
                         stats.new_tokens, stats.tau, _decode_tps(stats))
        stage_snaps = [w.snapshot() for w in ring.workers]
    summary = {}
    for mode, rows in per_mode.items():
        tps = [r["decode_tokens_per_s"] or 0.0 for r in rows]
        summary[mode] = {
            "decode_tokens_per_s_median": round(statistics.median(tps), 2),
            "tau_mean": round(statistics.mean(r["tau"] for r in rows), 3),
            "new_tokens": sum(r["new_tokens"] for r in rows),
            "same_output_as_ar": sum(o == a for o, a in zip(outputs[mode], outputs["ar"], strict=True)),
        }
    base = summary["ar"]["decode_tokens_per_s_median"]  # speedups are relative to pipelined ar
    for s in summary.values():
        s["speedup_vs_ar"] = round(s["decode_tokens_per_s_median"] / base, 3) if base else None
    return {
        "setup": {"stages": stages, "layers": [str(s.layers) for s in shards], "wire_dtype": wire, "hops": hops,
                  "prompts": len(texts), "max_tokens": max_tokens, "temperature": 0.0, "drafter": draft_desc,
                  "emulation": f"{link.describe()}; {compute.describe()}", "torch_threads": torch.get_num_threads(),
                  "load_average": os.getloadavg()[0]},
        "modes": summary,
        "per_prompt": per_mode,
        "stages": stage_snaps,
    }


def _single_device(model, ids: list[int], max_tokens: int) -> tuple[list[int], Ledger]:
    return generate_ids(ARDecoder(model), ids, GREEDY, max_tokens)


def _decode_tps(stats: Ledger) -> float:
    return (stats.new_tokens - 1) / stats.decode_s if stats.decode_s > 0 else 0.0


async def _generate(leader: Leader, ids: list[int], mode: str, max_tokens: int) -> tuple[list[int], Ledger]:
    stats = Ledger(mode=mode)
    out: list[int] = []
    async for chunk in leader.generate(ids, params=GREEDY, max_tokens=max_tokens, mode=mode, stats=stats):
        out += chunk
    return out, stats


# ------------------------------------------------------------------------------------------------ reports


def write_hop_report(results: list[dict], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "hop.json").write_text(json.dumps(results, indent=2) + "\n")
    lines = ["| transport | tokens | hidden | dtype | frame bytes | median ms | p90 ms | encode µs | decode µs |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r.get('transport', 'ws')} | {r['tokens']} | {r['hidden']} | {r['dtype']} | {r['frame_bytes']} | "
              f"{r['median_ms']:.3f} | {r['p90_ms']:.3f} | {r['encode_us']:.0f} | {r['decode_us']:.0f} |"
              for r in results]
    (out / "hop.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no hop.png")
        return
    fig, ax = plt.subplots(figsize=(6, 3.2))
    labels = [f"{r['tokens']} tok\n{r['dtype']}\n{r.get('transport', 'ws')}" for r in results]
    x = range(len(results))
    ax.bar([i - 0.2 for i in x], [r["median_ms"] for r in results], width=0.4, label="median")
    ax.bar([i + 0.2 for i in x], [r["p90_ms"] for r in results], width=0.4, label="p90")
    ax.axhline(HOP_GOAL_MS, color="red", linestyle="--", linewidth=1, label=f"goal {HOP_GOAL_MS:g} ms")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("ms per hop")
    ax.set_title(f"encode + loopback websocket (ws; wss: TLS) + decode, hidden {results[0]['hidden']}", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "hop.png", dpi=120)
    plt.close(fig)


def write_ring_report(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "ring.json").write_text(json.dumps(result, indent=2) + "\n")
    s = result["setup"]
    lines = [f"{s['stages']}-stage loopback ring ({', '.join(s['layers'])}), wire {s['wire_dtype']}, hops "
             f"{s['hops']}, {s['prompts']} prompts x {s['max_tokens']} tokens, greedy; drafter: {s['drafter']}; "
             f"{s['emulation']}; torch threads {s['torch_threads']}", "",
             "| mode | decode tok/s (median) | speedup vs ar | tau | same output as ar |", "|---|---:|---:|---:|---:|"]
    for mode, m in result["modes"].items():
        lines.append(f"| {mode} | {m['decode_tokens_per_s_median']:.2f} | {m['speedup_vs_ar']:.2f}x | "
                     f"{m['tau_mean']:.2f} | {m['same_output_as_ar']}/{s['prompts']} |")
    (out / "ring.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no ring.png")
        return
    modes = list(result["modes"])
    fig, ax = plt.subplots(figsize=(5, 3.2))
    vals = [result["modes"][m]["decode_tokens_per_s_median"] for m in modes]
    bars = ax.bar([m.replace(" ", "\n") for m in modes], vals, color=[MODE_COLORS.get(m, "#55a868") for m in modes])
    for b, m in zip(bars, modes, strict=True):
        ax.annotate(f"{result['modes'][m]['speedup_vs_ar']:.2f}x, τ {result['modes'][m]['tau_mean']:.2f}",
                    (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("decode tokens/s (median)")
    drafter = s["drafter"].split(" (")[0]
    ax.set_title(f"{s['stages']}-stage loopback ring, {s['wire_dtype']} wire; drafter: {drafter}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "ring.png", dpi=120)
    plt.close(fig)
