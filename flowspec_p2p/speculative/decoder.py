"""Single-device speculative decoding with EAGLE-2 draft trees (speculative-decoding-notes §1.3-1.6).

One *step*: draft a tree from the root (the last committed token, whose K/V is not computed yet), run the whole
tree through the target in one forward (positions = committed + depth, ancestor mask), verify it (verify.py),
keep the accepted path's K/V and drop the rest with the causal-consistent ``KVCache.keep``, stream the accepted
tokens plus the bonus token at once, and feed the newly committed tokens with their target features to the
drafter. The output equals autoregressive decoding (greedy: token for token; sampling: in distribution).

    steps  target forwards, the prefill included (a step always commits >= 1 token)
    tau    new_tokens / steps (bonus tokens included, as EAGLE counts it)
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import env
from ..errors import ConfigError
from ..ledger import Ledger
from ..model.engine import Shard
from ..model.generate import check_context, next_token, prefill_features
from ..model.kv_cache import KVCache
from ..model.sampling import PositionalDraws, SamplingParams
from . import eagle
from .drafter import Drafter, HeadDrafter, TreeShape
from .eagle3 import Eagle3Drafter, TappedTarget
from .head import DraftBundle, find_compatible_drafts, find_draft
from .ngram import LookupDrafter
from .tree import DraftTree
from .verify import Verdict, verify_walk

log = logging.getLogger(__name__)

# The default tree for the default model on a small CPU (docs/experiments.md, "The single-device tree on the native
# engine"): one drafted token and a prompt-lookup chain of up to 4. The engine's tree rows cost 0.25-0.6 of a token
# each, so a draft whose next-token guess is right half the time pays only with few rows; tune-tree writes one for
# this device to TUNING_FILE.
DEFAULT_TREE = TreeShape(total_tokens=2, depth=1, top_k=1, lookup=4)
TUNING_FILE = "tree_tuning.json"  # under env.cache_dir(): written by `flowspec tune-tree`, read by the CLI


def tuning_path() -> Path:
    return env.cache_dir() / TUNING_FILE


def tuned_tree(target_fingerprint: str | None, path: Path | None = None) -> TreeShape:
    """The tree `flowspec tune-tree` chose on this device for this target, else ``DEFAULT_TREE``."""
    p = path or tuning_path()
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError):
        return DEFAULT_TREE
    if target_fingerprint is not None and data.get("target_fingerprint") != target_fingerprint:
        return DEFAULT_TREE
    try:
        return TreeShape(**data["best"])
    except (KeyError, TypeError, ValueError):
        log.warning("ignoring malformed tree tuning file %s", p)
        return DEFAULT_TREE


# A fixed English probe for the tolerance test of a head trained on another build of the same model
PROBE_TEXT = (
    "The water cycle describes how water moves between the land, the oceans and the air. The sun heats the "
    "surface of lakes and seas, and water evaporates into vapour. As the vapour rises it cools and condenses "
    "into clouds. When the droplets grow heavy they fall back as rain or snow, and rivers carry the water to "
    "the sea, where the cycle begins again."
)
MIN_AGREEMENT = 0.15  # top-1 agreement on the probe below this: a head for another model (the shipped head scores
# 0.33 on its own model and on a requantized copy, a random head 0)


def load_drafter(target: Shard, target_fingerprint: str, draft: str | Path | None = None,
                 probe: list[int] | None = None,
                 whole_model: Callable[[], Shard] | None = None) -> tuple[Drafter, dict]:
    """The leader's drafter, with prompt-lookup candidates merged in (ngram.py). -> (drafter, metadata)

    The head is the one at ``draft`` (a bundle: a stem, .json or .safetensors; or a public EAGLE-1/2 checkpoint
    folder, eagle.py), else the bundle trained for these exact weights (``head.find_draft``), else a bundle or an
    installed EAGLE-1/2 checkpoint for a model of the same architecture (another quantization of the same model)
    that passes a tolerance test: its teacher-forced top-1 agreement with the target on ``probe`` (token ids of
    PROBE_TEXT) at least MIN_AGREEMENT, run on ``target`` or, where that holds only part of the layers (a cluster's
    leader), on ``whole_model()``. With no head, the drafter is prompt lookup alone. An EAGLE-3 head drafts from
    states of the target's middle layers, which only a whole model on one device has: ``load_spec``.
    ``metadata["match"]``: "given", "fingerprint", "architecture" or "none" (lookup only)."""
    if draft is not None:
        if eagle.is_checkpoint(Path(draft)):
            ckpt = eagle.read_checkpoint(draft)
            if ckpt.kind == "eagle3":
                raise ConfigError(f"{draft} is an EAGLE-3 head: it drafts from the states entering the target's "
                                  f"layers {list(ckpt.taps(target.cfg.num_layers))}, which a cluster's stages do not "
                                  "send to the leader; use it on one device (flowspec generate --draft)")
            return _eagle1_drafter(target, ckpt), {"format": "eagle1", "source": str(ckpt.path), "match": "given"}
        drafter, meta = _head_drafter(target, Path(draft))
        if meta.get("target_fingerprint") != target_fingerprint:
            log.warning("draft head %s was trained for another target; expect few accepted tokens", draft)
        return drafter, {**meta, "match": "given"}
    stem = find_draft(target_fingerprint)
    if stem is not None:
        drafter, meta = _head_drafter(target, stem)
        return drafter, {**meta, "match": "fingerprint"}
    on_probe = None  # the target's features and greedy tokens on the probe: one forward for every candidate
    candidates = [(stem.name, lambda stem=stem: _head_drafter(target, stem))
                  for stem in find_compatible_drafts(target.cfg)]
    candidates += [(c.path.name, lambda c=c: (_eagle1_drafter(target, c), {"format": "eagle1", "source": str(c.path)}))
                   for c in eagle.compatible(target.cfg, "eagle1")]
    for name, build in candidates:
        drafter, meta = build()
        if probe is None:
            log.warning("draft head %s matches this model's architecture; no probe to test it with: using it", name)
            return drafter, {**meta, "match": "architecture"}
        if on_probe is None:
            on_probe = _probe_forward(target if whole_model is None else whole_model(), probe)
        score = drafter.base.agreement(probe, *on_probe)
        if score >= MIN_AGREEMENT:
            log.info("draft head %s: trained for another build of this model (%s); top-1 agreement %.2f on the "
                     "probe text: using it", name, meta.get("target_fingerprint", "?")[:12], score)
            return drafter, {**meta, "match": "architecture", "agreement": round(score, 4)}
        log.info("draft head %s matches this model's architecture but agrees on only %.2f of the probe's tokens "
                 "(< %.2f): not used", name, score, MIN_AGREEMENT)
    log.info("no draft head for this model (fingerprint %s): speculation drafts by prompt lookup alone; "
             "`flowspec draft train --model PATH` makes a head for it", target_fingerprint[:12])
    return LookupDrafter(None), {"match": "none"}


def load_spec(target: Shard, source, target_fingerprint: str, draft: str | Path | None = None,
              probe: list[int] | None = None) -> tuple[Shard, Drafter, dict]:
    """The single-device decoders' target and drafter: ``load_drafter``'s, or an EAGLE-3 head (given, or installed
    for this architecture and passing the probe when no other head is found) with the whole-model ``target`` (of
    weights ``source``) cut at the layers it taps (eagle3.TappedTarget). -> (target to decode on, drafter, metadata)"""
    if draft is not None and eagle.is_checkpoint(Path(draft)) and eagle.read_checkpoint(draft).kind == "eagle3":
        ckpt = eagle.read_checkpoint(draft)
        tapped = TappedTarget.load(target, source, ckpt.taps(target.cfg.num_layers))
        return tapped, LookupDrafter(Eagle3Drafter.from_checkpoint(ckpt, tapped)), {
            "format": "eagle3", "source": str(ckpt.path), "match": "given"}
    drafter, meta = load_drafter(target, target_fingerprint, draft, probe)
    if meta["match"] != "none":
        return target, drafter, meta
    for ckpt in eagle.compatible(target.cfg, "eagle3"):
        tapped = TappedTarget.load(target, source, ckpt.taps(target.cfg.num_layers))
        head = Eagle3Drafter.from_checkpoint(ckpt, tapped)
        found = {"format": "eagle3", "source": str(ckpt.path), "match": "architecture"}
        if probe is None:
            return tapped, LookupDrafter(head), found
        score = head.agreement(probe, *_probe_forward(tapped, probe))
        if score >= MIN_AGREEMENT:
            log.info("EAGLE-3 head %s: top-1 agreement %.2f on the probe text: using it", ckpt.path.name, score)
            return tapped, LookupDrafter(head), {**found, "agreement": round(score, 4)}
        log.info("EAGLE-3 head %s agrees on only %.2f of the probe's tokens (< %.2f): not used", ckpt.path.name,
                 score, MIN_AGREEMENT)
    return target, drafter, meta


def _eagle1_drafter(target: Shard, ckpt: eagle.EagleCheckpoint) -> LookupDrafter:
    """A public EAGLE-1/2 head on the target's engine."""
    cfg, state = eagle.eagle1_state(ckpt, target.cfg)
    return LookupDrafter(HeadDrafter(target.engine.draft_net(cfg, state, target.max_position), target, None))


