"""Load against a running cluster's API (``flowspec load``): N clients send greedy streamed requests back to back for
S seconds, client i asking prompt i mod P. Reported: status counts (503s must carry Retry-After), latency, time to
first token and inter-token latency percentiles of the 200s (measured by the clients), the aggregate generated
tokens per second, whether every 200 equals the reply its prompt got alone before the load, and the agents' RSS over
time (GET /cluster, every SAMPLE_S) with each agent's drift from the first to the last quarter of the run.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import statistics
import time
from collections import Counter
from collections.abc import Sequence

import aiohttp

log = logging.getLogger(__name__)

SAMPLE_S = 1.0  # RSS sampling interval
PROMPT = "Name three colours."


def _body(max_tokens: int, prompt: str, stream: bool = True) -> dict:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


def _reply(data: dict) -> str:
    return data["choices"][0]["message"]["content"]


async def _streamed(r: aiohttp.ClientResponse, t0: float, with_usage: bool = False):
    """An SSE reply -> (its text, completion tokens, time.monotonic() - t0 of every content delta[, its usage, with
    the reply's ``stats`` under "stats" when the last event carried them])."""
    text, tokens, times, usage = [], 0, [], {}
    stats = None
    async for raw in r.content:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        for choice in event.get("choices") or []:
            delta = (choice.get("delta") or {}).get("content")
            if delta:
                text.append(delta)
                times.append(time.monotonic() - t0)
        if event.get("usage"):
            usage = event["usage"]
            tokens = int(usage.get("completion_tokens") or 0)
        stats = event.get("stats", stats)
    if stats is not None:
        usage = {**usage, "stats": stats}
    return ("".join(text), tokens, times, usage) if with_usage else ("".join(text), tokens, times)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def rss_of(view: dict) -> dict[str, int]:
    """Agent id -> RSS bytes from a GET /cluster answer (each stage's heartbeat counters, and the leader's own)."""
    out: dict[str, int] = {}
    for s in view.get("stages") or []:
        c = s.get("counters") or {}
        if c.get("rss_bytes"):
            out[str(s.get("agent_id") or s.get("agent"))] = int(c["rss_bytes"])
    lead = view.get("leader") or {}
    if lead.get("rss_bytes"):
        out.setdefault("leader", int(lead["rss_bytes"]))
    return out


def drift(samples: list[tuple[float, dict[str, int]]]) -> dict[str, float]:
    """Per agent: mean RSS of the last quarter of the samples over that of the first quarter, minus 1."""
    if len(samples) < 4:
        return {}
    q = max(1, len(samples) // 4)
    first, last = samples[:q], samples[-q:]
    out = {}
    for agent in samples[0][1]:
        a = [s[agent] for _, s in first if agent in s]
        b = [s[agent] for _, s in last if agent in s]
        if a and b:
            out[agent] = round(statistics.mean(b) / statistics.mean(a) - 1.0, 4)
    return out


async def run_load(url: str, *, clients: int, seconds: float, max_tokens: int = 16,
                   prompts: Sequence[str] = (PROMPT,), api_key: str | None = None, sample_s: float = SAMPLE_S,
                   prompt: str | None = None) -> dict:
    """Load ``url`` (the leader's API base) -> the report (see the module docstring)."""
    prompts = [prompt] if prompt is not None else list(prompts)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = aiohttp.ClientTimeout(total=max(60.0, seconds + 600.0))
    conn = aiohttp.TCPConnector(limit=clients + 2)
    async with aiohttp.ClientSession(timeout=timeout, headers=headers, connector=conn) as session:
        references = {}
        for p in dict.fromkeys(prompts):  # each prompt alone, before the load
            async with session.post(url + "/v1/chat/completions", json=_body(max_tokens, p, stream=False)) as r:
                if r.status != 200:
                    raise RuntimeError(f"the single request before the load got {r.status}: {await r.text()}")
                references[p] = _reply(await r.json())
        statuses: Counter = Counter()
        latencies: list[float] = []
        ttfts: list[float] = []
        itls: list[float] = []
        generated = 0
        mismatched = 0
        no_retry_after = 0
        samples: list[tuple[float, dict[str, int]]] = []
        t0 = time.monotonic()
        end = t0 + seconds

        async def client(i: int) -> None:
            nonlocal mismatched, no_retry_after, generated
            p = prompts[i % len(prompts)]
            while time.monotonic() < end:
                t = time.monotonic()
                try:
                    async with session.post(url + "/v1/chat/completions", json=_body(max_tokens, p)) as r:
                        statuses[str(r.status)] += 1
                        if r.status == 200:
                            text, tokens, times = await _streamed(r, t)
                            latencies.append(time.monotonic() - t)
                            if times:
                                ttfts.append(times[0])
                                itls.extend(b - a for a, b in itertools.pairwise(times))
                            generated += tokens
                            mismatched += text != references[p]
                        else:
                            await r.read()
                            if r.status == 503:
                                no_retry_after += "Retry-After" not in r.headers
                                await asyncio.sleep(min(float(r.headers.get("Retry-After", 1)), 0.5))
                except (aiohttp.ClientError, TimeoutError, ValueError) as e:
                    statuses[f"error: {type(e).__name__}"] += 1
                    await asyncio.sleep(0.2)

        async def sampler() -> None:
            while time.monotonic() < end:
                try:
                    async with session.get(url + "/cluster") as r:
                        rss = rss_of(await r.json())
                    if rss:
                        samples.append((round(time.monotonic() - t0, 2), rss))
                except (aiohttp.ClientError, TimeoutError, ValueError) as e:
                    log.warning("load: GET /cluster failed: %s", e)
                await asyncio.sleep(sample_s)

        await asyncio.gather(sampler(), *(client(i) for i in range(clients)))
        took = time.monotonic() - t0
    ok = statuses.get("200", 0)
    pcts = (50, 90, 99)
    return {
        "clients": clients, "seconds": round(took, 2), "statuses": dict(statuses), "completed_per_s": round(
            ok / took, 3), "tokens_per_s": round(generated / took, 2), "generated_tokens": generated,
        "latency_s": {f"p{q}": _round(percentile(latencies, q)) for q in pcts},
        "ttft_s": {f"p{q}": _round(percentile(ttfts, q)) for q in pcts},
        "itl_s": {f"p{q}": _round(percentile(itls, q)) for q in pcts},
        "mismatched_200s": mismatched, "503s_without_retry_after": no_retry_after,
        "reference": references[prompts[0]], "references": references,
        "rss_samples": samples, "rss_drift": drift(samples),
    }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def render(report: dict) -> str:
    lines = [f"{report['clients']} clients for {report['seconds']} s: {report['statuses']}",
             f"completed {report['completed_per_s']} requests/s, {report['tokens_per_s']} generated tokens/s in all; "
             f"latency of the 200s {report['latency_s']}",
             f"time to first token {report['ttft_s']}; inter-token latency {report['itl_s']}",
             f"200s unlike the single-client reply: {report['mismatched_200s']}; 503s without Retry-After: "
             f"{report['503s_without_retry_after']}"]
    for agent, d in report["rss_drift"].items():
        first = report["rss_samples"][0][1].get(agent, 0)
        last = report["rss_samples"][-1][1].get(agent, 0)
        lines.append(f"RSS {agent}: {first / 2**20:.1f} MiB -> {last / 2**20:.1f} MiB (quarter-to-quarter drift "
                     f"{d * 100:+.1f}%)")
    return "\n".join(lines)


async def second_turn(url: str, *, article: str, rounds: int = 3, max_tokens: int = 64,
                      api_key: str | None = None) -> dict:
    """A chat's second turn, the prompt cache against a cold prefill: turn 1 asks about ``article`` (a long
    text); turn 2 (turn 1, its reply and a question) is then sent ``rounds`` times each cold (``cache_prompt:
    false``) and warm, interleaved, streamed. -> the medians of their client-side times to first token, the
    ratio, the prompt tokens and how many of them the warm turn took from the cache; whether the replies agree."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = aiohttp.ClientTimeout(total=1800.0)
    first = [{"role": "user", "content": f"Read this and summarise it in two sentences.\n\n{article}"}]
    async with aiohttp.ClientSession(timeout=timeout, headers=headers) as session:

        async def ask(messages: list[dict], cache: bool) -> dict:
            body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}, "cache_prompt": cache}
            t = time.monotonic()
            async with session.post(url + "/v1/chat/completions", json=body) as r:
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
                text, _, times, usage = await _streamed(r, t, with_usage=True)
            return {"text": text, "ttft": times[0] if times else None, "prompt_tokens": usage.get("prompt_tokens"),
                    "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")}

        reply = (await ask(first, True))["text"]
        second = [*first, {"role": "assistant", "content": reply},
                  {"role": "user", "content": "Which detail of it matters most, and why?"}]
        cold, warm = [await ask(second, False)], []
        for k in range(rounds):
            warm.append(await ask(second, True))
            if k:
                cold.append(await ask(second, False))
    c = statistics.median(x["ttft"] for x in cold)
    first_warm = warm[0]["ttft"]
    return {"rounds": rounds, "prompt_tokens": warm[0]["prompt_tokens"], "cached_tokens": warm[0]["cached"],
            "ttft_cold_s": round(c, 4), "ttft_second_turn_s": round(first_warm, 4),
            "ttft_warm_median_s": round(statistics.median(x["ttft"] for x in warm), 4),
            "speedup": round(c / first_warm, 2) if first_warm else None,
            "replies_agree": len({x["text"] for x in cold + warm}) == 1}
