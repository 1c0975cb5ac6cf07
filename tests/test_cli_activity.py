"""Agents say what they do at the default log level: ``flowspec agent --leader`` (a subprocess on the packaged
model) logs its API and dashboard URLs, its plan and one access-log line per request, and stops cleanly; other
commands stay quiet; ``cluster up`` copies its agents' activity lines to the terminal (LogFollower)."""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from flowspec_p2p.commands.activity import ACTIVITY_LOGGERS, LogFollower, show_activity


@pytest.fixture
def restore_levels():
    before = {name: logging.getLogger(name).level for name in ACTIVITY_LOGGERS}
    yield
    for name, level in before.items():
        logging.getLogger(name).setLevel(level)


@pytest.mark.parametrize(("verbose", "quiet", "shown"), [(0, False, True), (1, False, False), (0, True, False)])
def test_activity_is_shown_at_the_default_level_only(restore_levels, verbose, quiet, shown):
    for name in ACTIVITY_LOGGERS:
        logging.getLogger(name).setLevel(logging.NOTSET)
    show_activity(argparse.Namespace(verbose=verbose, quiet=quiet))
    levels = {logging.getLogger(name).level for name in ACTIVITY_LOGGERS}
    assert levels == ({logging.INFO} if shown else {logging.NOTSET})  # -v already shows INFO; -q shows errors


def test_the_follower_copies_activity_lines_with_their_continuations_and_prefixes_the_agent(tmp_path):
    a, b = tmp_path / "a.log", tmp_path / "b.log"
    a.write_text("12:00:00 I flowspec_p2p.agent: agent x (leader) ...; API at http://h:1/v1, dashboard at "
                 "http://h:1/\n12:00:01 I flowspec_p2p.pipeline.transport: link open\n"
                 "12:00:02 I flowspec_p2p.cluster.coordinator: epoch 1: 2 stage(s)\n  stage 1 ...\n  stage 2 ...\n"
                 "12:00:03 W flowspec_p2p.pipeline.worker: dropped a frame\n12:00:04 I flowspec_p2p.api.acc")
    out = io.StringIO()
    follower = LogFollower({"agent0": a, "agent1": b}, out)
    follower.poll()
    with open(a, "a") as f:
        f.write("ess: POST /v1/completions 200 4 tokens (ar) 0.1 s\n")
    b.write_text("12:00:05 I flowspec_p2p.cluster.member: joined cluster 'home': leader x (h) at http://h:2\n")
    follower.poll()
    lines = out.getvalue().splitlines()
    assert lines == [
        "agent0 | 12:00:00 I flowspec_p2p.agent: agent x (leader) ...; API at http://h:1/v1, dashboard at http://h:1/",
        "agent0 | 12:00:02 I flowspec_p2p.cluster.coordinator: epoch 1: 2 stage(s)",
        "agent0 |   stage 1 ...", "agent0 |   stage 2 ...",
        "agent0 | 12:00:03 W flowspec_p2p.pipeline.worker: dropped a frame",
        "agent0 | 12:00:04 I flowspec_p2p.api.access: POST /v1/completions 200 4 tokens (ar) 0.1 s",
        "agent1 | 12:00:05 I flowspec_p2p.cluster.member: joined cluster 'home': leader x (h) at http://h:2",
    ]


def _lines_until(stream, pattern: str, timeout_s: float, seen: list[str]) -> re.Match:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = stream.readline()
        if not line:
            break
        seen.append(line)
        m = re.search(pattern, line)
        if m:
            return m
    raise AssertionError(f"no line matching {pattern!r} in:\n{''.join(seen)}")


@pytest.mark.slow
def test_a_leader_agent_says_where_it_serves_its_plan_and_each_request_at_the_default_level(tmp_path):
    cmd = [sys.executable, "-m", "flowspec_p2p", "agent", "--leader", "--cluster", f"t{os.getpid()}",
           "--interface", "127.0.0.1", "--api-port", "0", "--state-dir", str(tmp_path), "--context", "256",
           "--gflops", "10", "--memory-mb", "4000", "--decoding", "ar"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    seen: list[str] = []
    try:
        m = _lines_until(proc.stderr, r"API at (http://\S+)/v1, dashboard at (http://\S+)/$", 120, seen)
        api = m.group(1)
        assert m.group(2) == api
        _lines_until(proc.stderr, r"flowspec_p2p.cluster.coordinator: epoch 1: 1 stage\(s\)", 60, seen)
        _lines_until(proc.stderr, r"epoch 1 serving on 1 stage", 120, seen)
        body = json.dumps({"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}).encode()
        req = urllib.request.Request(api + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert json.loads(r.read())["usage"]["completion_tokens"] == 3
        _lines_until(proc.stderr, r"flowspec_p2p.api.access: POST /v1/completions 200 3 tokens \(ar\) \d+\.\d+ s",
                     30, seen)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 0, "".join(seen) + proc.stderr.read()
    assert not [line for line in seen if " D " in line]  # INFO, not debug
