"""The client half of scripts/rpc_compare.sh (a measurement, not part of the product): the same greedy chat against our
cluster's API (ar, flowspec and the default mode, auto) and llama-server (over its RPC servers), interleaved,
medians; each server's own decode timing; then each side's total RSS over its processes (/proc: VmRSS now, VmHWM the
peak). Standard library only. Paths in the results are relative to the repository (bench/paths.py).

    python -m flowspec_p2p.bench.rpc_compare --ours URL --ours-pid PID --llama URL --llama-pids PID,PID,PID --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .paths import portable_command, portable_path

PROMPT = "Write a story about a robot who learns to paint."
MAX_TOKENS = 128
SIDES = ("ours-ar", "ours-flowspec", "ours-auto", "llama.cpp-rpc")
OURS = ("ours-ar", "ours-flowspec", "ours-auto")
PATH_KEYS = ("llama_bin", "model")  # the setup's paths (from rpc_compare.sh), recorded relative to the repository


def post(url: str, body: dict, timeout_s: float = 600.0) -> tuple[dict, float]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        out = json.loads(r.read())
    return out, time.perf_counter() - t0


def chat(side: str, urls: dict[str, str]) -> dict:
    """One request -> {decode_tokens_per_s (the server's own figure), tokens, wall_s, text}."""
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": False}
    chose = None
    if side.startswith("ours-"):
        mode = side.removeprefix("ours-")  # auto: no mode named, the leader's default
        out, wall = post(urls["ours"] + "/v1/chat/completions", body if mode == "auto" else {**body, "decoding": mode})
        tps = out["stats"]["decode_tokens_per_s"]
        chose = out["stats"].get("auto", {}).get("chose")
    else:
        out, wall = post(urls["llama"] + "/v1/chat/completions", {**body, "seed": 0, "cache_prompt": False})
        tps = out["timings"]["predicted_per_second"]
    return {"decode_tokens_per_s": tps, "tokens": out["usage"]["completion_tokens"], "wall_s": wall,
            "text": out["choices"][0]["message"]["content"], "auto_chose": chose}


CLIENT_PROMPTS = (PROMPT, "Explain how rainbows form.", "List five tips for a good night's sleep.",
                  "Describe the water cycle in detail.", "Why do cats purr?", "How does a bicycle stay upright?",
                  "What makes bread rise?", "Explain why the sea has tides.")
CLIENT_SIDES = ("ours-ar", "ours-auto", "llama.cpp-rpc")


def chat_many(side: str, urls: dict[str, str], clients: int, offset: int) -> dict:
    """``clients`` requests at once, client i asking CLIENT_PROMPTS[(offset + i) % 8] -> the aggregate generated
    tokens/s (all replies' tokens over the wall time until the last ended) and the texts."""
    prompts = [CLIENT_PROMPTS[(offset + i) % len(CLIENT_PROMPTS)] for i in range(clients)]

    def one(prompt: str) -> tuple[int, str]:
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS, "temperature": 0}
        if side.startswith("ours-"):
            mode = side.removeprefix("ours-")
            out, _ = post(urls["ours"] + "/v1/chat/completions",
                          {**body, "cache_prompt": False, **({} if mode == "auto" else {"decoding": mode})})
        else:
            out, _ = post(urls["llama"] + "/v1/chat/completions", {**body, "seed": 0, "cache_prompt": False})
        return out["usage"]["completion_tokens"], out["choices"][0]["message"]["content"]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        got = list(pool.map(one, prompts))
    wall = time.perf_counter() - t0
    return {"tokens_per_s": sum(n for n, _ in got) / wall, "tokens": sum(n for n, _ in got), "wall_s": wall,
            "texts": dict(zip(prompts, (t for _, t in got), strict=True))}


def run_clients(urls: dict[str, str], clients: int, runs: int) -> dict:
    """Interleaved runs of one client and of ``clients`` at once on every side -> medians, the scaling of each side
    and ours against llama.cpp's, within each run."""
    samples = []
    for run in range(runs):
        k = run % len(CLIENT_SIDES)
        for side in CLIENT_SIDES[k:] + CLIENT_SIDES[:k]:
            for c in (1, clients):
                s = chat_many(side, urls, c, run)
                samples.append({"run": run, "side": side, "clients": c, "load1": os.getloadavg()[0], **s})
                sys.stderr.write(f"run {run + 1}/{runs} {side} x{c}: {s['tokens_per_s']:.1f} tok/s\n")

    def med(side: str, c: int, key: str = "tokens_per_s") -> float:
        return statistics.median(x[key] for x in samples if x["side"] == side and x["clients"] == c)

    def paired(f) -> float:
        return statistics.median(f(run) for run in range(runs))

    def at(side: str, c: int, run: int) -> float:
        return next(x["tokens_per_s"] for x in samples if x["side"] == side and x["clients"] == c and x["run"] == run)

    same = {}
    for side in ("ours-ar", "ours-auto"):
        asked = {p for x in samples if x["side"] == side and x["clients"] == clients for p in x["texts"]}
        alone = {p: chat_many(side, urls, 1, CLIENT_PROMPTS.index(p))["texts"][p] for p in asked}
        same[side] = sum(t == alone[p] for x in samples if x["side"] == side and x["clients"] == clients
                         for p, t in x["texts"].items())
        same[side] = f"{same[side]}/{clients * runs}"
    return {"clients": clients, "runs": runs, "prompts": list(CLIENT_PROMPTS[:clients]),
            "tokens_per_s": {side: {"1": med(side, 1), str(clients): med(side, clients)} for side in CLIENT_SIDES},
            "scaling": {side: paired(lambda r, s=side: at(s, clients, r) / at(s, 1, r)) for side in CLIENT_SIDES},
            "vs_llama": {side: {str(c): paired(lambda r, s=side, c=c: at(s, c, r) / at("llama.cpp-rpc", c, r))
                                for c in (1, clients)} for side in ("ours-ar", "ours-auto")},
            "replies_equal_alone": same, "samples": samples}


def clients_markdown(res: dict, command: str) -> str:
    c = res["clients"]
    loads = [x["load1"] for x in res["samples"]]
    lines = [f"# {c} clients at once: the product against llama.cpp's RPC pipeline (`llama-server -np {c}`), one host",
             "", f"`{command}`", "",
             f"{c} different prompts at once (one client: the first), greedy, max_tokens {MAX_TOKENS}, prompt cache "
             f"off on both sides; {res['runs']} interleaved runs, medians of the tokens/s and of the ratios within "
             f"each run; 1-minute load average {min(loads):.1f}–{max(loads):.1f}.", "",
             f"| side | 1 client tokens/s | {c} clients tokens/s (aggregate) | {c} ÷ 1 | ÷ llama.cpp at {c} |",
             "|---|---:|---:|---:|---:|"]
    for side in CLIENT_SIDES:
        t = res["tokens_per_s"][side]
        vs = res["vs_llama"].get(side, {}).get(str(c))
        lines.append(f"| {side} | {t['1']:.1f} | {t[str(c)]:.1f} | {res['scaling'][side]:.2f}× | "
                     f"{'–' if vs is None else f'{vs:.2f}×'} |")
    lines += ["", f"Our replies among {c} equal the same prompt's reply alone: "
              + ", ".join(f"{s} {v}" for s, v in res["replies_equal_alone"].items()) + "."]
    return "\n".join(lines) + "\n"


def wait_ready(url: str, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=10) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"{url} not ready after {timeout_s:.0f} s")
        time.sleep(1.0)


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (from /proc/*/stat's parent ids)."""
    parent: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(stat.parent.name)] = int(fields[1])
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += [c for c, pp in parent.items() if pp == p]
    return out


def memory(pids: list[int]) -> dict:
    """Per process: name, VmRSS and VmHWM in MiB; the sums."""
    procs = []
    for pid in pids:
        try:
            status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                          if ":" in line)
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except OSError:
            continue
        if "VmRSS" not in status:
            continue
        kb = {k: int(status[k].split()[0]) for k in ("VmRSS", "VmHWM")}
        procs.append({"pid": pid, "cmd": portable_command(cmd)[:600], "rss_mb": kb["VmRSS"] / 1024,
                      "peak_mb": kb["VmHWM"] / 1024})
    return {"processes": procs, "rss_mb": sum(p["rss_mb"] for p in procs),
            "peak_mb": sum(p["peak_mb"] for p in procs)}


def setup_record(command: str, runs: int, extra: dict) -> dict:
    """results.json's "setup": the command, the run count, the prompt and ``extra`` (rpc_compare.sh's), with every
    path in them relative to the repository."""
    setup = {"command": portable_command(command), "runs": runs, "prompt": PROMPT, "max_tokens": MAX_TOKENS,
             "cpus": len(os.sched_getaffinity(0)), **extra}
    for key in PATH_KEYS:
        if isinstance(setup.get(key), str):
            setup[key] = portable_path(setup[key])
    return setup


def common_prefix(a: str, b: str) -> int:
    """Characters ``a`` and ``b`` share from the start."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def summarize(samples: list[dict]) -> dict:
    by = {s: [x for x in samples if x["side"] == s] for s in SIDES}
    med = {s: statistics.median(x["decode_tokens_per_s"] for x in v) for s, v in by.items() if v}
    paired = {}
    for s in OURS:
        ratios = [a["decode_tokens_per_s"] / b["decode_tokens_per_s"] for a in by[s] for b in by["llama.cpp-rpc"]
                  if a["run"] == b["run"]]
        paired[s] = statistics.median(ratios) if ratios else None
    # the default mode against the faster of ar and flowspec, within each run
    best = {x["run"]: x["decode_tokens_per_s"] for x in by["ours-ar"]}
    for x in by["ours-flowspec"]:
        best[x["run"]] = max(best.get(x["run"], 0.0), x["decode_tokens_per_s"])
    auto_vs_best = [x["decode_tokens_per_s"] / best[x["run"]] for x in by["ours-auto"] if best.get(x["run"])]
    return {"decode_tokens_per_s": med, "vs_llama": paired,
            "auto_vs_faster": statistics.median(auto_vs_best) if auto_vs_best else None,
            "auto_chose": [x["auto_chose"] for x in by["ours-auto"]],
            "tokens": {s: sorted({x["tokens"] for x in v}) for s, v in by.items()},
            "wall_s": {s: statistics.median(x["wall_s"] for x in v) for s, v in by.items() if v}}


def role(cmd: str) -> str:
    """A process's part from its command line: "agent0 (leader)", "cluster up (launcher)", "ggml-rpc-server :P"."""
    words = cmd.split()
    if "agent" in words and "--name" in words:
        name = words[words.index("--name") + 1]
        return name + (" (leader)" if "--leader" in words else "")
    if "cluster" in words and "up" in words:
        return "cluster up (launcher)"
    exe = Path(words[0]).name if words else "?"
    return exe + (f" :{words[words.index('-p') + 1]}" if "-p" in words and exe.endswith("rpc-server") else "")


def markdown(res: dict) -> str:
    s, m = res["summary"], res["memory"]
    loads = [x["load1"] for x in res["samples"]]
    lines = ["# The product against llama.cpp's RPC pipeline, one host", "", f"`{res['setup']['command']}`", "",
             f"Prompt {PROMPT!r}, chat template, greedy (T=0), max_tokens {MAX_TOKENS}; {res['setup']['runs']} "
             f"interleaved runs, medians; {res['setup']['cpus']} CPUs shared by all processes of both sides and other "
             f"work (1-minute load average {min(loads):.1f}–{max(loads):.1f} over the runs; our "
             f"agents: {res['setup'].get('threads_per_agent', '?')} thread(s) each, `cluster up`'s default; "
             "llama.cpp's: 1 each).", "",
             "| side | processes | decode tokens/s (server's own timing) | ÷ llama.cpp RPC | tokens | total RSS MiB | "
             "sum of peak RSS MiB |", "|---|---:|---:|---:|---:|---:|---:|"]
    for side in SIDES:
        mem = m["ours"] if side.startswith("ours") else m["llama"]
        ratio = s["vs_llama"].get(side)
        lines.append(f"| {side} | {len(mem['processes'])} | {s['decode_tokens_per_s'].get(side, float('nan')):.1f} "
                     f"| {'–' if ratio is None else f'{ratio:.2f}×'} | {','.join(map(str, s['tokens'][side]))} | "
                     f"{mem['rss_mb']:.0f} | {mem['peak_mb']:.0f} |")
    lines += ["", "| process | RSS MiB | peak RSS MiB |", "|---|---:|---:|"]
    for side in ("ours", "llama"):
        for proc in m[side]["processes"]:
            lines.append(f"| {role(proc['cmd'])} | {proc['rss_mb']:.0f} | {proc['peak_mb']:.0f} |")
    lines += ["", "RSS is read after the runs (/proc VmRSS; the peak: VmHWM); ours counts the `cluster up` launcher "
              "and its three agents, llama.cpp's its two ggml-rpc-servers and llama-server. Ratios are medians of "
              "the ratios within each run.", "",
              f"Greedy text equal to llama.cpp's: ar {res['text_equal']['ours-ar']}, flowspec "
              f"{res['text_equal']['ours-flowspec']} (first run; the engines round differently: the first "
              f"{res['common_prefix_chars']['ours-ar']} of llama.cpp's "
              f"{res['common_prefix_chars']['llama_text_chars']} characters agree with ar's). Our flowspec text "
              f"equal to our ar text in every run: {res['flowspec_equals_ar']}; auto's: {res['auto_equals_ar']}.", "",
              f"The default mode (auto, no mode named) against the faster of ar and flowspec in the same run: "
              f"**{s['auto_vs_faster']:.2f}×** (median); it ran {', '.join(map(str, s['auto_chose']))}. Every request "
              "teaches auto (the explicit ar and flowspec ones too), so after the warm-up it knew both modes' rates "
              "on this cluster."]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ours", required=True, help="our leader's API URL")
    p.add_argument("--ours-pid", type=int, required=True, help="the `flowspec cluster up` process")
    p.add_argument("--llama", required=True, help="llama-server's URL")
    p.add_argument("--llama-pids", required=True, help="llama-server's and the rpc servers' pids, comma-separated")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--command", default="bash scripts/rpc_compare.sh LLAMA_BIN")
    p.add_argument("--setup", default="{}", help="JSON merged into the setup record")
    p.add_argument("--clients", type=int, default=1, help="N > 1: N clients at once against one (clients.json/.md)")
    args = p.parse_args()
    urls = {"ours": args.ours, "llama": args.llama}
    for url in urls.values():
        wait_ready(url)
    if args.clients > 1:
        for side in CLIENT_SIDES:  # warm-up
            chat_many(side, urls, args.clients, 0)
        res = {"setup": setup_record(args.command, args.runs, json.loads(args.setup)),
               **run_clients(urls, args.clients, args.runs),
               "memory": {"ours": memory(descendants(args.ours_pid)),
                          "llama": memory([int(x) for x in args.llama_pids.split(",")])}}
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "clients.json").write_text(json.dumps(res, indent=2) + "\n")
        (args.out / "clients.md").write_text(clients_markdown(res, res["setup"]["command"]))
        sys.stdout.write(clients_markdown(res, res["setup"]["command"]))
        return 0
    for side in SIDES:  # warm-up: first-request costs (pages, scratch buffers) on every side
        chat(side, urls)
    samples = []
    for run in range(args.runs):
        k = run % len(SIDES)
        for side in SIDES[k:] + SIDES[:k]:
            samples.append({"run": run, "side": side, **chat(side, urls), "load1": os.getloadavg()[0]})
            sys.stderr.write(f"run {run + 1}/{args.runs} {side}: {samples[-1]['decode_tokens_per_s']:.1f} tok/s\n")
    first = {s["side"]: s["text"] for s in samples if s["run"] == 0}
    ref = first["llama.cpp-rpc"]
    same = {s: common_prefix(first[s], ref) for s in ("ours-ar", "ours-flowspec")}
    res = {"setup": setup_record(args.command, args.runs, json.loads(args.setup)),
           "summary": summarize(samples),
           "memory": {"ours": memory(descendants(args.ours_pid)),
                      "llama": memory([int(x) for x in args.llama_pids.split(",")])},
           "text_equal": {s: first[s] == ref for s in ("ours-ar", "ours-flowspec")},
           "common_prefix_chars": {**same, "llama_text_chars": len(ref)},
           "flowspec_equals_ar": all(a["text"] == f["text"] for a in samples if a["side"] == "ours-ar"
                                     for f in samples if f["side"] == "ours-flowspec" and a["run"] == f["run"]),
           "auto_equals_ar": all(a["text"] == f["text"] for a in samples if a["side"] == "ours-ar"
                                 for f in samples if f["side"] == "ours-auto" and a["run"] == f["run"]),
           "samples": samples}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(res, indent=2) + "\n")
    (args.out / "results.md").write_text(markdown(res))
    sys.stdout.write(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
