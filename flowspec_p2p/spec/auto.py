"""``auto`` on one device: speculative steps where they pay, plain autoregressive steps where they don't, decided
from this request's own measured costs as it decodes.

Both kinds of step work on the same KV cache, so switching costs nothing but the drafter's catch-up (the tokens
committed by AR steps are fed to it, with their target features, before the next speculative step). The decoder
keeps an exponentially weighted estimate of the seconds per committed token of each kind (a speculative step's
time counts its draft, tree forward, verification and that catch-up), runs the cheaper one, and re-measures the
other for a few steps now and then, less often each time it loses again (acceptance changes within a reply:
copied lists and code accept long paths, free prose short ones).

Lossless as both of its steps are: each step decodes the target's distribution given the committed prefix, and the
choice of the next step depends only on what is already committed (greedy: token for token equal to AR).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch
from pydantic import Field

from ..model.generate import GenStats, check_context, prefill_features
from ..model.sampling import SamplingParams, choose
from ..model.shard import Shard
from ..types import Settings
from .drafter import Drafter
from .shape import TreeShape
from .verify import verify_tree, walk_rows


class AutoConfig(Settings):
    probe_ar: int = Field(4, ge=1)  # AR steps that measure a token's cost (the first ones, and each re-probe)
    probe_spec: int = Field(6, ge=1)  # speculative steps of a probe
    recheck: int = Field(48, ge=1)  # tokens before the losing kind is probed again (doubling while it loses)
    max_recheck: int = Field(768, ge=1)
    weight: float = Field(0.3, gt=0.0, le=1.0)  # of the newest step in the running estimates


class _Cost:
    """Running seconds per committed token of one kind of step."""

    def __init__(self, weight: float):
        self.weight = weight
        self.per_token: float | None = None
        self.steps = 0
        self.tokens = 0
        self.seconds = 0.0

    def add(self, seconds: float, tokens: int) -> None:
        x = seconds / max(tokens, 1)
        self.per_token = x if self.per_token is None else self.per_token + self.weight * (x - self.per_token)
        self.steps += 1
        self.tokens += tokens
        self.seconds += seconds


class AutoDecoder:
    """A *decoder* as in generate.py: speculative or autoregressive steps, whichever this request measures faster."""

    mode = "auto"

    def __init__(self, model: Shard, drafter: Drafter, shape: TreeShape, max_context: int | None = None,
                 cfg: AutoConfig | None = None):
        assert model.has_embed
        assert model.has_head
        self.model = model
        self.drafter = drafter
        self.shape = shape
        self.max_context = max_context or model.max_position
        self.cfg = cfg or AutoConfig()

    @torch.inference_mode()
    def __call__(self, prompt, params: SamplingParams, max_new_tokens, stop_ids,
                 stats: GenStats) -> Iterator[list[int]]:
        budget = check_context(len(prompt), max_new_tokens, self.max_context)
        stats.prompt_tokens = len(prompt)
        if budget == 0:
            return
        model, drafter, cfg = self.model, self.drafter, self.cfg
        gen = None if params.greedy else params.generator()
        cache = model.new_cache(len(prompt) + budget + self.shape.total_tokens)
        drafter.reset(len(prompt) + budget + self.shape.draft_slots())
        ar, spec = _Cost(cfg.weight), _Cost(cfg.weight)
        t0 = time.perf_counter()
        feats = prefill_features(model, cache, prompt)  # [P, hidden]
        cache.commit(cache.pending)
        token = choose(model.logits(feats[-1]), params, gen)
        # committed tokens the drafter has not seen yet, with their target features (fed before a spec step)
        behind_tokens, behind_feats = list(prompt), [feats]
        stats.prefill_s = time.perf_counter() - t0
        stats.steps, stats.new_tokens = 1, 1
        kind, left = "ar", cfg.probe_ar  # the first steps measure AR; then a spec probe; then the cheaper kind
        recheck = {"ar": cfg.recheck, "spec": cfg.recheck}
        next_probe: int | None = None  # new_tokens at which the losing kind is probed again
        switches, last_spec = 0, False
        t1 = time.perf_counter()
        try:
            yield [token]
            while stats.new_tokens < budget and token not in stop_ids:
                remaining = budget - stats.new_tokens
                ts = time.perf_counter()
                if kind == "ar":
                    feat = model(torch.tensor([[token]]), cache)  # [1, 1, hidden]
                    cache.commit(1)
                    behind_tokens.append(token)
                    behind_feats.append(feat[0])
                    out = [choose(model.logits(feat[0, -1]), params, gen)]
                else:
                    drafter.feed(behind_tokens, torch.cat(behind_feats), token)
                    behind_tokens, behind_feats = [], []
                    if not last_spec:  # catching up after AR steps: their cost, not this step's
                        ts = time.perf_counter()
                    tree = drafter.draft(self.shape.capped(remaining - 1))
                    c = cache.committed
                    pos, mask = tree.positions(c)[None], tree.attention_mask(c)[None]  # [1, n], [1, n, c + n]
                    f = model(tree.tokens[None], cache, positions=pos, mask=mask)[0]  # [n, hidden]
                    rows = walk_rows(tree, len(tree), lambda idx, f=f: model.logits(f[idx]))
                    verdict = verify_tree(tree, rows, params, gen, stop_ids=stop_ids)
                    cache.keep(verdict.accepted)
                    cache.commit(len(verdict.accepted))
                    out = verdict.emitted(tree)[:remaining]
                    acc = torch.tensor(verdict.accepted)
                    behind_tokens, behind_feats = tree.tokens[acc].tolist(), [f[acc]]
                (ar if kind == "ar" else spec).add(time.perf_counter() - ts, len(out))
                last_spec = kind == "spec"
                stats.steps += 1
                stats.new_tokens += len(out)
                token = out[-1]
                yield out
                # what to run next: the rest of a probe, else the kind measured cheaper, else a due probe
                left -= 1
                if left > 0:
                    continue
                if spec.per_token is None:  # the first speculative probe, after the first AR steps
                    kind, left = "spec", cfg.probe_spec
                    continue
                best = "spec" if spec.per_token < ar.per_token else "ar"
                other = "ar" if best == "spec" else "spec"
                if kind != best:  # it lost (a probe, or the running kind fell behind): probe it later next time
                    recheck[kind] = min(2 * recheck[kind], cfg.max_recheck)
                if next_probe is not None and stats.new_tokens >= next_probe:
                    nxt, left, next_probe = other, cfg.probe_ar if other == "ar" else cfg.probe_spec, None
                else:
                    if next_probe is None:
                        next_probe = stats.new_tokens + recheck[other]
                    nxt, left = best, 1
                switches += nxt != kind
                kind = nxt
        finally:
            stats.decode_s = time.perf_counter() - t1
            stats.extra.update(
                auto={
                    "ar_steps": ar.steps, "ar_tokens": ar.tokens,
                    "spec_steps": spec.steps, "spec_tokens": spec.tokens,
                    "ar_ms_per_token": None if ar.per_token is None else round(1e3 * ar.per_token, 3),
                    "spec_ms_per_token": None if spec.per_token is None else round(1e3 * spec.per_token, 3),
                    "switches": switches,
                    "chose": "spec" if spec.tokens > ar.tokens else "ar",
                },
                tree=self.shape.model_dump(),
            )
