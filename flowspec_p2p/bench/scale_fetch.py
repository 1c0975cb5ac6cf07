"""``flowspec bench-scale fetch``: the weight fetch alone, as agents do it, without planning, loading or decoding.

One process serves the model as a keyed leader does (its agent server: TLS, the gate, the session guard, the weight
server, on uvloop; every digest computed before the clock starts, as a leader does before its first plan); each of
``agents - 1`` member processes authenticates with the cluster key, then all fetch their ranges at once
(weight_server.fetch_range into an empty cache: streamed, hashed, fsync'ed, verified). The ranges are the model's
layers split evenly over ``agents`` stages, the leader keeping the first (the first member's and the last's, as a
plan of this host would give them, norm with the last). Per run: MB/s of each member and in all (bytes over the
slowest member's time), and the CPU seconds per GB on each side (a member's whole process while it fetches; the
server's whole process over the run), with the 1-minute load average.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from yarl import URL

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 600.0  # the server hashes the whole model before it says it is ready


def stage_ranges(num_layers: int, agents: int) -> list[tuple[int, int]]:
    """``num_layers`` split into ``agents`` contiguous ranges, as evenly as they go (the earlier ones smaller)."""
    base, extra = divmod(num_layers, agents)
    sizes = [base + (1 if i >= agents - extra else 0) for i in range(agents)]
    out, a = [], 0
    for s in sizes:
        out.append((a, a + s))
        a += s
    return out


# ------------------------------------------------------------------------------------------ the processes


async def _serve(model: Path, state: Path) -> None:
    from aiohttp import web

    from ..cluster.identity import Identity
    from ..cluster.keys import ClusterKey, read_key, write_key
    from ..cluster.net import bind
    from ..cluster.security import Security
    from ..cluster.weight_server import WeightServer
    from ..model.weights import open_source, tensor_digest

    key = ClusterKey.generate()
    write_key(state / "cluster.key", key)
    identity = Identity.load_or_create(state / "leader")
    sec = Security(identity.agent_id, read_key(state / "cluster.key"), identity)
    source = open_source(model)
    ws = WeightServer(source)
    for name in source.names():  # as a leader's model fingerprint does before its first plan
        await asyncio.to_thread(tensor_digest, source, name)
    app = web.Application(middlewares=sec.middlewares())
    sec.install(app)
    ws.install(app)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = await bind(runner, ["127.0.0.1"], 0, sec.server_ssl(), gate=sec.gate)
    sys.stdout.write(f"ready {port}\n")
    sys.stdout.flush()
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # until told to stop
    sys.stdout.write(json.dumps({"served_bytes": ws.served_bytes}) + "\n")
    sys.stdout.flush()
    await runner.cleanup()


async def _fetch(url: str, state: Path, layers: tuple[int, int], embed: bool, norm: bool) -> None:
    from ..cluster.identity import Identity
    from ..cluster.keys import read_key
    from ..cluster.security import Security
    from ..cluster.weight_server import fetch_range
    from ..types import LayerRange

    identity = Identity.generate()
    sec = Security(identity.agent_id, read_key(state / "cluster.key"), identity)
    cache = Path(tempfile.mkdtemp(prefix="fetch-", dir=state))
    async with sec.client_session() as session:
        await sec.auth.session(URL(url))  # authenticated before the clock starts
        sys.stdout.write("ready\n")
        sys.stdout.flush()
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        cpu0, t0 = time.process_time(), time.perf_counter()
        _, n = await fetch_range(session, url, LayerRange(start=layers[0], end=layers[1]), embed=embed, norm=norm,
                                 cache_dir=cache)
        took, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    shutil.rmtree(cache, ignore_errors=True)
    sys.stdout.write(json.dumps({"layers": list(layers), "bytes": n, "s": took, "cpu_s": cpu}) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    """The bench's own processes: ``serve MODEL STATE`` or ``fetch URL STATE START END EMBED NORM``."""
    import uvloop  # the loop agents run on (commands.run_async)

    args = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.WARNING)
    if args[0] == "serve":
        uvloop.run(_serve(Path(args[1]), Path(args[2])))
    else:
        uvloop.run(_fetch(args[1], Path(args[2]), (int(args[3]), int(args[4])), args[5] == "1", args[6] == "1"))
    return 0


