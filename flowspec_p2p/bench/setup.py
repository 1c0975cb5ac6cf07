"""``flowspec bench``'s setup record (run.json): what was run, on what, emulated how, and whether earlier records
may be resumed with it."""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ConfigError
from ..speculative.head import find_draft
from .paths import portable_path

if TYPE_CHECKING:
    from .edge import BenchConfig

# setup entries that must match for --resume to append to earlier records
RESUME_KEYS = ("stages", "link_mbps", "link_latency_ms", "slowdown", "leader_slowdown", "max_tokens", "wire_dtype",
               "threads_per_agent", "context", "model_fingerprint", "draft_fingerprint", "leader_layers",
               "compute_basis", "flowspec_config", "turns")


def _git_commit() -> str | None:
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=root, timeout=10).returncode != 0
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def _sha16(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def _draft_info(cfg: BenchConfig, model_fp: str | None, offered: list[str]) -> dict:
    """Which draft head the leader loaded (the same lookup as the agent's), with a fingerprint of its weights."""
    if "chunk" not in offered and "flowspec" not in offered:
        return {"draft_fingerprint": None, "draft": "none (no draft head: speculative modes are off)"}
    stem = cfg.draft or (find_draft(model_fp) if model_fp else None)
    if stem is None:
        return {"draft_fingerprint": None, "draft": "unknown"}
    stem = Path(stem)
    stem = stem.with_suffix("") if stem.suffix in (".json", ".safetensors") else stem
    try:
        meta = json.loads(stem.with_suffix(".json").read_text())
        fp = _sha16(stem.with_suffix(".safetensors"))
    except (OSError, ValueError):
        return {"draft_fingerprint": None, "draft": portable_path(stem)}
    keep = ("target_fingerprint", "exported_at", "draft_vocab_size", "parameters", "training", "evaluation")
    return {"draft_fingerprint": fp, "draft": portable_path(stem),
            "draft_meta": {k: meta.get(k) for k in keep if k in meta}}


def make_setup(cfg: BenchConfig, slowdown: float, view: dict | None, modes: list[str], offered: list[str],
               prompts_per_dataset: dict[str, int]) -> dict:
    view = view or {}
    leader = next((m for m in view.get("members", []) if m.get("role") == "leader"), {})
    model_fp = leader.get("model")
    cores = os.cpu_count() or 1
    link = (f"{cfg.link_mbps:g} Mbit/s" if cfg.link_mbps else "unlimited") + f", {cfg.link_latency_ms:g} ms one-way"
    emulation = (
        f"Emulated edge cluster on one {cores}-core host: {cfg.stages} stage agents + 1 leader, each a separate "
        f"process on loopback; emulated links {link} (sender-side pacing); emulated compute {slowdown:g}x slower "
        f"(a stage holds each forward until {slowdown:g} times its fastest recent forward of the same size has "
        f"passed, and the leader's drafting, LM head and verification keep it busy {slowdown:g} times the CPU time "
        f"they used, so host contention between devices is not multiplied); {cfg.threads} torch thread(s) per device. "
        "The leader holds the "
        "draft head, embedding and LM head and no layers (the paper's 1 draft + N verification devices). Absolute "
        "numbers are not edge-device numbers; only the ratios between modes measured side by side mean anything.")
    return {
        "stages": cfg.stages,
        "agents": cfg.stages + 1,
        "leader_layers": "never",
        "leader": "draft head, embedding, LM head; no layers",
        "link_mbps": cfg.link_mbps,
        "link_latency_ms": cfg.link_latency_ms,
        "slowdown": slowdown,
        "leader_slowdown": (view.get("leader") or {}).get("slowdown", slowdown),
        "slowdown_rule": "given" if cfg.slowdown is not None else
        f"default: ceil(2 x (stages + 1) / host cores) = ceil(2 x {cfg.stages + 1} / {cores})",
        "emulation": emulation,
        "compute_basis": "stages: fastest; leader: cpu",  # emulation.py: how a slowdown turns into waits
        "threads_per_agent": cfg.threads,
        "wire_dtype": cfg.wire_dtype,
        "context": cfg.context,
        "model": portable_path(cfg.model) if cfg.model else "packaged default",
        "model_fingerprint": model_fp,
        **_draft_info(cfg, model_fp, offered),
        "modes": modes,
        "modes_offered": offered,
        "datasets": list(cfg.datasets),
        "lines": f"[{cfg.start}, {cfg.start + cfg.per_dataset}) of each set, up to {cfg.turns} user turn(s) each",
        "turns": cfg.turns,
        "prompts_per_dataset": prompts_per_dataset,
        "temperatures": list(cfg.temperatures),
        "flowspec_config": cfg.flowspec or None,  # None: the defaults (flowspec.FlowSpecConfig)
        "agent_links": "plain http/ws (--insecure)" if cfg.insecure else "TLS 1.3, mutually authenticated",
        "seeds": "fixed per prompt: crc32('<dataset>:<line>'), the same for every mode and temperature",
        "max_tokens": cfg.max_tokens,
        "host_cores": cores,
        "load_average": round(os.getloadavg()[0], 2),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "git_commit": _git_commit(),
        "stage_layers": [s.get("layers") for s in view.get("stages", [])],
        "plan_text": view.get("plan_text"),
    }


def check_resume(old: dict, new: dict) -> None:
    diff = [f"{k}: {old.get(k)!r} then, {new.get(k)!r} now" for k in RESUME_KEYS if old.get(k) != new.get(k)]
    if diff:
        raise ConfigError("--resume: the earlier records were made with another setup (" + "; ".join(diff) +
                          "); use another --out or drop --resume")