def _head_drafter(target: Shard, stem: Path) -> tuple[LookupDrafter, dict]:
    """The bundle at ``stem`` on the target's engine (the native engine runs the head with its own kernels)."""
    cfg, state, vocab, meta = DraftBundle.read(stem)
    head = target.engine.draft_net(cfg, state, target.max_position)
    return LookupDrafter(HeadDrafter(head, target, vocab)), meta


@torch.inference_mode()
def _probe_forward(target: Shard, probe: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """-> the target's features [P, hidden] at the probe's tokens and its greedy next token at each [P]"""
    feats = prefill_features(target, target.new_cache(len(probe)), probe)  # [P, hidden]
    return feats, target.greedy_tokens(feats)


def verify_step(model: Shard, cache: KVCache, tree: DraftTree, params: SamplingParams,
                gen: PositionalDraws | None, stop_ids: frozenset[int]) -> tuple[Verdict, torch.Tensor]:
    """One target forward over ``tree`` (rooted at the next position, cache.committed), the verification walk (LM-head
    rows only where it goes), and the cache cut to the accepted path and committed. -> (verdict, the tree's target
    features [n, hidden])"""
    c = cache.committed
    pos, mask = tree.positions(c)[None], tree.attention_mask(c)[None]  # [1, n], [1, n, c + n]
    f = model(tree.tokens[None], cache, positions=pos, mask=mask)[0]  # [n, hidden]
    verdict, _ = verify_walk(tree, len(tree), params, gen, logits=lambda idx: model.logits(f[idx]),
                             tokens=lambda idx: model.greedy_tokens(f[idx]), stop_ids=stop_ids, root_position=c)
    cache.keep(verdict.accepted)
    cache.commit(len(verdict.accepted))
    return verdict, f


def prefill_and_feed(model: Shard, cache: KVCache, drafter: Drafter, prompt: list[int], params: SamplingParams,
                     gen: PositionalDraws | None, ledger: Ledger) -> tuple[int, float]:
    """A speculative decoder's start: the prompt's prefill (committed to ``cache``), its first token, and the drafter
    fed the prompt with the target's features (the ledger's prefill: its seconds include the drafter's part).
    -> (the first new token, the drafter's seconds)"""
    t0 = time.perf_counter()
    feats = prefill_features(model, cache, prompt)  # [P, hidden]
    cache.commit(cache.pending)
    token = next_token(model, feats[-1], params, gen, len(prompt))
    td = time.perf_counter()
    drafter.feed(prompt, feats, token)
    end = time.perf_counter()
    ledger.prefilled(len(prompt), end - t0)
    return token, end - td


@dataclass
class SpecFigures:
    """SpecDecoder's own figures of a request: the drafter's seconds (feeding the prompt, then drafting and feeding
    during the decode) and the tree shape. In the stats: ``draft_share`` of the decode time and ``tree_nodes`` per
    step (the root included)."""

    shape: TreeShape
    draft_prefill_s: float = 0.0
    draft_s: float = 0.0

    def stats(self, ledger: Ledger) -> dict:
        decode_s, steps = ledger.attempt.decode_s, ledger.attempt_walks
        return dict(draft_prefill_s=round(self.draft_prefill_s, 4), draft_s=round(self.draft_s, 4),
                    draft_share=round(self.draft_s / decode_s, 4) if decode_s > 0 else None,
                    tree_nodes=round((ledger.attempt_drafted + steps) / steps, 2) if steps else 0.0,
                    tree=self.shape.model_dump())


class SpecDecoder:
    """Speculative decoding on a whole-model shard with a ``Drafter``; a *decoder* as in generate.py."""

    mode = "spec"

    def __init__(self, model: Shard, drafter: Drafter, shape: TreeShape = DEFAULT_TREE, max_context=None):
        assert model.has_embed
        assert model.has_head
        self.model = model
        self.drafter = drafter
        self.shape = shape
        self.max_context = max_context or model.max_position

    @torch.inference_mode()
    def __call__(
        self, prompt, params: SamplingParams, max_new_tokens, stop_ids, ledger: Ledger
    ) -> Iterator[list[int]]:
        budget = check_context(len(prompt), max_new_tokens, self.max_context)
        ledger.prompt_tokens = len(prompt)
        if budget == 0:
            return
        model, drafter = self.model, self.drafter
        gen = None if params.greedy else PositionalDraws(params.seed)  # (seed, position) -> the token
        capacity = len(prompt) + budget + self.shape.total_tokens
        cache = model.new_cache(capacity)
        drafter.reset(len(prompt) + budget + self.shape.draft_slots())
        token, fed_s = prefill_and_feed(model, cache, drafter, prompt, params, gen, ledger)
        fig = SpecFigures(self.shape, draft_prefill_s=fed_s)
        ledger.note(fig)
        t1 = time.perf_counter()
        try:
            yield [token]
            while (remaining := budget - ledger.attempt_tokens) > 0 and token not in stop_ids:
                # 1. draft (no deeper than the reply can still grow: at most remaining - 1 drafted + bonus)
                td = time.perf_counter()
                tree = drafter.draft(self.shape.capped(remaining - 1))
                fig.draft_s += time.perf_counter() - td
                # 2. one target forward over the whole tree; 3. verify, keep the accepted path's K/V
                verdict, f = verify_step(model, cache, tree, params, gen, stop_ids)
                out = verdict.emitted(tree)[:remaining]
                ledger.drafted(len(tree) - 1)  # node 0 is the decided root
                ledger.walked(len(out), min(verdict.confirmed, len(out)))
                token = out[-1]
                yield out
                # 4. the drafter learns the committed tokens with their real target features
                if ledger.attempt_tokens < budget and token not in stop_ids:
                    assert verdict.token is not None
                    td = time.perf_counter()
                    acc = torch.tensor(verdict.accepted)
                    drafter.feed(tree.tokens[acc].tolist(), f[acc], verdict.token)
                    fig.draft_s += time.perf_counter() - td
        finally:
            ledger.decoded(time.perf_counter() - t1)
