"""Training the draft head on stored target features (never running the target).

Loss per conversation (EAGLE-1 §4.2 plus EAGLE-3's training-time test, see ``unroll``), summed over unrolled
steps k with weight ``step_decay``**k and over the masked targets j (``corpus.make_example``):

    token    soft cross-entropy  -sum_v p_j(v) log q_j(v)   over the draft vocabulary, where
             p_j = softmax(f_j @ W_d) is the target's distribution and q_j = softmax(g_j @ W_d) the head's
             (W_d: the target's frozen LM head, restricted to the draft vocabulary)
    feature  SmoothL1(g_j, f_j), averaged over the hidden dimension
    noise    step-0 input features get uniform noise of half-width ``noise`` x (feature RMS)

AdamW with linear warmup and cosine decay, gradient-norm clipping, and a checkpoint (head, optimiser, data
order) in ``<run>/ckpt/last.pt`` every ``ckpt_every`` steps: a restarted fit continues where it stopped, on
whatever the store holds by then.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from pydantic import Field
from tqdm import tqdm

from ..errors import ConfigError, WeightsError
from ..model.engine import Shard
from ..model.load import get_engine
from ..model.weights import open_source
from ..speculative.head import DraftBundle, DraftHead
from ..types import LayerRange, Settings
from .corpus import (
    HELDOUT_PER_MILLE,
    Corpus,
    Example,
    answer_token_counts,
    coverage_table,
    draft_vocab_from_counts,
    load_corpus,
    make_example,
    size_for_coverage,
)
from .store import FeatureStore
from .unroll import unrolled

log = logging.getLogger(__name__)


MIN_MEASURED_TOKENS = 2000  # held-out answer tokens needed to size the draft vocabulary on them
SELF_VOCAB_WEIGHT = 0.75  # share of self-distilled answers (vs teacher-forced ones) in the draft-vocab counts


class FitConfig(Settings):
    run_dir: Path
    model: str | None = None
    steps: int = Field(2000, ge=1)  # optimiser steps (a total: a resumed fit stops there too)
    tokens_per_step: int = Field(4096, ge=1)  # loss targets (step 0) per optimiser step
    lr: float = Field(1e-3, gt=0)
    warmup: int = Field(100, ge=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(0.5, gt=0)
    unroll: int = Field(3, ge=1)  # training-time-test steps
    step_decay: float = Field(0.8, gt=0)
    token_weight: float = Field(1.0, ge=0)
    feature_weight: float = Field(0.1, ge=0)
    noise: float = Field(0.05, ge=0)  # uniform half-width, relative to the feature RMS
    draft_vocab: int = Field(16384, ge=0)  # 0 = the full vocabulary
    # size the draft vocabulary by measurement instead: the fewest tokens (a multiple of 1024) that cover this
    # share of the training answers' (weighted) tokens; the table of coverage per size goes to draft_vocab.json
    vocab_coverage: float | None = Field(None, gt=0, le=1)
    max_prompt_context: int = Field(64, ge=0)  # prompt pairs kept before the answer
    max_len: int = Field(384, ge=2)  # pairs per example
    ckpt_every: int = Field(25, ge=1)
    seed: int = 0
    threads: int = Field(1, ge=1)
    use_fixed: bool = True  # also train on the teacher-forced store (<run>/fixed) when there is one
    heldout_per_mille: int = Field(HELDOUT_PER_MILLE, ge=0, le=1000)
    # warm start: a run with no checkpoint yet starts from this checkpoint's head weights (its optimiser state,
    # schedule and draft vocabulary start afresh: the head's weights do not depend on the draft vocabulary)
    init_from: Path | None = None  # a checkpoint (.pt) or an exported DraftBundle (stem, .json or .safetensors)
    # a time budget (training seconds, summed over resumed sessions): the cosine schedule runs on the larger of
    # step / steps and seconds spent / max_seconds, and training stops at either end
    max_seconds: float | None = Field(None, gt=0)
    # bfloat16 matmuls (float32 weights, optimiser and softmax): the LM head's (bf16) and the block's (bf16_block)
    bf16: bool = False
    bf16_block: bool = False
    also_features: tuple[Path, ...] = ()  # more self-distilled stores (other runs' features/ folders) to train on

    @property
    def checkpoint(self) -> Path:
        """The run's latest training checkpoint (written by fit, read on resume, by eval and by export)."""
        return self.run_dir / "ckpt" / "last.pt"


