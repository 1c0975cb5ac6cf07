"""llama.cpp as the anchor of ``flowspec bench-engine``: its ``llama-bench`` run on the same GGUF, parsed from its JSON
(``-o json``), and any program's peak resident set. The product never depends on llama.cpp; without a llama-bench
binary the benchmark measures ours alone.

    tg-N at depth d   N single-token decodes after a d-token context: llama-bench's decode tokens/s (no prefill)
    pp-n at depth d   one n-token batch after a d-token context (llama-bench computes logits for its last token
                      only); its cost is n / (pp tokens/s), compared with pp-1's
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError

BENCH_NAME = "llama-bench"
CLI_NAME = "llama-cli"  # looked for beside llama-bench: a decode's peak RSS the way a user runs it
RUN_TIMEOUT_S = 600.0
KEEP = ("build_commit", "cpu_info", "model_type", "model_size", "n_threads", "n_prompt", "n_gen", "n_depth",
        "avg_ts", "stddev_ts", "samples_ts", "avg_ns")


@dataclass(frozen=True)
class Peak:
    """A finished child process: exit code, peak RSS (its own and its waited-for children's), and its output."""

    returncode: int
    peak_mb: float
    stdout: str
    stderr: str


# Runs argv in a grandchild and writes its ru_maxrss (KiB) to the file argv[1]. A child forked straight from this
# (large) process would not do: Linux folds the forked copy of the parent's memory into the child's ru_maxrss when
# it execs, so every child would report at least the benchmark's own RSS.
_LAUNCHER = r"""import os, sys
pid = os.fork()
if pid == 0:
    try:
        os.execvp(sys.argv[2], sys.argv[2:])
    except OSError as e:
        sys.stderr.write(f"{sys.argv[2]}: {e}\n")
    os._exit(127)
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as f:
    f.write(str(usage.ru_maxrss))
code = os.waitstatus_to_exitcode(status)
sys.exit(code if code >= 0 else 128 - code)
"""


def run_peak(argv: Sequence[str], env: Mapping[str, str] | None = None, timeout_s: float = RUN_TIMEOUT_S) -> Peak:
    """Run ``argv`` to the end and read its peak RSS from ``wait4`` (ru_maxrss of that one process and its waited-for
    children), through a small launcher (``_LAUNCHER``). Output goes through files, so no pipe can fill."""
    with tempfile.TemporaryDirectory() as tmp:
        peak_file = Path(tmp) / "maxrss"
        out_path, err_path = Path(tmp) / "out", Path(tmp) / "err"
        with out_path.open("w") as out, err_path.open("w") as err:
            proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _LAUNCHER, str(peak_file), *argv],
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True,
                                    env=None if env is None else dict(env))
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise ConfigError(f"{Path(argv[0]).name} ran past {timeout_s:.0f} s") from None
        try:
            peak_kib = int(peak_file.read_text())
        except (OSError, ValueError):
            peak_kib = 0  # the launcher failed before its child ended: the return code and stderr say why
        return Peak(proc.returncode, peak_kib / 1024, out_path.read_text(), err_path.read_text())


def find_llama_bench(path: str | Path | None) -> Path | None:
    """``path`` (ConfigError if it is not an executable file), else ``llama-bench`` on PATH, else None."""
    if path is not None:
        p = Path(path).expanduser()
        if not (p.is_file() and os.access(p, os.X_OK)):
            raise ConfigError(f"--llama-bench {p}: not an executable file")
        return p
    found = shutil.which(BENCH_NAME)
    return Path(found) if found else None


def find_llama_cli(llama_bench: Path | None) -> Path | None:
    """``llama-cli`` in llama-bench's folder, else on PATH, else None."""
    if llama_bench is not None and (p := llama_bench.with_name(CLI_NAME)).is_file() and os.access(p, os.X_OK):
        return p
    found = shutil.which(CLI_NAME)
    return Path(found) if found else None


def parse_bench_json(text: str) -> list[dict]:
    """llama-bench's ``-o json`` stdout (a JSON array, one object per test) -> the fields we keep, per test."""
    start = text.find("[")
    try:
        tests = json.loads(text[start:]) if start >= 0 else None
    except ValueError as e:
        raise ConfigError(f"llama-bench printed no JSON array we can read: {e}") from e
    if not isinstance(tests, list):
        raise ConfigError("llama-bench printed no JSON array (is it llama.cpp's llama-bench?)")
    out = []
    for t in tests:
        missing = [k for k in ("n_prompt", "n_gen", "n_threads", "avg_ts") if k not in t]
        if missing:
            raise ConfigError(f"a llama-bench test lacks {', '.join(missing)}: {json.dumps(t)[:200]}")
        out.append({k: t[k] for k in KEEP if k in t})
    return out


def bench_argv(exe: Path, model: Path, *, threads: int, prompt: Sequence[int] = (), gen: int = 0, depth: int = 0,
               repeats: int = 1) -> list[str]:
    """llama-bench's command line for pp tests of the ``prompt`` sizes and/or one tg test of ``gen`` tokens."""
    return [str(exe), "-m", str(model), "-t", str(threads), "-p", ",".join(map(str, prompt)) or "0",
            "-n", str(gen), "-d", str(depth), "-r", str(repeats), "-o", "json"]


def run_bench(exe: Path, model: Path, **kw) -> tuple[list[dict], float]:
    """Run llama-bench (``bench_argv``'s keywords) -> (its tests, its peak RSS in MB)."""
    argv = bench_argv(exe, model, **kw)
    done = run_peak(argv)
    if done.returncode != 0:
        raise ConfigError(f"llama-bench exited {done.returncode}: {done.stderr.strip()[-400:]}")
    return parse_bench_json(done.stdout), done.peak_mb


def decode_tokens_per_s(tests: Sequence[dict]) -> float:
    """The tg test's tokens/s (decode only: llama-bench times the N single-token decodes, not the context)."""
    tg = [t for t in tests if t["n_gen"] > 0 and t["n_prompt"] == 0]
    if len(tg) != 1:
        raise ConfigError(f"expected one tg test from llama-bench, got {len(tg)}")
    return float(tg[0]["avg_ts"])


def batch_seconds(tests: Sequence[dict]) -> dict[int, float]:
    """Seconds of one n-token batch per pp test: {n: n / (pp tokens/s)}."""
    return {int(t["n_prompt"]): t["n_prompt"] / t["avg_ts"] for t in tests if t["n_prompt"] > 0 and t["n_gen"] == 0}


def cli_argv(exe: Path, model: Path, *, prompt: str, tokens: int, threads: int, context: int) -> list[str]:
    """llama-cli decoding ``tokens`` greedy tokens (EOS ignored) after the chat-templated ``prompt``, one turn."""
    return [str(exe), "-m", str(model), "-st", "-p", prompt, "-n", str(tokens), "--temp", "0", "--ignore-eos",
            "-c", str(context), "-t", str(threads), "--no-display-prompt", "--no-warmup"]


def version(exe: Path) -> str:
    """The binary's ``--version`` line (llama.cpp prints it to stderr), or "unknown"."""
    try:
        done = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    lines = (done.stdout + done.stderr).strip().splitlines()
    return lines[0].strip() if lines else "unknown"
