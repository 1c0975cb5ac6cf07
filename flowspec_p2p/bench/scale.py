"""``flowspec bench-scale``: a model bigger than any one agent's offer, served by agents of this host that each hold
only their share (issue "A model bigger than any one device"). One run, in this order:

    model       a synthetic GGUF (model/synth.py; an 8B-shaped Q4_K_M by default), written once, reused after
    reference   ``flowspec generate --model FILE --mode ar`` (one process, the same engine): its greedy text,
                decode tokens/s and peak RSS
    fetch       the weight fetch alone (bench/scale_fetch.py): a keyed weight server process and ``--agents`` - 1
                member processes fetching their ranges at once, ``--runs`` times: MB/s in all, CPU seconds per GB
                on each side
    cluster     ``--agents`` agents (processes, loopback), each offering ``--memory-mb``: time from start to serving,
                each member's fetch (MB, MB/s), load time, peak and current RSS against the planner's count and
                against runtime + 1.15 x its layers' bytes + its KV, the peak during load against the final RSS + the
                largest tensor
    decode      greedy chats, interleaved: our cluster (ar and the default mode) and llama.cpp's RPC pipeline over
                three processes on the same file (two ``ggml-rpc-server -t 1`` + ``llama-server -t 1 --rpc``, as
                scripts/rpc_compare.sh runs them), both up at once; medians; RSS of both sides; our text against
                the reference
    resume      a member killed while it fetches its layers (at ~50% of its range), restarted: the bytes it
                fetches after the restart, as a share of its range
    no plan     every agent offering too little (``--small-mb``): the leader's /health says "no plan: short by N
                MB" and nothing loads

Writes results.json and results.md to ``--out``. Paths in them are relative to the repository (bench/paths.py).
Memory: both sides of the decode comparison are up at once only when the host has room for them (else one after
the other, and the result says so).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from ..cluster.local_cluster import ClusterOptions, LocalCluster
from ..model import synth
from ..model.weights import open_source
from .paths import portable_command, portable_path
from .rpc_compare import descendants, memory
from .scale_fetch import run_fetch
from .scale_parts import LlamaRpc, fetch_records, layer_bytes, load_records, status_mb
from .scale_report import markdown

log = logging.getLogger(__name__)

PROMPT = "Write a story about a robot who learns to paint."
RSS_FACTOR = 1.15  # a member's peak RSS bound: runtime + RSS_FACTOR x its layers' bytes + its KV
ESTIMATE_TOLERANCE = 0.10  # a stage's RSS against the planner's count
RESUME_AT = 0.5  # share of its range a member holds when it is killed
POLL_S = 0.05


@dataclass
class ScaleOptions:
    model: Path
    shape: str = "llama-3.1-8b"
    file_type: str = "Q4_K_M"
    agents: int = 3
    memory_mb: float = 2560.0
    small_mb: float = 1000.0
    context: int = 2048
    max_tokens: int = 64
    runs: int = 3
    llama_bin: Path | None = None
    out: Path = Path("docs/figures/scale")
    prompt: str = PROMPT
    parts: tuple[str, ...] = ("reference", "fetch", "cluster", "decode", "resume", "noplan")
    extra: dict = field(default_factory=dict)


def ensure_model(o: ScaleOptions) -> dict:
    """The synthetic model at ``o.model`` (written if missing). -> its description"""
    if not o.model.is_file():
        shape, label = synth.resolve_shape(o.shape, None)
        log.warning("writing the synthetic model %s (%s %s) ...", o.model, label, o.file_type)
        synth.write(o.model, shape, o.file_type, label=label)
    src = open_source(o.model)
    largest = max(len(src.raw_bytes(n)) for n in src.names())
    return {"path": portable_path(o.model), "bytes": o.model.stat().st_size, "layers": src.config.num_layers,
            "synthetic": synth.is_synthetic(src), "name": src.metadata.get("general.name"),
            "largest_tensor_bytes": largest}


def reference(o: ScaleOptions) -> dict:
    """`flowspec generate --model FILE --mode ar` in a process of its own: text, stats, peak RSS."""
    cmd = [sys.executable, "-m", "flowspec_p2p", "-q", "generate", "--model", str(o.model), "--mode", "ar",
           "--max-tokens", str(o.max_tokens), "--threads", "1", "--stats", o.prompt]
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = 0
    while p.poll() is None:  # its VmHWM, read while it runs (the process is gone once it ends)
        peak = max(peak, _hwm(p.pid))
        time.sleep(0.2)
    out, err = p.communicate()
    if p.returncode != 0:
        raise RuntimeError(f"generate failed: {err[-2000:]}")
    stats = json.loads(err.strip().splitlines()[-1])
    return {"command": portable_command(" ".join(cmd[1:])), "text": out[:-1] if out.endswith("\n") else out,
            "decode_tokens_per_s": stats["decode_tokens_per_s"], "new_tokens": stats["new_tokens"],
            "peak_rss_mb": peak / 2**20, "wall_s": round(time.perf_counter() - t0, 2)}


def _hwm(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _rss(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) bytes of ``pid``."""
    vals = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            k, v = line.split(":", 1)
            vals[k] = int(v.split()[0]) * 1024
    return vals["VmRSS"], vals["VmHWM"]