@dataclass
class Frozen:
    """The target's pieces the head trains against: embedding, and the LM head restricted to the draft vocab."""

    embed: torch.Tensor  # [vocab, hidden]
    lm_head: torch.Tensor  # [hidden, V_d]
    full_head: torch.Tensor  # [hidden, vocab]
    vocab: torch.Tensor | None  # [V_d] target ids, or None = all
    in_vocab: torch.Tensor | None  # [vocab] bool
    feature_rms: float
    lm_head_bf16: torch.Tensor | None = None  # [hidden, V_d] lm_head in bfloat16 (FitConfig.bf16), made on first use

    def head_matrix(self, bf16: bool) -> torch.Tensor:
        """The draft-vocabulary LM head, in bfloat16 for ``bf16`` (6x float32's matmul speed on a CPU with AMX)."""
        if not bf16:
            return self.lm_head
        if self.lm_head_bf16 is None:
            self.lm_head_bf16 = self.lm_head.to(torch.bfloat16)
        return self.lm_head_bf16

    @classmethod
    def build(cls, target: Shard, vocab: torch.Tensor | None, feature_rms: float) -> Frozen:
        assert target.embed is not None
        assert target.head_t is not None
        head_t = target.head_t.float()
        in_vocab = None
        if vocab is not None:
            head_t = head_t[:, vocab]
            in_vocab = torch.zeros(target.cfg.vocab_size, dtype=torch.bool)
            in_vocab[vocab] = True
        embed = target.embed.weight.detach().float()  # [vocab, hidden]
        if target.cfg.embed_scale is not None:  # the rows the drafter feeds the head: target.embed(ids), scaled
            embed = embed * target.cfg.embed_scale
        return cls(embed, head_t.contiguous(), target.head_t.float(), vocab, in_vocab, feature_rms)


@dataclass
class StepStats:
    loss: float = 0.0
    targets: list[int] = field(default_factory=list)  # per unrolled step
    top1: list[int] = field(default_factory=list)  # draft argmax == target argmax (draft vocab)

    def add(self, other: StepStats) -> None:
        self.loss += other.loss
        n = max(len(self.targets), len(other.targets))
        self.targets = [a + b for a, b in zip(_pad(self.targets, n), _pad(other.targets, n), strict=True)]
        self.top1 = [a + b for a, b in zip(_pad(self.top1, n), _pad(other.top1, n), strict=True)]

    def accuracy(self) -> list[float]:
        return [c / t if t else 0.0 for c, t in zip(self.top1, self.targets, strict=True)]


def _pad(xs: list[int], n: int) -> list[int]:
    return xs + [0] * (n - len(xs))


def load_target(model: str | None) -> Shard:
    """Only the embedding, final norm and LM head of the target (no layers): what training needs."""
    src = open_source(model)
    return get_engine("torch").load(src, LayerRange(start=0, end=0), embed=True, head=True)


