"""bench-scale's pieces: llama.cpp's RPC pipeline over three processes (``LlamaRpc``), and the figures read from the
agents' logs (fetches, loads) and from the model file (a stage's layer bytes)."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

from ..model.arch import layer_tensor_names
from .paths import portable_path

_FETCH = re.compile(r"^(\d\d:\d\d:\d\d) \S+ \S+: range \[(\d+), (\d+)\): (\d+) tensors, ([\d.]+) MB, ([\d.]+) MB "
                    r"transferred in ([\d.]+) s \(([\d.]+) MB/s\)")
_LOAD = re.compile(r"^(\d\d:\d\d:\d\d) \S+ \S+: epoch (\d+): layers \[(\d+), (\d+)\) ready to serve "
                   r"\((\w+), ([\d.]+) s, ([\d.]+) MB fetched\)")
_SHORT = re.compile(r"short by (\d+) MB")
START_TIMEOUT_S = 900.0


def fetch_records(log: Path) -> list[dict]:
    """Every range fetch an agent's log reports (weight_server.fetch_range), oldest first."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        m = _FETCH.match(line)
        if m:
            at, a, b, n, range_mb, mb, s, rate = m.groups()
            out.append({"at": at, "layers": [int(a), int(b)], "tensors": int(n), "range_mb": float(range_mb),
                        "mb": float(mb), "s": float(s), "mb_s": float(rate)})
    return out


def load_records(log: Path) -> list[dict]:
    """Every stage an agent's log reports ready (stage_host), oldest first: how it got its layers and how long."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        m = _LOAD.match(line)
        if m:
            at, epoch, a, b, how, s, mb = m.groups()
            out.append({"at": at, "epoch": int(epoch), "layers": [int(a), int(b)], "source": how, "load_s": float(s),
                        "fetched_mb": float(mb)})
    return out


def layer_bytes(source, layers) -> int:
    """Stored bytes of the tensors of ``layers`` (what a stage of them fetches and packs)."""
    return sum(len(source.raw_bytes(n)) for i in layers for n in layer_tensor_names(source.config, i)
               if n in source.names())


def status_mb(text: str | None) -> int | None:
    """N of "short by N MB" in a no-plan message."""
    m = _SHORT.search(text or "")
    return int(m.group(1)) if m else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaRpc:
    """Two ``ggml-rpc-server -t 1`` and ``llama-server -t 1 --rpc`` on loopback, on one GGUF (scripts/rpc_compare.sh's
    set-up)."""

    def __init__(self, bin_dir: Path, model: Path, context: int):
        self.bin_dir, self.model, self.context = Path(bin_dir), Path(model), context
        rpc = next((self.bin_dir / n for n in ("ggml-rpc-server", "rpc-server") if (self.bin_dir / n).is_file()),
                   None)
        if rpc is None or not (self.bin_dir / "llama-server").is_file():
            raise FileNotFoundError(f"{bin_dir} lacks ggml-rpc-server (or rpc-server) and llama-server")
        self.rpc_bin = rpc
        self.procs: list[subprocess.Popen] = []
        self.url = ""
        self.started_s = 0.0

    def start(self) -> LlamaRpc:
        t0 = time.monotonic()
        ports = [_free_port() for _ in range(3)]
        try:
            for p in ports[:2]:
                self.procs.append(subprocess.Popen([str(self.rpc_bin), "-H", "127.0.0.1", "-p", str(p), "-t", "1"],
                                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            time.sleep(1.0)  # the rpc servers listen before llama-server connects
            rpcs = ",".join(f"127.0.0.1:{p}" for p in ports[:2])
            self.procs.append(subprocess.Popen(
                [str(self.bin_dir / "llama-server"), "-m", str(self.model), "--host", "127.0.0.1", "--port",
                 str(ports[2]), "-t", "1", "--rpc", rpcs, "-c", str(self.context), "-np", "1", "--no-webui"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            self.url = f"http://127.0.0.1:{ports[2]}"
            deadline = time.monotonic() + START_TIMEOUT_S
            while True:
                try:
                    with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                    raise RuntimeError("llama.cpp's RPC pipeline did not start")
                time.sleep(1.0)
        except BaseException:
            self.stop()
            raise
        self.started_s = time.monotonic() - t0
        return self

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.poll() is None]

    def describe(self) -> dict:
        version = subprocess.run([str(self.bin_dir / "llama-server"), "--version"], capture_output=True, text=True,
                                 timeout=30)
        return {"bin": portable_path(self.bin_dir), "version": (version.stdout + version.stderr).strip()[:200],
                "start_to_serving_s": round(self.started_s, 1),
                "processes": "2 x ggml-rpc-server -t 1 + llama-server -t 1 --rpc (-c context, -np 1)"}

    def stop(self) -> None:
        for p in reversed(self.procs):  # llama-server first, then the rpc servers it holds connections to
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        self.procs.clear()

    @staticmethod
    def chat(url: str, prompt: str, max_tokens: int) -> dict:
        """One greedy chat; every requested token decoded (ignore_eos) -> the server's own decode rate."""
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
                "seed": 0, "cache_prompt": False, "ignore_eos": True}
        req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=900) as r:
            out = json.loads(r.read())
        return {"text": out["choices"][0]["message"]["content"],
                "decode_tokens_per_s": out["timings"]["predicted_per_second"],
                "tokens": out["usage"]["completion_tokens"], "mode": "llama.cpp"}
