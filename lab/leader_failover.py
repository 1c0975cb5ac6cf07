"""The leader's failover by hand, on real processes: `python -m flowspec_p2p cluster up -n 4` (the packaged
SmolLM2-135M), a streamed chat completion through the API of a member that is neither the leader nor its standby,
and the leader killed (SIGKILL), frozen (SIGSTOP) or stopped (SIGTERM) after K streamed chunks. It waits until the
standby is ready to lead before the request (the window before that is reported apart), compares the reply with an
undisturbed one made just before, then brings the old leader back (SIGCONT, or its own command line started again)
and waits until it is a member of the new leader. One JSON line per run:

    python lab/leader_failover.py --fault kill --mode ar --sampling greedy
    python lab/leader_failover.py --fault stop --mode flowspec --sampling seeded --api ollama

loss_to_next_token_s: from the signal to the token that ends the client's longest wait after it; standby_ready_s:
from the first plan serving to the standby's "ready to lead" (the window in which a lost leader is not replaced);
back_member_s: from SIGCONT (or the restart) until the old leader is a member of the new one; stop_s: `cluster up`'s
Ctrl-C until it exited.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "term": signal.SIGTERM}


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.load(r)


def stream(url: str, body: dict, ollama: bool, on_chunk=lambda n: None) -> tuple[str, list[float], list[dict]]:
    req = urllib.request.Request(url + ("/api/chat" if ollama else "/v1/chat/completions"),
                                 data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    texts, at, errors = [], [], []
    with urllib.request.urlopen(req, timeout=300) as r:
        assert r.status == 200, r.status
        for raw in r:
            line = raw.decode().strip()
            if ollama and line:
                obj = json.loads(line)
                text = (obj.get("message") or {}).get("content") or ""
            elif line.startswith("data: ") and line != "data: [DONE]":
                obj = json.loads(line[6:])
                text = ((obj.get("choices") or [{}])[0].get("delta") or {}).get("content") or ""
            else:
                continue
            if "error" in obj:
                errors.append(obj)
            texts.append(text)
            at.append(time.monotonic())
            on_chunk(len(at))
    return "".join(texts), at, errors


def line_time(log: Path, pattern: str) -> float | None:
    """The HH:MM:SS of the first log line with ``pattern``, as seconds of the day."""
    for line in log.read_text(errors="replace").splitlines():
        if pattern in line:
            h, m, s = line[:8].split(":")
            return int(h) * 3600 + int(m) * 60 + int(s)
    return None


def run(args: argparse.Namespace, root: Path) -> dict:
    ollama = args.api == "ollama"
    messages = [{"role": "user", "content": "Tell me a short story about a lighthouse keeper."}]
    if ollama:
        options = {"num_predict": args.tokens, "temperature": 0} if args.sampling == "greedy" else \
            {"num_predict": args.tokens, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "seed": 7}
        body = {"messages": messages, "stream": True, "decoding": args.mode, "options": options}
    else:
        sampling = {"temperature": 0} if args.sampling == "greedy" else {"temperature": 1.0, "seed": 7}
        body = {"messages": messages, "max_tokens": args.tokens, "stream": True, "decoding": args.mode, **sampling}
    up = subprocess.Popen([sys.executable, "-m", "flowspec_p2p", "cluster", "up", "-n", "4", "--api-port", "0",
                           "--state-dir", str(root)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    back = None
    try:
        api = re.search(r"serving at (\S+)", up.stdout.readline()).group(1)
        while not (view := get(api + "/cluster")).get("standby") or view.get("transition") or view.get("pending"):
            time.sleep(0.5)
        lead, standby = view["members"][0], view["standby"]
        via = next(m for m in view["members"][1:] if m["id"] != standby)
        argv = Path(f"/proc/{lead['pid']}/cmdline").read_text().split("\0")[:-1]
        env = dict(kv.split("=", 1) for kv in Path(f"/proc/{lead['pid']}/environ").read_text().split("\0") if "=" in kv)
        standby_log = next(root / f"{p.parent.name}.log" for p in root.glob("agent*/agent_id")
                           if p.read_text().strip() == standby)
        while (ready := line_time(standby_log, "standby: ready to lead")) is None:
            time.sleep(0.5)
        serving = line_time(root / "agent0.log", "epoch 1 serving")
        reference, _, _ = stream(via["api_url"], body, ollama)
        lost: dict[str, float] = {}

        def fault(n: int) -> None:
            if n == args.after and not lost:
                lost["t"] = time.monotonic()
                os.kill(lead["pid"], SIGNALS[args.fault])

        text, at, errors = stream(via["api_url"], body, ollama, fault)
        points = [lost["t"], *(t for t in at if t > lost["t"])]
        waits = [b - a for a, b in itertools.pairwise(points)]
        gap = points[waits.index(max(waits)) + 1] - lost["t"] if waits else 0.0
        new = get(via["api_url"] + "/cluster")
        t0 = time.monotonic()
        if args.fault == "stop":
            os.kill(lead["pid"], signal.SIGCONT)
        else:
            time.sleep(1.0)  # the old process is gone
            back = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        back_s = None
        while time.monotonic() - t0 < 90 and back_s is None:
            roles = {m["id"]: m["role"] for m in get(via["api_url"] + "/cluster")["members"]}
            back_s = round(time.monotonic() - t0, 1) if roles.get(lead["id"]) == "member" else None
            time.sleep(0.5)
        return {"fault": args.fault, "mode": args.mode, "sampling": args.sampling, "api": args.api,
                "same_text": text == reference, "errors": errors, "loss_to_next_token_s": round(gap, 2),
                "standby_ready_s": None if ready is None or serving is None else ready - serving,
                "takeover": [r["trigger"] for r in new["recoveries"]][:1], "back_member_s": back_s}
    finally:
        t1 = time.monotonic()
        up.send_signal(signal.SIGINT)
        up.wait(120)
        if back is not None:
            back.send_signal(signal.SIGTERM)
            back.wait(30)
        sys.stdout.write(f"# cluster up stopped in {time.monotonic() - t1:.1f} s\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fault", choices=sorted(SIGNALS), default="kill")
    p.add_argument("--mode", choices=("ar", "flowspec"), default="ar")
    p.add_argument("--sampling", choices=("greedy", "seeded"), default="greedy")
    p.add_argument("--api", choices=("openai", "ollama"), default="openai")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--after", type=int, default=8, help="streamed chunks before the fault")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="failover-") as tmp:
        result = run(args, Path(tmp))
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
