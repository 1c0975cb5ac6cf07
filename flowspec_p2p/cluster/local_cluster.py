"""N agents as separate processes on one host, finding each other over mDNS on the loopback interface.

The engine behind ``flowspec cluster up`` and the benchmarks' emulated edge clusters::

    from flowspec_p2p.cluster.local_cluster import ClusterOptions, start

    with start(4, ClusterOptions(link_mbps=100, link_latency_ms=2, slowdown=4, stages=4)) as c:
        requests.post(c.api_url + "/v1/completions", ...)
        c.view()                    # GET /cluster of the leader
        c.kill(2); c.wait_ready()   # a member vanishes; the cluster re-plans

Agent 0 is the leader (it loads the model and serves the API); the others hold no model copy and fetch their layers
from it. Every agent serves the API, agent i on ``api_port + i`` (a member forwards to the leader; ``api_urls()``).
Every agent gets ``max(1, physical cores // n)`` compute threads unless told otherwise, the same compute score
(measured once here: agents on one host share its cores, so separate micro-benchmarks would only measure who ran
first), its own state folder, and a fresh cluster key (``FLOWSPEC_CLUSTER_KEY``: strangers cannot join; every
link is TLS), unless ``insecure``. With ``netns`` every agent runs on a host of its own: a network namespace on a
private bridge (netns.py), reached over that LAN only. Children run in their own session, so Ctrl-C reaches only
this process, which stops them in order; on Linux they also die with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import aiohttp
from pydantic import Field

from .. import env
from ..config import FlowSpecOverrides
from ..env import CLUSTER_KEY, SECRET
from ..errors import FlowSpecError
from ..model.default import default_model_path
from ..types import Settings
from .control import TIMELINE_PATH
from .identity import Identity
from .keys import ClusterKey
from .netns import Netns
from .pinning import AuthClient

log = logging.getLogger(__name__)

READY_POLL_S = 0.1
STOP_TIMEOUT_S = 10.0
HTTP_TIMEOUT_S = 5.0


class ClusterOptions(Settings):
    cluster: str | None = None  # default: a fresh "local-<hex>" name, so clusters on one host never mix
    api_host: str = "127.0.0.1"
    api_port: int = Field(default=0, ge=0, le=65535)  # 0 = any free port (see LocalCluster.api_url)
    model: Path | None = None  # the leader's model (default: the packaged SmolLM2-135M)
    draft: Path | None = None  # the leader's draft head (default: the one installed for the model, if any)
    members_have_model: bool = False  # give members their own copy instead of fetching from the leader
    threads: int | None = Field(default=None, ge=1)  # compute threads per agent (default: max(1, physical cores // n))
    gflops: float | None = Field(default=None, gt=0)  # compute score of every agent (default: measured once)
    link_mbps: float | None = Field(default=None, gt=0)
    link_latency_ms: float | None = Field(default=None, ge=0)
    slowdown: float | None = Field(default=None, ge=1)
    context: int | None = Field(default=None, ge=16)
    stages: int | None = Field(default=None, ge=1)
    leader_layers: Literal["auto", "always", "never"] | None = None
    dtype: Literal["float32", "bfloat16", "float64"] | None = None
    wire_dtype: Literal["float16", "bfloat16", "float32", "float64"] | None = None
    decoding: Literal["auto", "ar", "chunk", "pipedec", "flowspec"] | None = None  # the leader's default mode
    engine: Literal["auto", "native", "torch"] | None = None  # every agent's (--engine); None: theirs to choose
    max_requests: int | None = Field(default=None, ge=1, le=16)  # the leader's --max-requests
    flowspec: FlowSpecOverrides | None = None  # the leader's FlowSpecConfig fields that differ from the defaults
    secret: str | None = None  # a passphrase the agents derive the cluster key from (default: a fresh key)
    cluster_key: str | None = None  # the cluster key's text form (default: a fresh key)
    insecure: bool = False  # the open cluster of a lab: plain http, no key (--insecure on every agent)
    state_root: Path | None = None  # default: a temporary folder, removed by stop()
    verbose: int = 1  # agents' -v count (their logs go to <state_root>/agent<i>.log)
    ready_timeout_s: float = 600.0
    extra_args: tuple[str, ...] = ()
    # each agent on a host of its own: a network namespace on a private bridge (netns.py; needs root), the leader's
    # API on its LAN address (open: the bridge is this machine's own), instead of every agent on loopback
    netns: bool = False


@dataclass
class AgentProcess:
    index: int
    leader: bool
    state_dir: Path
    log_path: Path
    args: list[str]
    popen: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return None if self.popen is None else self.popen.pid

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def info(self) -> dict | None:
        """The agent's ``agent.json`` (id, pid, url, api_url) once it runs."""
        try:
            return json.loads((self.state_dir / "agent.json").read_text())
        except (OSError, ValueError):
            return None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    """Linux: SIGTERM this child when the parent dies, so a killed parent leaves no orphans."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class LocalCluster:
    def __init__(self, n: int, options: ClusterOptions | None = None):
        if n < 1:
            raise FlowSpecError("a cluster needs at least one agent")
        self.n = n
        self.options = o = options or ClusterOptions()
        self.name = o.cluster or f"local-{secrets.token_hex(3)}"
        self.key: ClusterKey | None = None
        if not o.insecure:
            self.key = (ClusterKey.parse(o.cluster_key) if o.cluster_key else
                        ClusterKey.from_secret(o.secret, self.name) if o.secret else ClusterKey.generate())
        self._identity = Identity.generate()  # this controller's, for GET /control/timeline
        self._own_root = o.state_root is None
        self.root = Path(o.state_root or tempfile.mkdtemp(prefix="flowspec-cluster-"))
        self.root.mkdir(parents=True, exist_ok=True)
        self.threads = o.threads or max(1, env.physical_cores() // n)
        self.gflops = o.gflops
        self.net = Netns(n) if o.netns else None
        self.agents = [self._agent(i) for i in range(n)]
        self.api_url: str | None = None

    # ---------------------------------------------------------------------------------------------- processes

    def _agent(self, i: int) -> AgentProcess:
        o = self.options
        state = self.root / f"agent{i}"
        address = "127.0.0.1" if self.net is None else self.net.address(i)
        args = [sys.executable, "-m", "flowspec_p2p", *(["-" + "v" * o.verbose] if o.verbose else []), "agent",
                "--cluster", self.name, "--name", f"agent{i}", "--interface", address,
                "--state-dir", str(state), "--threads", str(self.threads)]
        flags = {"--link-mbps": o.link_mbps, "--link-latency-ms": o.link_latency_ms, "--slowdown": o.slowdown,
                 "--engine": o.engine}
        # every agent serves the API (a member forwards to the leader, and resumes a reply when the leader is lost):
        # agent i on api_port + i (any free port when api_port is 0)
        # (with netns: on the agent's own LAN address, open: the bridge is this machine's own private one)
        api_host = o.api_host if self.net is None else address
        args += ["--api-host", api_host, "--api-port", str(o.api_port + i if o.api_port else 0)]
        if self.net is not None:
            args.append("--api-insecure")
        if i == 0:
            args += ["--leader"]
            if o.model is not None:
                args += ["--model", str(o.model)]
            if o.draft is not None:
                args += ["--draft", str(o.draft)]
            flags |= {"--context": o.context, "--stages": o.stages, "--leader-layers": o.leader_layers,
                      "--wire-dtype": o.wire_dtype, "--decoding": o.decoding, "--max-requests": o.max_requests,
                      "--flowspec-config": json.dumps(o.flowspec) if o.flowspec else None}
        elif o.members_have_model:
            args += ["--model", str(o.model or default_model_path())]
        for flag, value in flags.items():
            if value is not None:
                args += [flag, str(value)]
        if o.insecure:
            args.append("--insecure")
        return AgentProcess(i, i == 0, state, self.root / f"agent{i}.log", args + list(o.extra_args))

    def agent_environment(self) -> dict[str, str]:
        """This process's environment, with the cluster's key in place of any key or secret it holds."""
        env = {k: v for k, v in os.environ.items() if k not in (CLUSTER_KEY, SECRET)}
        env["PYTHONUNBUFFERED"] = "1"
        if self.key is not None:
            env[CLUSTER_KEY] = self.key.text
        return env

    def _launch(self, a: AgentProcess) -> None:
        args = list(a.args)
        if self.gflops is not None:
            args += ["--gflops", f"{self.gflops:g}"]
        env = self.agent_environment()
        with contextlib.suppress(OSError):
            (a.state_dir / "agent.json").unlink()
        if self.net is not None:
            args = self.net.command(a.index, args)
        with open(a.log_path, "ab") as logf:
            a.popen = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=logf, stdin=subprocess.DEVNULL,
                                       env=env, start_new_session=True, preexec_fn=_die_with_parent)
        log.info("started agent%d (pid %d)%s", a.index, a.popen.pid, " as leader" if a.leader else "")

    def start(self, wait: bool = True) -> LocalCluster:
        """Start every agent and (``wait``) wait until the leader serves a plan that knows all of them."""
        if self.gflops is None:
            self.gflops = _measure_gflops(self.threads)
            log.info("compute score for every agent: %.3g GFLOP/s (%d thread(s) each)", self.gflops, self.threads)
        try:
            if self.net is not None:
                self.net.up()
            for a in self.agents:
                self._launch(a)
            if wait:
                self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, members: int | None = None, timeout_s: float | None = None) -> dict:
        """Wait until the leader serves, knows ``members`` members (default: every live agent but itself), and no
        re-plan is pending. -> the /cluster view"""
        deadline = time.monotonic() + (timeout_s or self.options.ready_timeout_s)
        while True:
            for a in self.agents:
                if a.popen is not None and a.popen.poll() is not None and a.leader:
                    raise FlowSpecError(f"the leader exited with code {a.popen.returncode}:\n{a.log_tail()}")
            want = members if members is not None else sum(a.alive for a in self.agents if not a.leader)
            view = self._ready_view(want)
            if view is not None:
                return view
            if time.monotonic() > deadline:
                tails = "\n".join(f"--- agent{a.index}\n{a.log_tail(12)}" for a in self.agents)
                raise FlowSpecError(f"the cluster was not ready within the timeout:\n{tails}")
            time.sleep(READY_POLL_S)

    def wait_standby(self, timeout_s: float | None = None) -> None:
        """Wait until the serving plan's standby (if it names one) is ready to lead: it fetches a replica and loads
        the leader's parts in the background after the plan serves, which a benchmark would otherwise measure too."""
        deadline = time.monotonic() + (timeout_s or self.options.ready_timeout_s)
        while True:
            standby = self.view().get("standby")
            if not standby:
                return
            info = next((i for i in (a.info() for a in self.agents if a.alive) if i and i.get("id") == standby), None)
            if info is not None and info.get("standby_ready"):
                return
            if time.monotonic() > deadline:
                raise FlowSpecError(f"the standby {standby} was not ready to lead within the timeout")
            time.sleep(READY_POLL_S)

    def _ready_view(self, members: int) -> dict | None:
        if self.api_url is None:
            info = self.agents[0].info()
            if info is None or not info.get("api_url"):
                return None
            self.api_url = info["api_url"]
        try:
            view = self.view()
        except (OSError, urllib.error.URLError, ValueError):
            return None
        known = [m for m in view["members"] if m.get("role") == "member"]
        settled = view.get("transition") is None and not view.get("broken") and not view.get("pending")
        if view["leader"]["ready"] and settled and len(known) == members:
            return view
        return None

    def api_urls(self) -> list[str | None]:
        """Each agent's API URL (None until it runs)."""
        return [(a.info() or {}).get("api_url") for a in self.agents]

    def view(self) -> dict:
        """The leader's GET /cluster."""
        with urllib.request.urlopen(self.api_url + "/cluster", timeout=HTTP_TIMEOUT_S) as r:
            return json.loads(r.read())

    def timelines(self, since: float | None = None) -> list[dict]:
        """Every live agent's stage busy intervals (``GET /control/timeline``; time.time() stamps, comparable
        across these processes), for per-stage timeline charts. Agents without a stage report none."""
        return asyncio.run(self._timelines(since))

    async def _timelines(self, since: float | None) -> list[dict]:
        query = "" if since is None else f"?since={since!r}"
        # the agents serve it to holders of the key only
        session = aiohttp.ClientSession() if self.key is None else AuthClient(self.key, self._identity).open()
        out = []
        async with session:
            for a in self.agents:
                info = a.info() if a.alive else None
                if info is None:
                    continue
                async with session.get(info["url"] + TIMELINE_PATH + query,
                                       timeout=aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S)) as r:
                    if r.status != 200:
                        raise FlowSpecError(f"agent{a.index} answered {r.status} for its timeline")
                    out.append({"agent": a.index, **await r.json()})
        return out

    def terminate(self, index: int, wait: bool = True) -> None:
        """Stop agent ``index`` gracefully (SIGTERM: it says goodbye); ``wait`` for it to exit."""
        self._signal(index, signal.SIGTERM, wait)

    def kill(self, index: int, wait: bool = True) -> None:
        """Make agent ``index`` vanish (SIGKILL: no goodbye, no mDNS removal)."""
        self._signal(index, signal.SIGKILL, wait)

    def _signal(self, index: int, sig: int, wait: bool) -> None:
        a = self.agents[index]
        if a.alive:
            a.popen.send_signal(sig)
            if wait:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    a.popen.wait(STOP_TIMEOUT_S)

    def unplug(self, index: int) -> None:
        """(--netns) Agent ``index``'s host vanishes: its link is cut, then it is killed with its namespace."""
        if self.net is None:
            raise FlowSpecError("only a cluster of separate hosts (netns) can unplug one")
        self.net.unplug(index)
        a = self.agents[index]
        if a.popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                a.popen.wait(STOP_TIMEOUT_S)

    def wait_exit(self, index: int, timeout_s: float = STOP_TIMEOUT_S) -> None:
        a = self.agents[index]
        if a.popen is not None:
            a.popen.wait(timeout_s)

    def restart(self, index: int) -> None:
        """Start agent ``index`` again (same state folder, so the same agent id)."""
        a = self.agents[index]
        if a.alive:
            raise FlowSpecError(f"agent{index} is still running")
        self._launch(a)

    def stop(self) -> None:
        """SIGTERM every agent (members first), wait, SIGKILL what is left; remove a temporary state root."""
        live = [a for a in reversed(self.agents) if a.alive]
        for a in live:
            with contextlib.suppress(ProcessLookupError):
                a.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for a in live:
            try:
                a.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("agent%d did not stop in time; killing it (stacks in %s)", a.index, a.log_path)
                with contextlib.suppress(ProcessLookupError):
                    a.popen.send_signal(signal.SIGUSR1)  # the agent dumps its stacks to its log
                    time.sleep(0.5)
                a.popen.kill()
                a.popen.wait()
        if self.net is not None:
            self.net.down()
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start(n: int, options: ClusterOptions | None = None) -> LocalCluster:
    """Start a local cluster of ``n`` agents and wait until it serves. Use as a context manager, or call stop()."""
    return LocalCluster(n, options).start()


def _measure_gflops(threads: int) -> float:
    """The device profile's compute score at ``threads``, measured in a child process: the launcher itself stays
    free of torch and the engine (hundreds of MB it would hold for the cluster's whole life)."""
    code = f"from flowspec_p2p.cluster.profile import measure; print(measure(threads={threads}).gflops)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=300)
    if out.returncode != 0:
        raise FlowSpecError(f"measuring this host's compute failed: {out.stderr.strip()[-500:]}")
    return float(out.stdout.strip().splitlines()[-1])
