"""The one-command local cluster, end to end with the real default model: `flowspec cluster up -n 3` starts three
agent processes that find each other over mDNS on the loopback interface, plan, fetch their layers from the
leader and serve; greedy output equals single-device generation; a killed member is re-planned around; Ctrl-C
stops every process."""

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from flowspec_p2p.ledger import Ledger
from flowspec_p2p.model.generate import ARDecoder, stream_text
from flowspec_p2p.model.sampling import SamplingParams

pytestmark = pytest.mark.slow

QUESTION = "Name three primary colors."


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def chat(api: str, max_tokens: int = 24) -> dict:
    body = json.dumps({"messages": [{"role": "user", "content": QUESTION}], "max_tokens": max_tokens,
                       "temperature": 0, "decoding": "ar"}).encode()
    req = urllib.request.Request(api + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_for(cond, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def settled(api: str, members: int):
    def check():
        try:
            view = get(api + "/cluster")
        except OSError:
            return None
        ok = (view["leader"]["ready"] and view["transition"] is None and not view["broken"] and not view["pending"]
              and sum(m["role"] == "member" for m in view["members"]) == members)
        return view if ok else None
    return check


def test_cluster_up_serves_replans_around_a_killed_member_and_stops_cleanly(default_model, tmp_path):
    tok = default_model.tokenizer
    stats = Ledger(mode="ar")
    chunks = ARDecoder(default_model.shard)(tok.chat([{"role": "user", "content": QUESTION}]), SamplingParams(), 24,
                                            tok.stop_ids, stats)
    expected = "".join(d.text for d in stream_text(chunks, tok))

    cmd = [sys.executable, "-m", "flowspec_p2p", "cluster", "up", "-n", "3", "--api-port", "0", "--context", "512",
           "--wire-dtype", "float32", "--state-dir", str(tmp_path)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        line = proc.stdout.readline()  # "cluster '...': 3 agents, serving at http://127.0.0.1:PORT"
        m = re.search(r"serving at (http://\S+)", line)
        assert m, line + proc.stderr.read()
        api = m.group(1)
        view = wait_for(settled(api, 2), 60, "the first plan")
        pids = [mem["pid"] for mem in view["members"]]
        assert len(set(pids)) == 3
        assert all(alive(p) for p in pids)
        assert len(view["plan"]["stages"]) == 3  # three equal agents: every one holds layers
        assert chat(api)["choices"][0]["message"]["content"] == expected

        victim = next(mem for mem in view["members"] if mem["role"] == "member")
        epoch = view["epoch"]
        os.kill(victim["pid"], signal.SIGKILL)  # vanishes: no goodbye, no mDNS removal
        view = wait_for(settled(api, 1), 60, "the re-plan without the killed member")
        assert view["epoch"] > epoch
        assert victim["id"] not in [s["agent_id"] for s in view["plan"]["stages"]]
        assert chat(api)["choices"][0]["message"]["content"] == expected
        assert view["recoveries"][-1]["seconds"] < 30
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        finally:
            for p in pids:
                if alive(p):
                    os.kill(p, signal.SIGKILL)
    assert proc.returncode == 0
    assert not [p for p in pids if alive(p)]  # no orphans


@pytest.mark.parametrize(("config", "message"), [
    ('{"segmnt_cap": 6}', "segmnt_cap"),
    ('{"segment_cap": 0}', "flowspec.segment_cap"),
    ("segment_cap=6", "not JSON"),
])
def test_cluster_up_rejects_bad_flowspec_settings_with_the_reason_before_any_agent_starts(tmp_path, caplog, config,
                                                                                         message):
    from flowspec_p2p.cli import main

    state = tmp_path / "state"
    assert main(["cluster", "up", "--api-port", "0", "--state-dir", str(state), "--flowspec-config", config]) == 1
    assert message in caplog.text
    assert not state.exists()


def test_cluster_up_passes_its_flowspec_settings_to_the_leader_only(tmp_path):
    import argparse

    from flowspec_p2p.cluster.local_cluster import LocalCluster
    from flowspec_p2p.commands import cluster as cluster_cmd

    parser = argparse.ArgumentParser()
    cluster_cmd._common(parser)
    parser.add_argument("--api-port", type=int, default=0)
    args = parser.parse_args(["-n", "2", "--state-dir", str(tmp_path), "--flowspec-config", '{"segment_cap": 6}'])
    cluster = LocalCluster(args.n, cluster_cmd._options(args))
    leader, member = (a.args for a in cluster.agents)
    assert json.loads(leader[leader.index("--flowspec-config") + 1]) == {"segment_cap": 6}
    assert "--flowspec-config" not in member