# ------------------------------------------------------------------------------------------------- the run


def _child(state: Path, *args: str) -> subprocess.Popen:
    log_path = state / f"{args[0]}-{len(list(state.glob('*.log')))}.log"
    with open(log_path, "w") as err:  # (their progress bars and logs; the tail goes into an error)
        return subprocess.Popen([sys.executable, "-m", __name__, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=err, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _line(p: subprocess.Popen, what: str, state: Path) -> str:
    line = p.stdout.readline()
    if not line:
        tail = "".join(f.read_text()[-1500:] for f in sorted(state.glob(f"{what}-*.log")))
        raise RuntimeError(f"a {what} process ended early (exit {p.wait()}): {tail}")
    return line.strip()


def one_run(model: Path, agents: int, num_layers: int, root: Path) -> dict:
    """One fetch of every member's range at once from a fresh server. -> MB/s and CPU seconds per GB"""
    state = Path(tempfile.mkdtemp(prefix="flowspec-fetch-", dir=root))
    server = _child(state, "serve", str(model), str(state))
    members: list[subprocess.Popen] = []
    try:
        port = int(_line(server, "serve", state).split()[1])
        url = f"https://127.0.0.1:{port}"
        ranges = stage_ranges(num_layers, agents)[1:]
        for i, (a, b) in enumerate(ranges):
            members.append(_child(state, "fetch", url, str(state), str(a), str(b), "0",
                                  "1" if i == len(ranges) - 1 else "0"))
        for m in members:
            _line(m, "fetch", state)
        sp = psutil.Process(server.pid)
        cpu0 = sum(sp.cpu_times()[:2])
        load1 = os.getloadavg()[0]
        for m in members:
            m.stdin.write("go\n")
            m.stdin.flush()
        got = [json.loads(_line(m, "fetch", state)) for m in members]
        server_cpu = sum(sp.cpu_times()[:2]) - cpu0
        server.stdin.write("stop\n")
        server.stdin.flush()
        _line(server, "serve", state)
    finally:
        for p in [*members, server]:
            if p.poll() is None:
                p.kill()
            p.wait()
        shutil.rmtree(state, ignore_errors=True)
    total = sum(g["bytes"] for g in got)
    return {"members": [{**g, "mb_s": g["bytes"] / 1e6 / g["s"], "cpu_s_per_gb": g["cpu_s"] / (g["bytes"] / 1e9)}
                        for g in got],
            "mb": total / 1e6, "mb_s": total / 1e6 / max(g["s"] for g in got),
            "member_cpu_s_per_gb": sum(g["cpu_s"] for g in got) / (total / 1e9),
            "server_cpu_s_per_gb": server_cpu / (total / 1e9), "load1": load1}


def run_fetch(model: Path, agents: int, runs: int, root: Path | None = None) -> dict:
    """``runs`` fetch runs of ``model`` to ``agents - 1`` members at once. -> per run and medians"""
    from ..model.weights import open_source

    num_layers = open_source(model).config.num_layers
    samples: list[dict] = []
    for r in range(runs):
        samples.append(one_run(model, agents, num_layers, root or Path(tempfile.gettempdir())))
        log.warning("fetch run %d: %.0f MB/s (%s), CPU s/GB members %.2f, server %.2f, load %.1f", r + 1,
                    samples[-1]["mb_s"], " + ".join(f"{m['mb_s']:.0f}" for m in samples[-1]["members"]),
                    samples[-1]["member_cpu_s_per_gb"], samples[-1]["server_cpu_s_per_gb"], samples[-1]["load1"])
    med = {k: statistics.median(s[k] for s in samples) for k in ("mb_s", "member_cpu_s_per_gb",
                                                                  "server_cpu_s_per_gb", "load1")}
    return {"agents": agents, "ranges": [list(x) for x in stage_ranges(num_layers, agents)[1:]],
            "samples": samples, **{f"median_{k}": v for k, v in med.items()}}


if __name__ == "__main__":
    sys.exit(main())