def example_loss(
    head: DraftHead, ex: Example, fz: Frozen, cfg: FitConfig, train: bool, outs: list[torch.Tensor] | None = None
) -> tuple[torch.Tensor, StepStats]:
    """Weighted loss summed over the example's targets (see module doc), and per-step top-1 counts. ``outs``: the
    head's unrolled predictions for ``ex`` when the caller has them already (evaluation, no noise)."""
    n = ex.features.shape[0]
    steps = cfg.unroll
    feats = ex.features.float()  # [n, hidden]
    if train and cfg.noise > 0:
        feats = feats + (torch.rand_like(feats) * 2 - 1) * (cfg.noise * fz.feature_rms)
    nxt = torch.zeros(n + steps - 1, dtype=torch.long)
    m = min(n + steps - 1, ex.tokens.numel() - 1)
    nxt[:m] = ex.tokens[1 : m + 1]
    embeds = fz.embed[nxt]  # [n + steps - 1, hidden]
    if outs is None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16_block):
            outs = [g.float() for g in unrolled(head, feats, embeds, ex.offset, steps)]
    assert len(outs) == steps
    w = fz.head_matrix(cfg.bf16)  # [hidden, V_d]
    rows = ex.valid.nonzero()[:, 0]  # [m] target rows taking part
    stats = StepStats(targets=[0] * steps, top1=[0] * steps)
    total = feats.new_zeros(())
    if rows.numel() == 0:
        return total, stats
    target_f = ex.targets[rows].float()  # [m, hidden]
    with torch.no_grad():
        p = (target_f.to(w.dtype) @ w).float().softmax(-1)  # [m, V_d]
        p_top = p.argmax(-1)
    for k, g in enumerate(outs):
        sel = rows >= k  # step k's row i predicts target row i + k
        if not bool(sel.any()):
            continue
        gk = g[rows[sel] - k]  # [m_k, hidden]
        logq = (gk.to(w.dtype) @ w).float().log_softmax(-1)  # [m_k, V_d]
        ce = -(p[sel] * logq).sum(-1)  # [m_k]
        reg = F.smooth_l1_loss(gk, target_f[sel], reduction="none").mean(-1)  # [m_k]
        total = total + cfg.step_decay**k * (cfg.token_weight * ce.sum() + cfg.feature_weight * reg.sum())
        stats.targets[k] = int(sel.sum())
        stats.top1[k] = int((logq.argmax(-1) == p_top[sel]).sum())
    stats.loss = float(total.detach())
    return total, stats


