"""``auto`` on one device: speculative steps where they pay, plain autoregressive steps where they don't, and the
draft-tree budget that pays most, decided from this request's own measured costs as it decodes.

Both kinds of step work on the same KV cache, so switching costs nothing but the drafter's catch-up (the tokens
committed by AR steps are fed to it, with their target features, before the next speculative step). The decoder
keeps a running estimate of the seconds per committed token of each kind (decayed sums of seconds over decayed sums
of tokens; a speculative step's time counts the drafter's catch-up, its draft, tree forward and verification), for
AR steps and for speculative steps with each of a few tree budgets (the tuned one, a smaller and a larger one: a
tree's cost against the tokens it gets accepted is what the budget trades), runs the cheapest (yielding only to one
cheaper by a margin, so noise does not flip it), and re-measures the others for a few steps now and then, less
often each time one loses again (acceptance changes within a reply: copied lists and code accept long paths, free
prose short ones).

Lossless as both of its steps are: each step decodes the target's distribution given the committed prefix, and the
choice of the next step depends only on what is already committed (greedy: token for token equal to AR).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from pydantic import Field

from ..ledger import Ledger
from ..model.engine import Shard
from ..model.generate import check_context, next_token
from ..model.sampling import PositionalDraws, SamplingParams
from ..types import Settings
from .decoder import prefill_and_feed, verify_step
from .drafter import Drafter
from .shape import TreeShape


class AutoConfig(Settings):
    probe_ar: int = Field(3, ge=1)  # AR steps that measure a token's cost (the first ones, and each re-probe)
    probe_spec: int = Field(10, ge=1)  # speculative steps of a probe ...
    hopeless: float = Field(1.5, gt=1.0)  # ... cut short after two once it costs this many times the cheapest
    recheck: int = Field(64, ge=1)  # tokens before a losing kind is probed again (doubling while it loses)
    max_recheck: int = Field(768, ge=1)
    decay: float = Field(0.8, gt=0.0, lt=1.0)  # per step, of the seconds and tokens behind a running estimate
    margin: float = Field(0.05, ge=0.0)  # another kind must be this much cheaper before the running one yields
    variants: bool = True  # also measure a smaller and a larger tree than the given one


def tree_variants(shape: TreeShape) -> dict[str, TreeShape]:
    """The budgets auto measures on one device: the given tree, a smaller one (unless the given one is as small as
    a tree gets) and a larger one (two children per node at least: a wider chain is no larger)."""
    small = shape.model_copy(update={"total_tokens": max(2, shape.total_tokens // 2),
                                     "depth": max(1, shape.depth - 1), "top_k": max(1, shape.top_k // 2)})
    large = shape.model_copy(update={"total_tokens": 2 * shape.total_tokens, "depth": shape.depth + 1,
                                     "top_k": max(2, shape.top_k)})
    return {"given": shape, **({"smaller": small} if small != shape else {}), "larger": large}


class _Cost:
    """Running seconds per committed token of one kind of step."""

    def __init__(self, decay: float, recheck: int):
        self.decay = decay
        self.per_token: float | None = None  # decayed seconds over decayed tokens (a ratio, not a mean of ratios)
        self._s = self._n = 0.0
        self.steps = 0
        self.tokens = 0
        self.recheck = recheck  # tokens to wait before probing this kind again while it loses
        self.due = 0  # new_tokens at which it is probed again

    def add(self, seconds: float, tokens: int) -> None:
        self._s = self.decay * self._s + seconds
        self._n = self.decay * self._n + max(tokens, 1)
        self.per_token = self._s / self._n
        self.steps += 1
        self.tokens += tokens


@dataclass
class AutoFigures:
    """AutoDecoder's own figures of a request: the drafter's prompt feed, each kind's running cost (kind 0: AR; k:
    ``shapes[k - 1]``) and how often it switched; in the stats as ``draft_prefill_s`` and ``auto``."""

    shapes: list[TreeShape]
    costs: list[_Cost]
    draft_prefill_s: float = 0.0
    switches: int = 0

    def stats(self, ledger: Ledger) -> dict:
        costs, shapes = self.costs, self.shapes
        ran = max(range(len(costs)), key=lambda k: costs[k].tokens)
        return {"draft_prefill_s": round(self.draft_prefill_s, 4), "auto": {
            "ar_steps": costs[0].steps, "ar_tokens": costs[0].tokens,
            "spec_steps": sum(c.steps for c in costs[1:]), "spec_tokens": sum(c.tokens for c in costs[1:]),
            "ms_per_token": {("ar" if k == 0 else f"spec {_label(shapes[k - 1])}"):
                             None if c.per_token is None else round(1e3 * c.per_token, 3)
                             for k, c in enumerate(costs)},
            "switches": self.switches,
            "chose": "ar" if ran == 0 else "spec",
            "tree": None if ran == 0 else shapes[ran - 1].model_dump(),
        }}


class AutoDecoder:
    """A *decoder* as in generate.py: autoregressive or speculative steps (with one of ``tree_variants(shape)``),
    whichever this request measures cheapest per committed token."""

    mode = "auto"

    def __init__(self, model: Shard, drafter: Drafter, shape: TreeShape, max_context: int | None = None,
                 cfg: AutoConfig | None = None):
        assert model.has_embed
        assert model.has_head
        self.model = model
        self.drafter = drafter
        self.cfg = cfg or AutoConfig()
        variants = tree_variants(shape) if self.cfg.variants else {"given": shape}
        self.shapes = list(variants.values())
        # kind (1 + index into shapes) of the smaller and the larger tree, or None
        self.smaller, self.larger = (1 + list(variants).index(r) if r in variants else None
                                     for r in ("smaller", "larger"))
        self.max_context = max_context or model.max_position

    @torch.inference_mode()
    def __call__(self, prompt, params: SamplingParams, max_new_tokens, stop_ids,
                 ledger: Ledger) -> Iterator[list[int]]:
        budget = check_context(len(prompt), max_new_tokens, self.max_context)
        ledger.prompt_tokens = len(prompt)
        if budget == 0:
            return
        model, drafter, cfg, shapes = self.model, self.drafter, self.cfg, self.shapes
        gen = None if params.greedy else PositionalDraws(params.seed)  # (seed, position) -> the token
        cache = model.new_cache(len(prompt) + budget + max(s.total_tokens for s in shapes))
        drafter.reset(len(prompt) + budget + max(s.draft_slots() for s in shapes))
        costs = [_Cost(cfg.decay, cfg.recheck) for _ in range(1 + len(shapes))]  # kind 0: AR; k: shapes[k - 1]
        # the drafter reads the prompt with the prefill, as SpecDecoder's does: every speculative step needs it, and
        # charged to the first probe it would make speculation look slower than it runs
        token, fed_s = prefill_and_feed(model, cache, drafter, prompt, params, gen, ledger)
        fig = AutoFigures(shapes, costs, draft_prefill_s=fed_s)
        ledger.note(fig)
        # committed tokens the drafter has not seen yet, with their target features (fed before a spec step)
        behind_tokens: list[int] = []
        behind_feats: list[torch.Tensor] = []
        behind_ar = False  # whether they were committed by AR steps (a switch's catch-up), not by the last spec step
        kind, left = 0, cfg.probe_ar  # the first steps measure each kind in turn; then the cheapest runs
        t1 = time.perf_counter()
        try:
            yield [token]
            while (remaining := budget - ledger.attempt_tokens) > 0 and token not in stop_ids:
                ts = time.perf_counter()
                if kind == 0:
                    feat = model(torch.tensor([[token]]), cache)  # [1, 1, hidden]
                    cache.commit(1)
                    behind_tokens.append(token)
                    behind_feats.append(feat[0])
                    behind_ar = True
                    out = [next_token(model, feat[0, -1], params, gen, cache.committed)]  # the next position
                    ledger.stepped(1)
                else:
                    if behind_tokens:  # the drafter catches up on the tokens committed since the last spec step
                        drafter.feed(behind_tokens, torch.cat(behind_feats), token)
                        if behind_ar:  # after AR steps: a cost of switching, paid once per run of spec steps,
                            ts = time.perf_counter()  # not one of speculation's steps
                    behind_tokens, behind_feats, behind_ar = [], [], False
                    tree = drafter.draft(shapes[kind - 1].capped(remaining - 1))
                    verdict, f = verify_step(model, cache, tree, params, gen, stop_ids)
                    out = verdict.emitted(tree)[:remaining]
                    ledger.drafted(len(tree) - 1)  # node 0 is the decided root
                    ledger.walked(len(out), min(verdict.confirmed, len(out)))
                    acc = torch.tensor(verdict.accepted)
                    behind_tokens, behind_feats = tree.tokens[acc].tolist(), [f[acc]]
                costs[kind].add(time.perf_counter() - ts, len(out))
                token = out[-1]
                yield out
                # what to run next: the rest of a probe, else a kind never measured, else a due probe, else
                # the cheapest kind
                left -= 1
                probed = [c.per_token for c in costs if c.per_token is not None]
                if left > 0 and not (kind != 0 and costs[kind].steps >= 2
                                     and costs[kind].per_token > cfg.hopeless * min(probed)):
                    continue
                nxt = _next_kind(costs, kind, ledger.attempt_tokens, cfg.max_recheck, cfg.margin, self.smaller,
                                 self.larger)
                left = 1 if nxt == kind else (cfg.probe_ar if nxt == 0 else cfg.probe_spec)
                fig.switches += nxt != kind
                kind = nxt
        finally:
            ledger.decoded(time.perf_counter() - t1)


def _label(s: TreeShape) -> str:
    return f"{s.total_tokens}/{s.depth}/{s.top_k}"


def _next_kind(costs: list[_Cost], kind: int, done: int, max_recheck: int, margin: float = 0.0,
               smaller: int | None = None, larger: int | None = None) -> int:
    """After a run of ``kind`` ends with ``done`` tokens committed: the next kind to run. Kinds: 0 AR, 1 the given
    tree, ``smaller`` and ``larger`` the other trees (tree_variants) where there are. AR and the given tree are
    measured first; the smaller tree if the given one costs under 1.25x AR, the larger only if the given one beats
    AR (a bigger tree costs more per step: it can only pay where speculation already does)."""
    for k in (0, 1):
        if costs[k].per_token is None:
            return k
    measured = [k for k, c in enumerate(costs) if c.per_token is not None]
    best = min(measured, key=lambda k: costs[k].per_token)
    if costs[kind].per_token <= (1 + margin) * costs[best].per_token:
        best = kind  # within the margin: no switch on noise
    spec_best = min(measured[1:], key=lambda k: costs[k].per_token)
    if spec_best == 1 and smaller is not None and costs[smaller].per_token is None \
            and costs[1].per_token < 1.25 * costs[0].per_token:  # a smaller tree may pay where the given nearly does
        return smaller
    if (spec_best == 1 and larger is not None and costs[larger].per_token is None
            and costs[1].per_token < costs[0].per_token):
        return larger
    if kind != best:  # it lost (a probe, or the running kind fell behind): probe it again later, and the time
        c = costs[kind]  # after that later still
        c.due = done + c.recheck
        c.recheck = min(2 * c.recheck, max_recheck)
    for k in measured:
        if k != best and costs[k].due == 0:  # first time behind the best: schedule its probe
            costs[k].due = done + costs[k].recheck
    due = [k for k in measured if k != best and done >= costs[k].due]
    if due:
        k = min(due, key=lambda k: costs[k].due)
        costs[k].due = done + costs[k].recheck  # provisional: a losing probe pushes it further
        return k
    return best
