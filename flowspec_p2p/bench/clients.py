"""``flowspec bench --clients 1,4,8``: many users at once on the emulated edge cluster (the same cluster as the
per-mode bench: N stage agents + a leader on loopback, emulated links and device slowdown).

    for each mode (default ar, flowspec, auto) and each client count C: after one round not recorded (the load
    level settles: auto's chooser learns it), ROUNDS times, C clients each send one greedy streamed request at
    once, client i asking prompt (round * C + i) mod P of P distinct Spec-Bench first turns (P = the largest C),
    the prompt cache off (``cache_prompt: false``: every round prefills cold)
      -> aggregate generated tokens/s (all replies' tokens over the round's wall time, summed over rounds), its
         ratio to one client's, time to first token and inter-token latency percentiles (client-side), and
         whether every reply equals the reply its prompt got alone (C = 1, run first)
      -> <out>/clients.json and clients.md

Emulated devices and links, as every report of this benchmark says; only ratios measured in one run mean anything.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import sys
import time
from collections import Counter
from pathlib import Path

import aiohttp

from ..errors import ConfigError
from ..specbench import load_questions
from .load import _streamed, percentile
from .paths import portable_command

log = logging.getLogger(__name__)

CLIENTS_JSON = "clients.json"
CLIENTS_MD = "clients.md"
DEFAULT_MODES = ("ar", "flowspec", "auto")
ROUNDS = 3


def _body(prompt: str, mode: str, max_tokens: int) -> dict:
    return {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "decoding": mode, "stream": True, "stream_options": {"include_usage": True}, "cache_prompt": False}


async def _one(session: aiohttp.ClientSession, url: str, prompt: str, mode: str, max_tokens: int) -> dict:
    t0 = time.monotonic()
    async with session.post(url, json=_body(prompt, mode, max_tokens)) as r:
        if r.status != 200:
            raise ConfigError(f"bench --clients: HTTP {r.status}: {(await r.text())[:300]}")
        text, tokens, times, usage = await _streamed(r, t0, with_usage=True)
    chose = ((usage.get("stats") or {}).get("auto") or {}).get("chose")  # the mode auto ran
    return {"text": text, "tokens": tokens, "times": times, "end": time.monotonic(), "chose": chose}


async def _round(url: str, prompts: list[str], mode: str, max_tokens: int, timeout_s: float) -> tuple[list, float]:
    """All ``prompts`` at once -> (their replies, wall seconds)."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=len(prompts) + 2)) as s:
        t0 = time.monotonic()
        replies = await asyncio.gather(*(_one(s, url, p, mode, max_tokens) for p in prompts))
    return replies, max(r["end"] for r in replies) - t0