def _file_backed(pid: int) -> int:
    """Bytes of ``pid``'s resident set that are file pages (mapped model or cache files), from smaps_rollup."""
    vals = {}
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[0].endswith(":"):
                vals[parts[0][:-1]] = int(parts[1]) * 1024
    except (OSError, ValueError):
        return 0
    return max(0, vals.get("Rss", 0) - vals.get("Anonymous", 0) - vals.get("Shmem", 0))


def _get(url: str, timeout_s: float = 10.0) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def chat(url: str, prompt: str, max_tokens: int, mode: str | None) -> dict:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True, **({"decoding": mode} if mode else {})}
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=900) as r:
        out = json.loads(r.read())
    s = out["stats"]
    return {"text": out["choices"][0]["message"]["content"], "decode_tokens_per_s": s["decode_tokens_per_s"],
            "tokens": s["new_tokens"], "mode": s["mode"], "token_ids": s.get("token_ids")}


# ---------------------------------------------------------------------------------------------- the cluster


def cluster_options(o: ScaleOptions, memory_mb: float, root: Path) -> ClusterOptions:
    return ClusterOptions(model=o.model, state_root=root, context=o.context, ready_timeout_s=1800,
                          extra_args=("--memory-mb", f"{memory_mb:g}"))


def members_record(c: LocalCluster, view: dict, model_path: Path, o: ScaleOptions, largest: int) -> list[dict]:
    """Each agent: its stage (layers, the planner's count), RSS now and at peak, the targets' bounds."""
    src = open_source(model_path)
    cfg = src.config
    plan = view["plan"]
    by_agent = {s["agent_id"]: s for s in plan["stages"]}
    profiles = {m["id"]: m["profile"] for m in view["members"]}
    out = []
    for a in c.agents:
        info = a.info()
        if info is None or not a.alive:
            continue
        stage = by_agent.get(info["id"])
        rss, peak = _rss(a.pid)
        rec = {"agent": a.index, "id": info["id"], "leader": a.leader, "rss_mb": rss / 2**20, "peak_mb": peak / 2**20,
               "file_backed_mb": _file_backed(a.pid) / 2**20,
               "runtime_mb": (profiles[info["id"]].get("runtime_bytes") or 0) / 2**20}
        if stage is not None:
            layers = range(stage["layers"]["start"], stage["layers"]["end"])
            weights = layer_bytes(src, layers)
            kv = cfg.kv_bytes_per_token(4) * len(layers) * o.context * plan["kv_requests"]
            counted = stage["memory_bytes"] + stage["runtime_bytes"]
            rec.update(layers=[layers.start, layers.stop], layers_mb=weights / 2**20, kv_mb=kv / 2**20,
                       counted_mb=counted / 2**20, rss_vs_counted=rss / counted, largest_tensor_mb=largest / 2**20)
            rec["estimate_within_10pct"] = abs(rss / counted - 1) <= ESTIMATE_TOLERANCE
            if not a.leader:  # (the leader holds the embedding, LM head and tokenizer besides: no such bound)
                rec["bound_mb"] = (rec["runtime_mb"] * 2**20 + RSS_FACTOR * weights + kv) / 2**20
                rec["peak_within_bound"] = peak <= rec["bound_mb"] * 2**20
        out.append(rec)
    return out


