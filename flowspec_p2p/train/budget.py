"""``flowspec draft train``: a draft head for any model in a bounded time, in resumable phases.

    phase    share   what it does (each phase is one of the ``flowspec draft`` steps, given a time limit)
    distil   0.30    the target answers the prompt pool, HELDOUT_FIRST held-out prompts first  -> <run>/features
    force    0.35    ShareGPT's recorded answers teacher-forced through the target            -> <run>/fixed
    fit      0.30    the head's training, its cosine schedule run on time (FitConfig.max_seconds)
    (the last ~5%: held-out evaluation and export, bounded by the held-out set's size)

A model with no checkpoint in its run starts from a head trained for a model of the same architecture when one is
installed (the shipped one, or one in ~/.cache/flowspec_p2p/drafts; matched by the target config, which includes
the vocabulary size and special token ids): another quantization of the default model then needs minutes, not
hours. ``init_from`` (or none, with ``--no-warm-start``) overrides it.

Without the ShareGPT package the force phase is skipped and its share goes to distil. Every phase's spent time
is kept with its output (a store's manifest "seconds", the checkpoint's "train_seconds"), so a rerun (after a
kill, or with a larger ``minutes``) gives each phase what is left of its share; once all are spent a rerun only
evaluates and exports. After a warm start, ``keep_better`` compares the trained head with its donor on the run's
held-out conversations and ships the donor (under this model's fingerprint) when the fine-tune made it worse.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import env
from ..model.weights import open_source
from ..speculative.head import ASSETS, DraftBundle
from .data import DataConfig, generate_data
from .export import run_eval
from .fit import FitConfig, fit
from .prompts import sharegpt_available
from .store import MANIFEST

log = logging.getLogger(__name__)

SHARES = {"distil": 0.30, "force": 0.35, "fit": 0.30}
HELDOUT_FIRST = 64  # held-out prompts the distil phase answers before the pool's order (the evaluation set)
MIN_PHASE_S = 10.0  # a phase with less than this left is skipped


@dataclass(frozen=True)
class Plan:
    distil_s: float
    force_s: float
    fit_s: float

    @classmethod
    def for_minutes(cls, minutes: float, teacher_forcing: bool = True) -> Plan:
        total = 60.0 * minutes
        force = SHARES["force"] * total if teacher_forcing else 0.0
        distil = SHARES["distil"] * total + (0.0 if teacher_forcing else SHARES["force"] * total)
        return cls(distil, force, SHARES["fit"] * total)


def spent_seconds(store_dir: Path) -> float:
    """Seconds the data steps have spent writing the store in ``store_dir`` (0 for none yet)."""
    path = store_dir / MANIFEST
    return float(json.loads(path.read_text()).get("seconds", 0.0)) if path.is_file() else 0.0


def same_architecture_head(model: str | None, search: list[Path] | None = None) -> Path | None:
    """The stem of an installed head whose target config equals ``model``'s (shipped assets first)."""
    want = json.loads(open_source(model).config.canonical_json())
    for folder in search or [ASSETS, env.cache_dir() / "drafts"]:
        for meta_path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
            try:
                meta = json.loads(meta_path.read_text())
            except (OSError, ValueError):
                continue
            if meta.get("target_config") == want and meta_path.with_suffix(".safetensors").is_file():
                return meta_path.with_suffix("")
    return None


def _started_from(cfg: FitConfig, donor: Path) -> bool:
    """Whether the run's fit starts (no checkpoint yet) or started (its checkpoint says so) from ``donor``."""
    if not cfg.checkpoint.is_file():
        return True
    state = torch.load(cfg.checkpoint, weights_only=False, map_location="cpu")
    return (state.get("warm_start") or {}).get("from") == donor.name


def _say(msg: str) -> None:
    sys.stderr.write(f"[draft train] {msg}\n")
    sys.stderr.flush()


def train(data: DataConfig, fitting: FitConfig, minutes: float, progress: bool = True,
          warm_start: bool = True) -> FitConfig:
    """Run the data and fit phases within ``minutes`` (see the module doc); -> the fit config used (its
    ``max_seconds`` set), for evaluation and export."""
    plan = Plan.for_minutes(minutes, teacher_forcing=sharegpt_available())
    run = data.run_dir
    phases = [("distil", plan.distil_s, run / "features", data.model_copy(update={"source": "generate",
                                                                                 "heldout_first": HELDOUT_FIRST})),
              ("force", plan.force_s, run / "fixed", data.model_copy(update={"source": "sharegpt"}))]
    for i, (name, share, store, cfg) in enumerate(phases, 1):
        left = share - spent_seconds(store)
        if left < MIN_PHASE_S:
            _say(f"phase {i}/3 {name}: its {share / 60:.1f} min are spent")
            continue
        _say(f"phase {i}/3 {name}: {left / 60:.1f} of {share / 60:.1f} min left")
        generate_data(cfg.model_copy(update={"max_seconds": left}), progress=progress)
    fitting = fitting.model_copy(update={"max_seconds": plan.fit_s})
    if warm_start and fitting.init_from is None:
        donor = same_architecture_head(fitting.model)
        if donor is not None and _started_from(fitting, donor.with_suffix(".json")):
            _say(f"warm start from {donor} (trained for a model of the same architecture)")
            fitting = fitting.model_copy(update={"init_from": donor.with_suffix(".json")})
    _say(f"phase 3/3 fit: {plan.fit_s / 60:.1f} min in all (resumes from {fitting.checkpoint} if there)")
    fit(fitting, progress=progress)
    return fitting


def _score(result: dict) -> tuple[float, float]:
    """Chain tau at the deepest evaluated depth, then step-0 top-1: what a drafted chain gains."""
    taus = result.get("chain_tau") or {}
    deepest = max(taus, key=int) if taus else None
    return (float(taus[deepest]) if deepest else 0.0, float((result.get("heldout_top1") or [0.0])[0]))


def keep_better(cfg: FitConfig, stem: Path, progress: bool = True) -> dict:
    """After a warm start from a bundle: evaluate the exported head at ``stem`` and its donor on the run's held-out
    conversations; when the donor scores higher (``_score``), rewrite ``stem`` with the donor's weights and draft
    vocabulary and this model's fingerprint. -> {"trained": result, "donor": result, "kept": "trained" | "donor"}"""
    assert cfg.init_from is not None
    trained = run_eval(cfg, progress=progress, bundle=stem)
    donor = run_eval(cfg, progress=progress, bundle=cfg.init_from)
    kept = "donor" if _score(donor) > _score(trained) else "trained"
    if kept == "donor":
        ours = DraftBundle.load(stem)
        theirs = DraftBundle.load(cfg.init_from)
        meta = {**ours.meta, "heldout": donor, "heldout_top1": donor.get("heldout_top1"),
                "chain_accept": donor.get("chain_accept"), "tau_chain": donor.get("chain_tau"),
                "kept_donor": {"from": cfg.init_from.name, "reason": "the fine-tuned head scored lower on this "
                               "model's held-out conversations", "trained_heldout": trained}}
        for k in ("format", "weights_dtype", "draft_vocab_size", "target_config"):
            meta.pop(k, None)
        DraftBundle(theirs.head, theirs.draft_vocab, meta).save(stem, dtype=torch.float16)
        _say(f"the donor drafts better for this model (chain tau {_score(donor)[0]:.3f} against "
             f"{_score(trained)[0]:.3f}): {stem} holds the donor's weights")
    return {"trained": trained, "donor": donor, "kept": kept}