def measure(api_url: str, prompts: list[str], modes: list[str], clients: list[int], max_tokens: int,
            rounds: int = ROUNDS, timeout_s: float = 1800.0) -> dict:
    """The measurement against a serving cluster's API -> {mode: {clients: figures}} (see the module docstring)."""
    url = api_url + "/v1/chat/completions"
    out: dict = {}
    for mode in modes:
        asyncio.run(_round(url, prompts[:1], mode, 8, timeout_s))  # warm-up, not recorded
        alone = {}
        for p in prompts:  # the reference reply of every prompt, one client at a time
            [r], _ = asyncio.run(_round(url, [p], mode, max_tokens, timeout_s))
            alone[p] = r["text"]
        per: dict = {}
        for c in clients:
            tokens, wall, same, n = 0, 0.0, 0, 0
            ttft, itl, chose = [], [], Counter()
            # one round not recorded: a steady load of c clients, as the recorded rounds see it (auto learns the
            # load level; its first burst would otherwise start from the one-client average)
            asyncio.run(_round(url, [prompts[(rounds * c + i) % len(prompts)] for i in range(c)], mode, max_tokens,
                               timeout_s))
            for k in range(rounds):
                asked = [prompts[(k * c + i) % len(prompts)] for i in range(c)]
                replies, took = asyncio.run(_round(url, asked, mode, max_tokens, timeout_s))
                wall += took
                for p, r in zip(asked, replies, strict=True):
                    tokens += r["tokens"]
                    same += r["text"] == alone[p]
                    n += 1
                    if r["chose"]:
                        chose[r["chose"]] += 1
                    if r["times"]:
                        ttft.append(r["times"][0])
                        itl += [b - a for a, b in itertools.pairwise(r["times"])]
            per[str(c)] = {"tokens_per_s": round(tokens / wall, 2), "tokens": tokens, "wall_s": round(wall, 3),
                           "identical": f"{same}/{n}",
                           "ttft_s": {f"p{q}": _r(percentile(ttft, q)) for q in (50, 99)},
                           "itl_s": {f"p{q}": _r(percentile(itl, q)) for q in (50, 99)},
                           **({"auto_chose": dict(chose)} if chose else {})}
            log.warning("bench --clients: %s, %d client(s): %.1f tokens/s, identical %d/%d", mode, c,
                        tokens / wall, same, n)
        base = per.get(str(min(clients)), {}).get("tokens_per_s")
        for v in per.values():
            v["vs_fewest"] = round(v["tokens_per_s"] / base, 3) if base else None
        out[mode] = per
    return out


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def run_clients(cfg, clients: list[int], rounds: int = ROUNDS) -> dict:
    """Start the emulated cluster of ``cfg`` (edge.BenchConfig), measure, write clients.json/.md -> the results."""
    from ..cluster.local_cluster import LocalCluster
    from .edge import cluster_options, default_slowdown

    if not clients or min(clients) < 1:
        raise ConfigError("--clients: positive client counts, e.g. 1,4,8")
    clients = sorted(set(clients))
    questions = load_questions(cfg.data, cfg.datasets, cfg.start, max(1, -(-max(clients) // len(cfg.datasets))), 1)
    prompts = [q.text for q in questions][: max(clients)]
    if len(prompts) < max(clients):
        raise ConfigError(f"--clients {max(clients)} needs as many prompts; the sets gave {len(prompts)}")
    slowdown = cfg.slowdown if cfg.slowdown is not None else default_slowdown(cfg.stages)
    options = cluster_options(cfg, slowdown).model_copy(update={"max_requests": max(clients)})
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    cluster = LocalCluster(cfg.stages + 1, options)
    load0 = os.getloadavg()[0]
    try:
        cluster.start()
        cluster.wait_standby()  # its background preparation is not part of what is measured
        offered = list(cluster.view()["leader"]["modes"])
        modes = [m for m in (cfg.modes or DEFAULT_MODES) if m in offered]
        figures = measure(cluster.api_url, prompts, modes, clients, cfg.max_tokens, rounds, cfg.request_timeout_s)
        auto_rates = cluster.view()["leader"].get("auto")  # what auto measured, per load bucket
    finally:
        cluster.stop()
    command = portable_command(" ".join(["flowspec", *sys.argv[1:]]))
    res = {"command": command, "emulated": True, "stages": cfg.stages, "link_mbps": cfg.link_mbps,
           "link_latency_ms": cfg.link_latency_ms, "slowdown": slowdown, "max_tokens": cfg.max_tokens,
           "rounds": rounds, "clients": clients, "prompts": len(prompts),
           "load_average": [round(load0, 2), round(os.getloadavg()[0], 2)], "modes": figures, "auto_rates": auto_rates}
    (out / CLIENTS_JSON).write_text(json.dumps(res, indent=1) + "\n")
    (out / CLIENTS_MD).write_text(markdown(res))
    return res


def markdown(res: dict) -> str:
    lines = [f"# Many clients at once on an emulated {res['stages']}-stage cluster",
             "",
             f"`{res['command']}`: links {res['link_mbps']} Mbit/s and {res['link_latency_ms']} ms, every device "
             f"{res['slowdown']}x slower (emulated on one host); greedy, {res['max_tokens']} new tokens, "
             f"{res['rounds']} rounds per client count after one not recorded, {res['prompts']} different prompts, "
             f"the prompt cache off; load average {res['load_average'][0]} -> {res['load_average'][1]}.",
             "",
             "| mode | clients | aggregate tokens/s | vs fewest clients | TTFT p50 / p99 (s) | ITL p50 / p99 (s) | "
             "replies identical to alone |",
             "|---|---:|---:|---:|---|---|---|"]
    for mode, per in res["modes"].items():
        for c, v in per.items():
            lines.append(f"| {mode} | {c} | {v['tokens_per_s']} | {v['vs_fewest']}x | {v['ttft_s']['p50']} / "
                         f"{v['ttft_s']['p99']} | {v['itl_s']['p50']} / {v['itl_s']['p99']} | {v['identical']} |")
    chose = [f"{c} client(s): " + ", ".join(f"{m} {k}" for m, k in sorted(v["auto_chose"].items()))
             for c, v in res["modes"].get("auto", {}).items() if v.get("auto_chose")]
    if chose:
        lines += ["", "auto ran " + "; ".join(chose) + "."]
    rates = res.get("auto_rates") or {}
    if rates:
        lines += ["", "auto's measured rates at the end (the pipeline's tokens/s while one mode alone was in flight):",
                  ""]
        lines += [f"- {key}: " + ", ".join(f"{m} {v.get('tokens_per_s')}" for m, v in modes.items())
                  for key, modes in rates.items()]
    return "\n".join(lines) + "\n"
