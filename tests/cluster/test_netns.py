"""README's "Across real devices", exactly as written, on two hosts made of network namespaces joined by a veth pair
(addresses of a private /24 this test creates; needs root and ``ip``, else skipped with the reason): the leader's
first start prints the key line; a member given it joins over mDNS and TLS; an agent with another key on the same
LAN does not; the API answers README's curl. The real default model, as separate processes."""

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flowspec_p2p import env
from flowspec_p2p.cluster.keys import ClusterKey

pytestmark = pytest.mark.slow

START_TIMEOUT_S = 240.0


def _sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, timeout=30)


def _can_make_namespaces() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    name = f"fsprobe{secrets.token_hex(3)}"
    try:
        _sh("ip", "netns", "add", name)
        _sh("ip", "netns", "del", name)
    except (subprocess.CalledProcessError, OSError) as e:
        return f"cannot make a network namespace here: {e}"
    return None


@pytest.fixture
def hosts():
    """Two namespaces ("devices") with eth0 at 10.R.S.1 and 10.R.S.2 on one veth link -> (leader ns, member ns)."""
    why = _can_make_namespaces()
    if why:
        pytest.skip(why)
    tag = secrets.token_hex(3)
    a, b = f"fsa{tag}", f"fsb{tag}"
    net = f"10.{secrets.randbelow(200) + 20}.{secrets.randbelow(250) + 1}"
    made: list[str] = []
    try:
        for ns in (a, b):
            _sh("ip", "netns", "add", ns)
            made.append(ns)
        _sh("ip", "link", "add", f"fsva{tag}", "type", "veth", "peer", "name", f"fsvb{tag}")
        for ns, dev, ip in ((a, f"fsva{tag}", f"{net}.1"), (b, f"fsvb{tag}", f"{net}.2")):
            _sh("ip", "link", "set", dev, "netns", ns)
            run = ("ip", "netns", "exec", ns)
            _sh(*run, "ip", "link", "set", dev, "name", "eth0")  # a LAN interface, as on a device
            _sh(*run, "ip", "addr", "add", f"{ip}/24", "dev", "eth0")
            _sh(*run, "ip", "link", "set", "eth0", "up", "multicast", "on")
            _sh(*run, "ip", "link", "set", "lo", "up")
            _sh(*run, "ip", "route", "add", "default", "dev", "eth0")
    except (subprocess.CalledProcessError, OSError) as e:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        pytest.skip(f"cannot wire two network namespaces: {e}")
    yield a, b
    for ns in made:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


class Device:
    """One agent process in a namespace, with its own home (so README's default state folder is its own)."""

    def __init__(self, ns: str, home: Path, args: list[str], extra_env: dict[str, str] | None = None):
        home.mkdir(parents=True)
        self.ns, self.log = ns, home / "agent.log"
        environ = {k: v for k, v in os.environ.items() if not k.startswith("FLOWSPEC_")}
        environ.update({"HOME": str(home), env.CACHE_DIR: str(env.cache_dir()), "PYTHONUNBUFFERED": "1",
                        "PYTHONPATH": str(Path(__file__).resolve().parents[2]), **(extra_env or {})})
        with open(self.log, "wb") as f:  # `flowspec agent ...` is `python -m flowspec_p2p agent ...`
            self.popen = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "flowspec_p2p", *args],
                                          stdout=subprocess.DEVNULL, stderr=f, env=environ, start_new_session=True)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait()


def in_ns(ns: str, *cmd: str, timeout_s: float = 120) -> str:
    return subprocess.run(["ip", "netns", "exec", ns, *cmd], capture_output=True, text=True, timeout=timeout_s,
                          check=True).stdout


def wait_for(cond, timeout_s: float, what: str, devices: list[Device]):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        if any(d.popen.poll() is not None for d in devices):
            break
        time.sleep(0.5)
    logs = "\n".join(f"--- {d.ns} {d.log.parent.name}\n{d.text()[-3000:]}" for d in devices)
    raise AssertionError(f"timed out waiting for {what}:\n{logs}")


def test_readme_across_real_devices_with_the_cluster_key(hosts, tmp_path):
    lead_ns, member_ns = hosts
    leader = Device(lead_ns, tmp_path / "leader", ["agent", "--leader", "--cluster", "home", "--api-port", "8000"])
    devices = [leader]
    try:
        # not on a terminal, the key line names the key's file (the key itself goes to a terminal only), and the
        # leader's identity, which the member pins
        line = wait_for(lambda: re.search(r'export FLOWSPEC_CLUSTER_KEY="\$\(cat (\S+)\)"'
                                          r" FLOWSPEC_LEADER_IDENTITY=([0-9a-f]+)", leader.text()),
                        START_TIMEOUT_S, "the leader's key line", devices)
        stored = tmp_path / "leader/.cache/flowspec_p2p/agent/cluster.key"
        assert Path(line.group(1)) == stored
        assert stored.stat().st_mode & 0o077 == 0  # owner only
        key = stored.read_text().strip()
        assert key.startswith("fsk1-")
        assert key not in leader.text()
        member = Device(member_ns, tmp_path / "member", ["agent", "--cluster", "home"],
                        {env.CLUSTER_KEY: key, env.LEADER_IDENTITY: line.group(2)})
        stranger = Device(member_ns, tmp_path / "stranger", ["agent", "--cluster", "home"],
                          {env.CLUSTER_KEY: ClusterKey.generate().text})
        devices += [member, stranger]

        def view():
            try:
                v = json.loads(in_ns(lead_ns, "curl", "-s", "http://127.0.0.1:8000/cluster", timeout_s=10))
            except (subprocess.SubprocessError, ValueError):
                return None
            members = [m for m in v["members"] if m["role"] == "member"]
            settled = v["leader"]["ready"] and v["transition"] is None and not v["pending"] and members
            return v if settled else None

        v = wait_for(view, START_TIMEOUT_S, "the member to join and the leader to serve", devices)
        time.sleep(2.0)  # the stranger has had its chances
        v = view()
        state = ".cache/flowspec_p2p/agent/agent_id"  # README's default state folder
        member_id = (tmp_path / "member" / state).read_text().strip()
        assert [m["id"] for m in v["members"] if m["role"] == "member"] == [member_id]  # not the stranger
        assert all(m["address"].startswith("https://") for m in v["members"])
        body = json.dumps({"decoding": "ar", "max_tokens": 8, "temperature": 0,
                           "messages": [{"role": "user", "content": "Why is the sky blue?"}]})
        reply = json.loads(in_ns(lead_ns, "curl", "-s", "http://127.0.0.1:8000/v1/chat/completions", "-H",
                                 "Content-Type: application/json", "-d", body))
        assert reply["choices"][0]["message"]["content"], reply
        assert "does not hold this cluster's key" in stranger.text() or "unproven advert" in stranger.text()
    finally:
        for d in reversed(devices):
            d.stop()
