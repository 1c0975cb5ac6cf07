"""CPU seconds per generated token, per agent process, with C clients at once: a figure that a busy shared host does
not bend (unlike tokens/s), so changes to the per-token work of the leader and the stages can be compared while other
jobs run. On a host of K cores the aggregate tokens/s of a cluster of its agents is at most K / (CPU s per token).

    python lab/cpu_per_token.py --url http://127.0.0.1:8000 --state-dir STATE --clients 1,4 --mode ar --seconds 20

STATE is the `cluster up --state-dir` folder (each agent's agent.json names its pid). Greedy streamed chat requests
of different Spec-Bench first turns, back to back per client; prints one JSON line per client count.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import aiohttp
import psutil

from flowspec_p2p.specbench import load_questions


def agent_pids(state: Path) -> dict[str, int]:
    out = {}
    for f in sorted(state.glob("*/agent.json")):
        info = json.loads(f.read_text())
        out[f"{f.parent.name}:{info.get('role', '?')}"] = int(info["pid"])
    return out


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    out = {}
    for name, pid in pids.items():
        t = psutil.Process(pid).cpu_times()
        out[name] = t.user + t.system
    return out


async def client(session, url, prompts, i, mode, max_tokens, until, counts):
    k = 0
    while time.monotonic() < until:
        body = {"messages": [{"role": "user", "content": prompts[(i + k) % len(prompts)]}], "max_tokens": max_tokens,
                "temperature": 0, "decoding": mode, "cache_prompt": False}
        async with session.post(url, json=body) as r:
            data = await r.json()
        counts["tokens"] += data["usage"]["completion_tokens"]
        counts["requests"] += 1
        k += 1


async def measure(url, pids, prompts, clients, mode, max_tokens, seconds):
    counts = {"tokens": 0, "requests": 0}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        c0, t0 = cpu_seconds(pids), time.monotonic()
        until = t0 + seconds
        await asyncio.gather(*(client(s, url + "/v1/chat/completions", prompts, i, mode, max_tokens, until, counts)
                               for i in range(clients)))
        c1, t1 = cpu_seconds(pids), time.monotonic()
    tokens = max(1, counts["tokens"])
    per = {k: round(1e3 * (c1[k] - c0[k]) / tokens, 3) for k in pids}
    return {"clients": clients, "mode": mode, "tokens": counts["tokens"], "requests": counts["requests"],
            "tokens_per_s": round(counts["tokens"] / (t1 - t0), 2), "cpu_ms_per_token": per,
            "cpu_ms_per_token_total": round(sum(per.values()), 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True)
    p.add_argument("--state-dir", type=Path, required=True)
    p.add_argument("--clients", default="1,4")
    p.add_argument("--mode", default="ar")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--seconds", type=float, default=20.0)
    args = p.parse_args()
    pids = agent_pids(args.state_dir)
    prompts = [q.turns[0] for q in load_questions(None, ["mt_bench", "alpaca", "humaneval", "gsm8k"], 30, 4)]
    for c in (int(x) for x in args.clients.split(",")):
        report = asyncio.run(measure(args.url, pids, prompts, c, args.mode, args.max_tokens, args.seconds))
        sys.stdout.write(json.dumps(report) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