def run_cluster(o: ScaleOptions, result: dict, root: Path) -> None:
    """Start the cluster, measure it, run the decode comparison and the resume experiment on it."""
    c = LocalCluster(o.agents, cluster_options(o, o.memory_mb, root / "cluster"))
    t0 = time.monotonic()
    try:
        c.start()
        serving_s = time.monotonic() - t0
        view = c.view()
        logs = {a.index: a.log_path for a in c.agents}
        fetches = {i: fetch_records(p) for i, p in logs.items()}
        loads = {i: load_records(p) for i, p in logs.items()}
        fetched = [f[0] for f in fetches.values() if f]
        result["startup"] = {
            "serving_s": round(serving_s, 1), "plan_text": view["plan_text"], "recovery": view["recoveries"][-1],
            "fetches": {str(i): f for i, f in fetches.items() if f}, "loads": {str(i): v for i, v in loads.items()},
            "fetch_mb_s_each": [f["mb_s"] for f in fetched],
            "fetch_mb_s_aggregate": (sum(f["mb"] for f in fetched) / max(f["s"] for f in fetched)) if fetched else None}
        largest = result["model"]["largest_tensor_bytes"]
        result["members_loaded"] = members_record(c, view, o.model, o, largest)
        if "decode" in o.parts:
            run_decode(o, c, result)
            result["members_served"] = members_record(c, c.view(), o.model, o, largest)
        if "resume" in o.parts:
            result["resume"] = resume(o, c)
    finally:
        c.stop()


def run_decode(o: ScaleOptions, c: LocalCluster, result: dict) -> None:
    urls = {"ours": c.api_url}
    llama = None
    need = 1.05 * result["model"]["bytes"]  # llama.cpp's RPC servers hold the weights once more
    together = psutil.virtual_memory().available > need + 2 * 2**30
    if o.llama_bin is not None and together:
        llama = LlamaRpc(o.llama_bin, o.model, o.context).start()
        urls["llama"] = llama.url
    samples = []
    sides = ["ours-ar", "ours-auto"] + (["llama.cpp-rpc"] if llama else [])
    try:
        for side in sides:  # warm-up
            _one(side, urls, o)
        for run in range(o.runs):
            k = run % len(sides)
            for side in sides[k:] + sides[:k]:
                samples.append({"run": run, "side": side, **_one(side, urls, o), "load1": os.getloadavg()[0]})
                log.warning("run %d %s: %.2f tok/s", run + 1, side, samples[-1]["decode_tokens_per_s"])
        mem = {"ours": memory([p for a in c.agents if a.alive for p in descendants(a.pid)])}
        if llama is not None:
            mem["llama"] = memory(llama.pids)
    finally:
        if llama is not None:
            llama.stop()
    ref = result.get("reference", {}).get("text")
    texts = {x["text"] for x in samples if x["side"].startswith("ours")}
    result["decode"] = {"sides": sides, "together": llama is not None, "memory": mem, "samples": samples,
                        "equals_reference": None if ref is None else texts == {ref},
                        "llama": None if llama is None else llama.describe(),
                        "llama_after": o.llama_bin is not None and llama is None}
    summarize_decode(result["decode"])


def llama_after(o: ScaleOptions, result: dict) -> None:
    """llama.cpp's side alone, once our cluster has stopped (the host had no room for both at once)."""
    d = result["decode"]
    llama = LlamaRpc(o.llama_bin, o.model, o.context).start()
    try:
        LlamaRpc.chat(llama.url, o.prompt, o.max_tokens)  # warm-up
        for run in range(o.runs):
            d["samples"].append({"run": run, "side": "llama.cpp-rpc",
                                 **LlamaRpc.chat(llama.url, o.prompt, o.max_tokens), "load1": os.getloadavg()[0]})
        d["memory"]["llama"] = memory(llama.pids)
        d["llama"] = llama.describe()
    finally:
        llama.stop()
    d["sides"].append("llama.cpp-rpc")
    summarize_decode(d)


def summarize_decode(d: dict) -> None:
    """Medians per side; ours against llama.cpp's: the median of the ratios within each run."""
    samples = d["samples"]
    d["decode_tokens_per_s"] = {s: statistics.median(x["decode_tokens_per_s"] for x in samples if x["side"] == s)
                                for s in d["sides"]}
    d["vs_llama"] = {}
    if "llama.cpp-rpc" in d["sides"]:
        for s in ("ours-ar", "ours-auto"):
            d["vs_llama"][s] = statistics.median(
                a["decode_tokens_per_s"] / b["decode_tokens_per_s"] for a in samples if a["side"] == s
                for b in samples if b["side"] == "llama.cpp-rpc" and b["run"] == a["run"])


def _one(side: str, urls: dict, o: ScaleOptions) -> dict:
    if side.startswith("ours"):
        mode = side.removeprefix("ours-")
        r = chat(urls["ours"], o.prompt, o.max_tokens, None if mode == "auto" else mode)
        r.pop("token_ids", None)
        return r
    return LlamaRpc.chat(urls["llama"], o.prompt, o.max_tokens)


