"""``flowspec cluster up``: a local cluster of N agent processes; ``flowspec cluster recovery``: the time from an
agent leaving (gracefully or killed) to the cluster serving again, and what a request in flight sees when a stage is
killed under it."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ConfigError
from . import add_engine_argument
from .activity import LogFollower

if TYPE_CHECKING:
    from ..cluster.local_cluster import ClusterOptions, LocalCluster

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cluster", help="run a local cluster of agent processes",
                       description="Agents as separate processes on this host, on the loopback interface.")
    csub = p.add_subparsers(dest="cluster_command", metavar="SUBCOMMAND", required=True)
    up = csub.add_parser("up", help="start N agents and serve the API until Ctrl-C",
                         description="Start N agents (agent 0 is the leader), wait until they have found each other "
                         "over mDNS, planned and loaded the model, print where the API is, and run until Ctrl-C "
                         "(SIGINT/SIGTERM), which stops every agent cleanly.")
    _common(up)
    up.add_argument("--api-port", type=int, default=8000,
                    help="the leader's API port; agent i serves its API on PORT + i (a member forwards to the "
                    "leader, and a reply streaming through it survives the leader's loss). Default 8000; 0 = any")
    up.add_argument("--netns", action="store_true",
                    help="each agent on a host of its own: a network namespace with its own LAN interface on a "
                    "private bridge (a 10.x.y.0/24 made for it, removed at exit; needs root and iproute2); each "
                    "agent's API answers on its LAN address, the leader's at the printed URL")
    up.set_defaults(func=run_up)
    rec = csub.add_parser("recovery", help="measure how fast the cluster serves again after an agent leaves",
                          description="Start N agents; then, RUNS times each: stop the last member gracefully, "
                          "wait until the cluster serves again, restart it (a join), kill it (SIGKILL), wait, "
                          "restart it; then kill it while a streamed greedy request is in flight (it should resume "
                          "on the new plan and give the same text as an undisturbed run), and restart it. Prints "
                          "the medians and writes them as JSON.")
    _common(rec)
    rec.add_argument("--api-port", type=int, default=0, help="leader API port (default: any)")
    rec.add_argument("--runs", type=int, default=3, help="repetitions (default 3)")
    rec.add_argument("--out", type=Path, default=None, help="write the results here (JSON)")
    rec.set_defaults(func=run_recovery)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", type=int, default=3, help="number of agents (default 3)")
    p.add_argument("--model", type=Path, default=None,
                   help="the leader's model: a path or a name (`flowspec models list`; default: packaged SmolLM2-135M)")
    p.add_argument("--members-have-model", action="store_true",
                   help="give members their own model copy (default: they fetch their layers from the leader)")
    p.add_argument("--threads", type=int, default=None, help="compute threads per agent (default: physical cores / N)")
    p.add_argument("--link-mbps", type=float, default=None, help="emulated link bandwidth per agent (Mbit/s)")
    p.add_argument("--link-latency-ms", type=float, default=None, help="emulated one-way link latency (ms)")
    p.add_argument("--slowdown", type=float, default=None, help="emulated compute slowdown per agent")
    p.add_argument("--stages", type=int, default=None, help="force exactly N layer-holding stages")
    p.add_argument("--leader-layers", choices=["auto", "always", "never"], default=None)
    p.add_argument("--context", type=int, default=None, help="KV tokens per request (default 2048)")
    p.add_argument("--wire-dtype", choices=["float16", "bfloat16", "float32"], default=None,
                   help="activations between stages (default float32: exact; float16/bfloat16 halve the bytes)")
    p.add_argument("--decoding", choices=["auto", "ar", "chunk", "pipedec", "flowspec"], default=None,
                   help="the API's decoding mode when a request names none (default: auto: per request, the mode "
                   "measured fastest on this cluster, flowspec or ar; the agents share this host's cores, so with "
                   "fewer cores than agents ar often is)")
    p.add_argument("--flowspec-config", default=None, metavar="JSON",
                   help="the leader's FlowSpec settings that differ from the defaults, as a JSON object of "
                   "FlowSpecConfig fields, e.g. '{\"segment_cap\": 6}' (see flowspec_p2p/decoding/flowspec.py)")
    add_engine_argument(p, "every agent's model engine")
    p.add_argument("--max-requests", type=int, default=None, metavar="N",
                   help="requests the leader decodes at once (default: as many as memory holds, at most 8)")
    p.add_argument("--state-dir", type=Path, default=None, help="keep agents' state and logs here (default: temp)")
    p.add_argument("--insecure", action="store_true",
                   help="an open cluster: no cluster key, plain http between agents (default: a fresh key, TLS)")


def _options(args: argparse.Namespace) -> ClusterOptions:
    from pydantic import ValidationError  # here: the agent's modules stay unimported for the other commands

    from ..cluster.local_cluster import ClusterOptions
    from ..config import json_object

    try:
        return ClusterOptions(api_port=args.api_port, model=args.model, members_have_model=args.members_have_model,
                              threads=args.threads, link_mbps=args.link_mbps, link_latency_ms=args.link_latency_ms,
                              slowdown=args.slowdown, stages=args.stages, leader_layers=args.leader_layers,
                              context=args.context, wire_dtype=args.wire_dtype, state_root=args.state_dir,
                              decoding=args.decoding, engine=args.engine, max_requests=args.max_requests,
                              insecure=args.insecure, netns=getattr(args, "netns", False),
                              flowspec=json_object(args.flowspec_config, "--flowspec-config"))
    except ValidationError as e:
        raise ConfigError(f"invalid cluster options: {e}") from None


def _wait_for_signal() -> None:
    done = threading.Event()
    previous = {s: signal.signal(s, lambda *_: done.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not done.wait(0.5):
            pass
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def run_up(args: argparse.Namespace) -> int:
    from ..cluster.local_cluster import LocalCluster

    cluster = LocalCluster(args.n, _options(args))
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGTERM,)}
    follower = None if args.quiet else LogFollower({f"agent{a.index}": a.log_path for a in cluster.agents},
                                                   sys.stderr, everything=args.verbose > 0).start()
    try:
        log.warning("starting %d agents of cluster %r (logs under %s) ...", args.n, cluster.name, cluster.root)
        cluster.start()
        view = cluster.view()
        url = cluster.api_url
        out = sys.stdout
        out.write(f"cluster {cluster.name!r}: {args.n} agents, serving at {url}\n")
        out.write((view.get("plan_text") or "") + "\n")
        others = [u for u in cluster.api_urls()[1:] if u]
        if others:
            out.write(f"  every agent serves the API (through it, a reply outlives the leader): {', '.join(others)}\n")
        out.write(f"\n  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
                  "    -d '{\"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France?\"}], "
                  "\"max_tokens\": 64, \"temperature\": 0}'\n\n"
                  f"  dashboard: {url}/   metrics: {url}/metrics   chat: flowspec chat --url {url}\n"
                  f"  {url}/cluster shows members, the plan and per-stage counters. Ctrl-C stops the cluster.\n")
        out.flush()
        if not stop.is_set():
            _wait_for_signal()
    except KeyboardInterrupt:
        pass
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        log.warning("stopping the cluster ...")
        cluster.stop()
        if follower is not None:
            follower.stop()
    return 0


# --------------------------------------------------------------------------------------------- recovery


def _serving_again(cluster: LocalCluster, after_epoch: int, members: int, timeout_s: float = 300.0) -> float:
    """Poll until the leader serves an epoch newer than ``after_epoch`` and a request completes. -> seconds"""
    t0 = time.monotonic()
    view = cluster.wait_ready(members=members, timeout_s=timeout_s)
    while (view.get("epoch") or 0) <= after_epoch:
        time.sleep(0.05)
        view = cluster.wait_ready(members=members, timeout_s=timeout_s)
    _complete(cluster.api_url)
    return time.monotonic() - t0


def _complete(api_url: str) -> None:
    body = json.dumps({"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}).encode()
    req = urllib.request.Request(api_url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        json.loads(r.read())


MID_REQUEST = {"messages": [{"role": "user", "content": "Write a short story about a lighthouse keeper."}],
               "max_tokens": 160, "temperature": 0, "stream": True}
KILL_AFTER_CHUNKS = 8  # streamed chunks before the stage is killed


def _stream(api_url: str, on_chunk=None) -> dict:
    """One streamed chat request (MID_REQUEST). ``on_chunk(n)`` is called after the n-th content chunk.
    -> {"text", "finish", "error", "gaps_s" (between consecutive chunks), "stats"}"""
    req = urllib.request.Request(api_url + "/v1/chat/completions", json.dumps(MID_REQUEST).encode(),
                                 {"Content-Type": "application/json"})
    text, gaps, out = [], [], {"finish": None, "error": None, "stats": {}}
    last = None
    with urllib.request.urlopen(req, timeout=300) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                out["error"] = event["error"].get("message")
                continue
            for choice in event.get("choices", []):
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    now = time.monotonic()
                    if last is not None:
                        gaps.append(now - last)
                    last = now
                    text.append(piece)
                    if on_chunk is not None:
                        on_chunk(len(text))
                out["finish"] = choice.get("finish_reason") or out["finish"]
            out["stats"] = event.get("stats") or out["stats"]
    return {**out, "text": "".join(text), "gaps_s": gaps}


def _killed_mid_request(cluster: LocalCluster, victim: int, reference: str) -> dict:
    """Kill ``victim`` while MID_REQUEST streams; -> what the client saw."""
    killed = []

    def kill_once(n: int) -> None:
        if n == KILL_AFTER_CHUNKS:
            cluster.kill(victim, wait=False)
            killed.append(n)

    t0 = time.monotonic()
    got = _stream(cluster.api_url, kill_once)
    if not killed:  # the reply was too short to kill under: kill it now, and say so
        cluster.kill(victim, wait=False)
    gaps = got["gaps_s"]
    return {"killed_mid_request": bool(killed), "completed": got["error"] is None and got["finish"] is not None,
            "identical": got["text"] == reference,
            "error": got["error"], "resumed": got["stats"].get("resumed", 0),
            "longest_stall_s": round(max(gaps[KILL_AFTER_CHUNKS - 1:] or [0.0]), 3),
            "median_gap_s": round(statistics.median(gaps) if gaps else 0.0, 4),
            "seconds": round(time.monotonic() - t0, 3)}


def run_recovery(args: argparse.Namespace) -> int:
    if args.n < 2:
        log.error("recovery needs at least 2 agents")
        return 2
    from ..cluster.local_cluster import LocalCluster

    cluster = LocalCluster(args.n, _options(args))
    victim = args.n - 1
    results: dict[str, list[float]] = {"graceful": [], "killed": [], "join": []}
    leader_side: dict[str, list[dict]] = {"graceful": [], "killed": [], "join": []}
    mid: list[dict] = []
    reference = ""
    try:
        cluster.start()
        _complete(cluster.api_url)
        for run in range(args.runs):
            for how in ("graceful", "killed"):
                epoch = cluster.view()["epoch"]
                t0 = time.monotonic()
                (cluster.terminate if how == "graceful" else cluster.kill)(victim, wait=False)
                _serving_again(cluster, epoch, members=args.n - 2)
                results[how].append(time.monotonic() - t0)
                leader_side[how].append(cluster.view()["recoveries"][-1])
                log.warning("run %d: %s leave -> serving again in %.2f s (leader: %s)", run + 1, how,
                            results[how][-1], leader_side[how][-1])
                cluster.wait_exit(victim)
                epoch = cluster.view()["epoch"]
                t0 = time.monotonic()
                cluster.restart(victim)
                _serving_again(cluster, epoch, members=args.n - 1)
                results["join"].append(time.monotonic() - t0)
                leader_side["join"].append(cluster.view()["recoveries"][-1])
            if run == 0:  # the undisturbed text, on the whole cluster
                reference = _stream(cluster.api_url)["text"]
            mid.append(_killed_mid_request(cluster, victim, reference))
            log.warning("run %d: killed mid-request -> %s", run + 1, mid[-1])
            cluster.wait_exit(victim)
            epoch = cluster.view()["epoch"]
            cluster.restart(victim)
            _serving_again(cluster, epoch, members=args.n - 1)
    finally:
        cluster.stop()
    summary: dict = {}
    for how, v in results.items():
        parts = {k: round(statistics.median(r[k] for r in leader_side[how]), 3)
                 for k in ("seconds", "detect_plan_s", "load_s", "switch_s")}
        summary[how] = {"median_s": round(statistics.median(v), 3), "runs_s": [round(x, 3) for x in v],
                        "leader_median": parts}
    summary["killed_mid_request"] = {
        "completed": sum(m["completed"] for m in mid), "identical": sum(m["identical"] for m in mid),
        "resumed": sum(m["resumed"] > 0 for m in mid), "runs": len(mid),
        "longest_stall_median_s": round(statistics.median(m["longest_stall_s"] for m in mid), 3) if mid else None,
        "median_gap_s": round(statistics.median(m["median_gap_s"] for m in mid), 4) if mid else None,
        "each": mid}
    summary["setup"] = {
        "agents": args.n, "runs": args.runs, "cpus": os.cpu_count(), "threads_per_agent": cluster.threads,
        "note": "median_s: from the signal (leave) or the process start (join) until a new plan epoch serves and a "
        "request completes; leader_median: the leader's own count from the trigger it saw (Bye, broken link, "
        "Hello) to serving, split into detection+planning, loading ranges, and switching the ring"}
    out = sys.stdout
    out.write(f"time to serve again after an agent leaves or joins ({args.n} agents on {os.cpu_count()} cores, "
              f"{args.runs} runs, medians)\n")
    out.write(f"  {'event':<9} {'wall':>7}   leader: {'total':>6} {'detect+plan':>11} {'load':>6} {'switch':>6}\n")
    for how in ("graceful", "killed", "join"):
        s, p = summary[how], summary[how]["leader_median"]
        out.write(f"  {how:<9} {s['median_s']:>6.2f}s   {'':8}{p['seconds']:>5.2f}s {p['detect_plan_s']:>10.2f}s "
                  f"{p['load_s']:>5.2f}s {p['switch_s']:>5.2f}s\n")
    out.write("  (join wall time includes starting the agent process: interpreter, torch import, mDNS)\n")
    m = summary["killed_mid_request"]
    out.write(f"a stage killed under a streamed greedy request ({MID_REQUEST['max_tokens']} tokens, after "
              f"{KILL_AFTER_CHUNKS} chunks): completed {m['completed']}/{m['runs']}, resumed {m['resumed']}/"
              f"{m['runs']}, text identical to an undisturbed run {m['identical']}/{m['runs']}; longest stall "
              f"{m['longest_stall_median_s']}s (median over runs) against a median gap of {m['median_gap_s']}s "
              "between chunks\n")
    if args.out is not None:
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
    return 0
