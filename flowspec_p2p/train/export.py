"""Export a trained head as a ``DraftBundle`` (float16 weights + JSON metadata) where ``find_draft`` looks."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from ..env import cache_dir
from ..errors import ConfigError
from ..speculative.head import DraftBundle, DraftHead
from .corpus import load_corpus
from .evaluate import evaluate
from .fit import FitConfig, Frozen, checkpoint_vocab, load_target, prepare, stores
from .prompts import load_pool
from .store import FeatureStore

log = logging.getLogger(__name__)

DEFAULT_NAME = "eagle-head"


def load_checkpoint(cfg: FitConfig, target_cfg) -> tuple[DraftHead, dict]:
    path = cfg.checkpoint
    if not path.is_file():
        raise ConfigError(f"no checkpoint at {path}: run `flowspec draft fit` first")
    state = torch.load(path, weights_only=False)
    head = DraftHead(target_cfg)
    head.load_state_dict(state["head"])
    return head.eval(), state


def eval_indices(keys: list[str], temperatures: list[float], held: list[int], state: dict) -> list[int]:
    """The conversations to evaluate on: the held-out ones, and self-distilled ones the fit never saw (stored
    after its last checkpoint, or in a store it was not given). The checkpoint lists the self-distilled keys it
    saw; an older one records only their count, and self-distilled conversations come first in the corpus, which
    holds while its stores are the fit's, in the same order."""
    seen_keys = state.get("self_distilled_keys")
    if seen_keys is not None:
        seen = set(seen_keys)
        unseen = [i for i, (k, t) in enumerate(zip(keys, temperatures, strict=True)) if t >= 0 and k not in seen]
        return sorted(set(held) | set(unseen))
    seen_n = state.get("data", {}).get("self_distilled_seen")
    if seen_n is None:
        return list(held)
    now = sum(1 for t in temperatures if t >= 0)
    return sorted(set(held) | set(range(seen_n, now)))


def pool_groups(run_dir: Path) -> dict[str, str] | None:
    """Conversation key -> the pool's category (chat, qa, math, code, summary), or None without a pool."""
    path = run_dir / "pool.jsonl"
    return {p.key: p.category for p in load_pool(path)} if path.is_file() else None


def run_eval(cfg: FitConfig, depth: int | None = None, progress: bool = True, bundle: Path | None = None) -> dict:
    """Evaluate the run's latest checkpoint on its held-out split, per pool category too; written to
    ``<run>/eval.json``. With ``bundle``: that exported head instead (e.g. the shipped one, on its own draft
    vocabulary) on the run's held-out conversations, written to ``<run>/eval-<bundle name>.json``."""
    torch.set_num_threads(cfg.threads)
    target = load_target(cfg.model)
    corpus, _, held, fz = prepare(cfg, target)
    if bundle is None:
        head, state = load_checkpoint(cfg, target.cfg)
        idx = eval_indices(corpus.keys, corpus.temperature.tolist(), held, state)
        step, out = state["step"], cfg.run_dir / "eval.json"
    else:
        b = DraftBundle.load(Path(bundle))
        fp = FeatureStore(cfg.run_dir / "features").manifest.get("target_fingerprint")
        if b.meta.get("target_fingerprint") != fp:
            log.warning("%s was trained for another target (%s) than the run's features (%s)", bundle,
                        b.meta.get("target_fingerprint"), fp)
        head, fz = b.head, Frozen.build(target, b.draft_vocab, fz.feature_rms)
        idx = list(held)  # a foreign head: only the split's held-out conversations are known unseen
        step = b.meta.get("training", {}).get("steps")
        out = cfg.run_dir / f"eval-{Path(bundle).with_suffix('').name}.json"
    t0 = time.perf_counter()
    groups = pool_groups(cfg.run_dir)
    result = {"step": step, **evaluate(head, corpus, idx, fz, cfg, depth, progress, groups=groups)}
    log.info("evaluated step %s on %d held-out or newer conversations in %.0f s", step, len(idx),
             time.perf_counter() - t0)
    out.write_text(json.dumps(result, indent=1) + "\n")
    return result


def export(cfg: FitConfig, out_dir: Path | None = None, name: str = DEFAULT_NAME, evaluation: dict | None = None,
           dtype: torch.dtype = torch.float16) -> Path:
    """Write ``<out_dir>/<name>.safetensors|.json``; -> the stem. Default folder: ~/.cache/flowspec_p2p/drafts."""
    store = FeatureStore(cfg.run_dir / "features")
    fingerprint = store.manifest.get("target_fingerprint")
    if not fingerprint:
        raise ConfigError(f"{store.root} does not record its target's fingerprint")
    target = load_target(cfg.model)
    head, state = load_checkpoint(cfg, target.cfg)
    vocab = checkpoint_vocab(cfg, state)
    if evaluation is None and (cfg.run_dir / "eval.json").is_file():
        evaluation = json.loads((cfg.run_dir / "eval.json").read_text())
        if evaluation.get("step") != state["step"]:
            log.warning("eval.json is from step %s, the checkpoint from step %d", evaluation.get("step"),
                        state["step"])
    train = state.get("config", {})
    data = state.get("data")
    if data is None:  # a checkpoint from before fit recorded its data: describe the stores as they are now
        corpus = load_corpus(*stores(cfg))
        fixed = [i for i in range(len(corpus)) if float(corpus.temperature[i]) < 0]
        data = {"conversations": len(corpus), "answer_tokens": corpus.answer_tokens(),
                "teacher_forced_conversations": len(fixed), "teacher_forced_answer_tokens": corpus.answer_tokens(fixed)}
    meta = {
        "target_fingerprint": fingerprint,
        "architecture": "eagle1 (fc 2H->H + 1 decoder block, no input norm), trained with EAGLE-3 training-time test",
        "parameters": head.num_parameters(),
        "data": {
            **data,
            "source": "ShareGPT V3 first turns + synthetic math/code/summary prompts (no Spec-Bench prompt), "
                      "answers written by the target (self-distillation, greedy and T=1)"
                      + (", plus ShareGPT's recorded answers teacher-forced through the target"
                         if data.get("teacher_forced_conversations") else ""),
        },
        "training": {
            "steps": state["step"],
            "warm_start": state.get("warm_start"),  # recorded by fit: the donor checkpoint and its steps
            "epochs": round(state["seen_tokens"] / max(1, data["answer_tokens"]), 3),
            "target_tokens_seen": state["seen_tokens"],
            "wall_seconds": round(state.get("train_seconds", 0.0)),
            **{k: train[k] for k in ("tokens_per_step", "lr", "unroll", "step_decay", "token_weight",
                                      "feature_weight", "noise", "draft_vocab", "vocab_coverage", "bf16")
               if k in train},
        },
        "exported_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "reproduce": "flowspec draft train (see flowspec draft --help); the shipped head: lab/train_head.sh",
    }
    if evaluation:
        meta["heldout"] = evaluation
        meta["heldout_top1"] = evaluation.get("heldout_top1")
        if evaluation.get("chain_starts"):  # greedy held-out conversations exist: chain acceptance means something
            meta["chain_accept"] = evaluation.get("chain_accept")
            meta["tau_chain"] = evaluation.get("chain_tau")
    stem = (out_dir or cache_dir() / "drafts") / name
    DraftBundle(head, vocab, meta).save(stem, dtype=dtype)
    log.info("exported %s (%.1f MB)", stem, stem.with_suffix(".safetensors").stat().st_size / 1e6)
    return stem