def lr_at(step: int, cfg: FitConfig, spent_s: float = 0.0) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    if cfg.max_seconds:
        t = max(t, spent_s / cfg.max_seconds)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def feature_rms(corpus: Corpus, sample: int = 200_000) -> float:
    f = corpus.features[:: max(1, corpus.features.shape[0] // sample)].float()
    return float(f.pow(2).mean().sqrt())


def stores(cfg: FitConfig) -> list[FeatureStore]:
    """The run's self-distilled store, any ``also_features`` stores, then its teacher-forced one (if any and
    wanted). Self-distilled conversations come first in the corpus (``data`` in fit counts on it)."""
    for extra in cfg.also_features:
        if not (extra / "manifest.json").is_file():
            raise ConfigError(f"--also-features {extra}: no feature store there (no manifest.json)")
    out = [FeatureStore(cfg.run_dir / "features"), *(FeatureStore(d) for d in cfg.also_features)]
    if cfg.use_fixed and (cfg.run_dir / "fixed" / "manifest.json").is_file():
        out.append(FeatureStore(cfg.run_dir / "fixed"))
    return out


def prepare(cfg: FitConfig, target: Shard) -> tuple[Corpus, list[int], list[int], Frozen]:
    """Load the corpus, split it, fix the draft vocabulary (saved in the run, reused on resume).
    -> corpus, training indices, held-out indices (self-distilled conversations only), frozen target parts"""
    corpus = load_corpus(*stores(cfg))
    if len(corpus) == 0:
        raise ConfigError(f"no features in {cfg.run_dir}: run `flowspec draft data` first")
    train, held = corpus.split(cfg.heldout_per_mille)
    held = [i for i in held if float(corpus.temperature[i]) >= 0]
    vocab_path = cfg.run_dir / "draft_vocab.pt"
    vocab = checkpoint_vocab(cfg)
    if vocab is not None:  # a head is trained on this vocabulary already: never swap it under the head
        if not cfg.vocab_coverage and vocab.numel() != min(cfg.draft_vocab or target.cfg.vocab_size,
                                                           target.cfg.vocab_size):
            log.warning("the checkpoint's draft vocabulary has %d tokens (not --draft-vocab %d): keeping it",
                        vocab.numel(), cfg.draft_vocab)
    elif cfg.checkpoint.is_file():  # a head trained on the full vocabulary: keep that too
        if cfg.draft_vocab or cfg.vocab_coverage:
            log.warning("the checkpoint was trained on the full vocabulary (not the one asked for): keeping it")
    elif cfg.draft_vocab or cfg.vocab_coverage:
        if vocab_path.is_file():
            vocab = torch.load(vocab_path)
            if not cfg.vocab_coverage and vocab.numel() != min(cfg.draft_vocab, target.cfg.vocab_size):
                log.warning("%s has %d tokens, not %d: recomputing", vocab_path, vocab.numel(), cfg.draft_vocab)
                vocab = None
        if vocab is None:
            own = [i for i in train if float(corpus.temperature[i]) >= 0]
            forced = [i for i in train if float(corpus.temperature[i]) < 0]
            counts = answer_token_counts(corpus, own, target.cfg.vocab_size).double()
            if forced:  # the target's own answers are what drafting meets: they weigh SELF_VOCAB_WEIGHT
                other = answer_token_counts(corpus, forced, target.cfg.vocab_size).double()
                counts = (SELF_VOCAB_WEIGHT * counts / counts.sum().clamp(min=1)
                          + (1 - SELF_VOCAB_WEIGHT) * other / other.sum().clamp(min=1))
            size = cfg.draft_vocab
            if cfg.vocab_coverage:  # measured on the held-out answers when there are enough of them
                held_counts = answer_token_counts(corpus, held, target.cfg.vocab_size)
                measured = held_counts if int(held_counts.sum()) >= MIN_MEASURED_TOKENS else None
                size = size_for_coverage(counts, cfg.vocab_coverage, measured)
                table = {"coverage_goal": cfg.vocab_coverage, "size": size,
                         "measured_on": "held-out answers" if measured is not None else "training answers",
                         "coverage": coverage_table(counts, measured=measured)}
                log.info("draft vocabulary sized by measurement: %d tokens for %.0f%% coverage (%s)", size,
                         100 * cfg.vocab_coverage, table["coverage"])
            vocab = draft_vocab_from_counts(counts, size)
            donor = donor_vocab(cfg)
            if donor is not None and (donor.numel() == 0 or int(donor.max()) >= target.cfg.vocab_size):
                donor = None  # not this model's token ids
            if cfg.vocab_coverage and donor is not None and measured is not None:
                # a warm start's donor vocabulary was counted on its own (often far larger) corpus: keep it when
                # it covers more of the held-out answers than this run's counts do
                ours, theirs = (float(measured[v].sum() / measured.sum()) for v in (vocab, donor))
                table.update(counted_heldout=round(ours, 4), donor_size=donor.numel(), donor_heldout=round(theirs, 4))
                if theirs > ours:
                    vocab = donor
                    table["size"] = int(donor.numel())
                    log.info("keeping the donor's draft vocabulary (%d tokens): it covers %.2f%% of held-out answers "
                             "against %.2f%% for this run's counts", donor.numel(), 100 * theirs, 100 * ours)
            if cfg.vocab_coverage:
                (cfg.run_dir / "draft_vocab.json").write_text(json.dumps(table, indent=1) + "\n")
            cover = float(counts[vocab].sum() / counts.sum().clamp(min=1e-9))
            log.info("draft vocabulary: %d tokens cover %.2f%% of (weighted) answer tokens", vocab.numel(),
                     100 * cover)
            vocab_path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(vocab, vocab_path)
    rms = feature_rms(corpus)
    return corpus, train, held, Frozen.build(target, vocab, rms)


def checkpoint_vocab(cfg: FitConfig, state: dict | None = None) -> torch.Tensor | None:
    """The draft vocabulary the run's checkpoint (``state``, if already loaded) was trained on (None: no
    checkpoint, or the full vocabulary; ``prepare`` tells them apart).

    Raises ConfigError for a checkpoint that predates recording it when draft_vocab.pt no longer matches."""
    path = cfg.checkpoint
    if state is None:
        if not path.is_file():
            return None
        state = torch.load(path, weights_only=False, map_location="cpu")
    if "draft_vocab" in state:
        return state["draft_vocab"]
    want = state.get("config", {}).get("draft_vocab")
    vocab_path = cfg.run_dir / "draft_vocab.pt"
    if not want:
        return None
    vocab = torch.load(vocab_path) if vocab_path.is_file() else None
    if vocab is None or vocab.numel() != want:
        raise ConfigError(f"{path} was trained on a {want}-token draft vocabulary that {vocab_path} no longer "
                          "holds: restore it, or start a new run")
    return vocab


def _save_ckpt(path: Path, state: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)


def donor_weights(path: Path) -> tuple[dict[str, torch.Tensor], int | None]:
    """The head weights (float32) and training steps of a checkpoint (.pt) or an exported bundle."""
    if path.suffix == ".pt":
        if not path.is_file():
            raise ConfigError(f"--init-from {path}: no such checkpoint")
        donor = torch.load(path, weights_only=False, map_location="cpu")
        return donor["head"], donor.get("step")
    if not path.with_suffix(".json").is_file() and not Path(f"{path}.json").is_file():
        raise ConfigError(f"--init-from {path}: no such checkpoint or draft bundle")
    _, tensors, _, meta = DraftBundle.read(path)
    return {k: v.float() for k, v in tensors.items()}, meta.get("training", {}).get("steps")


def donor_vocab(cfg: FitConfig) -> torch.Tensor | None:
    """The draft vocabulary of ``cfg.init_from`` when it is an exported bundle with one."""
    if cfg.init_from is None or cfg.init_from.suffix == ".pt":
        return None
    try:
        return DraftBundle.read(cfg.init_from)[2]
    except (OSError, WeightsError):
        return None


def fit(cfg: FitConfig, progress: bool = True) -> DraftHead:
    """Train (or continue training) the head of ``cfg.run_dir``; -> the trained head."""
    donor = donor_weights(cfg.init_from) if cfg.init_from is not None and not cfg.checkpoint.is_file() else None
    torch.set_num_threads(cfg.threads)
    target = load_target(cfg.model)
    corpus, train_idx, held_idx, fz = prepare(cfg, target)
    log.info("corpus: %d conversations (%d held out), %d answer tokens; feature RMS %.3f", len(corpus),
             len(held_idx), corpus.answer_tokens(), fz.feature_rms)
    head = DraftHead(target.cfg).reset_parameters(cfg.seed)
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    ckpt = cfg.checkpoint
    step, epoch, cursor, seen_tokens, spent_s = 0, 0, 0, 0, 0.0
    warm_start: dict | None = None  # {"from": donor file name, "steps": its step} for a warm-started run
    if ckpt.is_file():
        state = torch.load(ckpt, weights_only=False)
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["opt"])
        step, epoch, cursor, seen_tokens = state["step"], state["epoch"], state["cursor"], state["seen_tokens"]
        spent_s = state.get("train_seconds", 0.0)
        warm_start = state.get("warm_start")
        log.info("resuming from %s at step %d (epoch %d)", ckpt, step, epoch)
    elif donor is not None and cfg.init_from is not None:
        weights, donor_steps = donor
        head.load_state_dict(weights)
        warm_start = {"from": cfg.init_from.name, "steps": donor_steps}
        log.info("warm start from the head weights of %s", cfg.init_from)
    fixed = [i for i in train_idx if float(corpus.temperature[i]) < 0]
    # which self-distilled conversations this fit could see (a count would shift when stores are listed or grow
    # differently at evaluation: export.eval_indices)
    distilled_keys = sorted(k for k, t in zip(corpus.keys, corpus.temperature.tolist(), strict=True) if t >= 0)
    data = {"conversations": len(train_idx), "answer_tokens": corpus.answer_tokens(train_idx),
            "teacher_forced_conversations": len(fixed), "teacher_forced_answer_tokens": corpus.answer_tokens(fixed),
            "heldout_conversations": len(held_idx),
            # self-distilled conversations come first in the corpus: later ones are unseen by this fit
            "self_distilled_seen": len(distilled_keys)}
    keys = sorted(corpus.keys[i] for i in train_idx)
    by_key = {corpus.keys[i]: i for i in train_idx}

    def order(ep: int) -> list[str]:
        ks = keys.copy()
        random.Random(cfg.seed * 1000 + ep).shuffle(ks)
        return ks

    perm = order(epoch)
    timed = cfg.max_seconds is not None
    bar = tqdm(total=round(cfg.max_seconds) if timed else cfg.steps, initial=round(spent_s) if timed else step,
               desc="fit", unit="s" if timed else "step", disable=not progress, dynamic_ncols=True)
    running = StepStats()
    t0, session_tokens = time.perf_counter(), 0

    def spent() -> float:
        return spent_s + time.perf_counter() - t0

    head.train()
    # the end is decided once per step, by the same clock reading the checkpoint records: a budget that runs out
    # between two readings would otherwise stop the loop without saving the steps since the last checkpoint
    done = step >= cfg.steps or (timed and spent_s >= cfg.max_seconds)
    while not done:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg, spent())
        stats = StepStats()
        while not stats.targets or stats.targets[0] < cfg.tokens_per_step:
            if cursor >= len(perm):
                epoch, cursor = epoch + 1, 0
                perm = order(epoch)
            key = perm[cursor]
            cursor += 1
            ex = make_example(*corpus.conversation(by_key[key]), fz.in_vocab, cfg.max_prompt_context, cfg.max_len)
            if ex is None:
                continue
            loss, s = example_loss(head, ex, fz, cfg, train=True)
            if s.targets and s.targets[0]:
                (loss / cfg.tokens_per_step).backward()
            stats.add(s)
        torch.nn.utils.clip_grad_norm_(head.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        seen_tokens += stats.targets[0]
        session_tokens += stats.targets[0]
        running = stats if step == 1 else _ema(running, stats)
        now_s = spent()
        bar.update(min(round(now_s), bar.total) - bar.n if timed else 1)
        bar.set_postfix(step=step, loss=f"{stats.loss / max(1, stats.targets[0]):.3f}", ep=epoch,
                        top1="/".join(f"{a:.2f}" for a in running.accuracy()), refresh=False)
        done = step >= cfg.steps or (timed and now_s >= cfg.max_seconds)
        if step % cfg.ckpt_every == 0 or done:
            _save_ckpt(ckpt, {"head": head.state_dict(), "opt": opt.state_dict(), "step": step, "epoch": epoch,
                              "cursor": cursor, "seen_tokens": seen_tokens, "config": cfg.model_dump(mode="json"),
                              "data": data, "train_seconds": now_s,
                              "draft_vocab": fz.vocab, "warm_start": warm_start,
                              "self_distilled_keys": distilled_keys})
            log.info("step %d: loss/token %.4f, train top-1 per step %s, %.0f targets/s", step,
                     stats.loss / max(1, stats.targets[0]), [round(a, 3) for a in stats.accuracy()],
                     session_tokens / (time.perf_counter() - t0))
    bar.close()
    head.eval()
    return head


def _ema(old: StepStats, new: StepStats, keep: float = 0.9) -> StepStats:
    out = StepStats(loss=keep * old.loss + (1 - keep) * new.loss)
    n = max(len(old.targets), len(new.targets))
    out.targets = [round(keep * a + (1 - keep) * b) for a, b in zip(_pad(old.targets, n), _pad(new.targets, n),
                                                                     strict=True)]
    out.top1 = [round(keep * a + (1 - keep) * b) for a, b in zip(_pad(old.top1, n), _pad(new.top1, n), strict=True)]
    return out