def resume(o: ScaleOptions, c: LocalCluster) -> dict:
    """Kill the last member while it fetches its range (at RESUME_AT of it), restart it: what it fetches then."""
    victim = c.agents[-1]
    first = fetch_records(victim.log_path)
    if not first:
        return {"skipped": "the last agent fetched nothing"}
    range_mb = first[0]["range_mb"]
    folder = victim.state_dir / "tensors"
    c.kill(victim.index)
    c.wait_exit(victim.index)
    shutil.rmtree(folder, ignore_errors=True)  # a fresh device: all of its range to fetch again
    gap = _wait_no_plan(c, 120.0)  # the others alone may not hold the model
    c.restart(victim.index)
    deadline = time.monotonic() + 900
    held = 0
    while time.monotonic() < deadline:
        held = sum(p.stat().st_size for p in folder.glob("*") if p.suffix in (".bin", ".part")) if folder.is_dir() \
            else 0
        if held >= RESUME_AT * range_mb * 1e6:
            break
        time.sleep(POLL_S)
    c.kill(victim.index)
    c.wait_exit(victim.index)
    lines_before = len(fetch_records(victim.log_path))
    c.restart(victim.index)
    c.wait_ready(timeout_s=1200)
    after = fetch_records(victim.log_path)[lines_before:]
    fetched_mb = after[-1]["mb"] if after else None
    return {"range_mb": range_mb, "held_at_kill_mb": held / 1e6, "held_at_kill_share": held / (range_mb * 1e6),
            "fetched_after_restart_mb": fetched_mb,
            "fetched_after_restart_share": None if fetched_mb is None else fetched_mb / range_mb,
            "within_55pct": fetched_mb is not None and fetched_mb <= 0.55 * range_mb,
            "others_alone": gap, "same_range": bool(after) and after[-1]["layers"] == first[0]["layers"]}


def _wait_no_plan(c: LocalCluster, timeout_s: float) -> str | None:
    """The leader's /health reason while a member is gone (None if it re-planned without it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status, body = _get(c.api_url + "/health")
        if body.get("no_plan"):
            return body["no_plan"]
        if status == 200 and c.view().get("transition") is None and len(c.view()["members"]) < len(c.agents):
            return None
        time.sleep(0.2)
    return None


def no_plan(o: ScaleOptions, root: Path) -> dict:
    """Every agent offering ``o.small_mb``: the leader says how much memory is missing and loads nothing."""
    c = LocalCluster(o.agents, cluster_options(o, o.small_mb, root / "noplan"))
    t0 = time.monotonic()
    try:
        c.start(wait=False)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            info = c.agents[0].info()
            if info and info.get("api_url"):
                c.api_url = info["api_url"]
                status, body = _get(c.api_url + "/health")
                if body.get("no_plan") and len(c.view()["members"]) == o.agents:
                    loaded = [a.index for a in c.agents if "ready to serve" in a.log_path.read_text()]
                    return {"offered_mb_each": o.small_mb, "status": status, "no_plan": body["no_plan"],
                            "short_mb": status_mb(body["no_plan"]), "seconds": round(time.monotonic() - t0, 1),
                            "agents_that_loaded": loaded}
            time.sleep(0.5)
        return {"offered_mb_each": o.small_mb, "no_plan": None, "error": "no 'no plan' within 600 s"}
    finally:
        c.stop()


def run(o: ScaleOptions, command: str) -> dict:
    root = Path(tempfile.mkdtemp(prefix="flowspec-scale-"))  # the agents' state: GBs of fetched layers, removed after
    result: dict = {"setup": {"command": portable_command(command), "agents": o.agents, "memory_mb": o.memory_mb,
                              "context": o.context, "max_tokens": o.max_tokens, "runs": o.runs, "prompt": o.prompt,
                              "cpus": os.cpu_count(), "ram_gb": round(psutil.virtual_memory().total / 2**30, 1),
                              "load1_start": os.getloadavg()[0], **o.extra}}
    result["model"] = ensure_model(o)
    try:
        if "reference" in o.parts:
            result["reference"] = reference(o)
            log.warning("reference: %.2f tok/s, peak RSS %.0f MB", result["reference"]["decode_tokens_per_s"],
                        result["reference"]["peak_rss_mb"])
        if "fetch" in o.parts:
            result["fetch"] = run_fetch(o.model, o.agents, o.runs, root)
            log.warning("fetch alone: %.0f MB/s (median of %d)", result["fetch"]["median_mb_s"], o.runs)
        if "cluster" in o.parts:
            run_cluster(o, result, root)
            if result.get("decode", {}).get("llama_after"):
                llama_after(o, result)
        if "noplan" in o.parts:
            result["no_plan"] = no_plan(o, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        result["setup"]["load1_end"] = os.getloadavg()[0]
        o.out.mkdir(parents=True, exist_ok=True)
        (o.out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
        (o.out / "results.md").write_text(markdown(result))
    return result

