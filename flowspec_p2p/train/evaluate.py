"""Held-out evaluation of a draft head on stored features.

    top1[k]          step-k top-1 agreement with the target over the draft vocabulary (teacher-forced tokens,
                     the head's own features; EAGLE's "k-alpha"), on every held-out answer target whose token is
                     in the draft vocabulary
    vocab_coverage   share of held-out answer tokens inside the draft vocabulary (a ceiling on acceptance)
    chain            greedy chain drafting on the greedy (T=0) held-out conversations: from each start, the
                     number of leading steps whose draft token (mapped to target ids) equals the target's
                     greedy token. accept[k] = P(step k accepted | steps < k accepted); a chain of depth D
                     yields tau = 1 + E[min(accepted, D)] tokens per target forward (bonus included)
    t1_accept[k]     mean target probability (T=1) of the step-k draft token given a correct prefix: the
                     acceptance rate of a one-token draft at temperature 1
"""

from __future__ import annotations

import torch
from tqdm import tqdm

from ..speculative.head import DraftHead
from .corpus import Corpus, make_example
from .fit import FitConfig, Frozen, StepStats, example_loss
from .unroll import unrolled


class _Tally:
    """Running sums of one group of held-out conversations (see the module doc for what each figure means)."""

    def __init__(self, depth: int):
        self.depth = depth
        self.convs = 0
        self.topk = StepStats()
        self.accepted: list[torch.Tensor] = []  # per start: accepted chain length (0..depth)
        self.t1_sum = [0.0] * depth
        self.t1_n = [0] * depth
        self.loss_sum, self.loss_n = 0.0, 0
        self.covered, self.answer_targets = 0, 0  # answer tokens (after the first) inside the draft vocabulary

    def result(self) -> dict:
        acc = torch.cat(self.accepted) if self.accepted else torch.zeros(0, dtype=torch.long)
        chain_accept = []
        for k in range(self.depth):
            reached = int((acc >= k).sum())
            chain_accept.append(round(int((acc >= k + 1).sum()) / reached, 4) if reached else 0.0)
        return {
            "heldout_conversations": self.convs,
            "heldout_targets": self.topk.targets[0] if self.topk.targets else 0,
            "heldout_loss": round(self.loss_sum / max(1, self.loss_n), 4),
            "heldout_top1": [round(a, 4) for a in self.topk.accuracy()],
            "vocab_coverage": round(self.covered / max(1, self.answer_targets), 4),
            "chain_starts": int(acc.numel()),
            "chain_accept": chain_accept,
            "chain_tau": {d: round(1 + float(acc.clamp(max=d).float().mean()), 4) if acc.numel() else 1.0
                          for d in range(1, self.depth + 1)},
            "t1_accept": [round(s / n, 4) if n else 0.0 for s, n in zip(self.t1_sum, self.t1_n, strict=True)],
        }


@torch.no_grad()
def evaluate(head: DraftHead, corpus: Corpus, idx: list[int], fz: Frozen, cfg: FitConfig, depth: int | None = None,
             progress: bool = False, groups: dict[str, str] | None = None) -> dict:
    """-> the figures of the module doc over ``idx``; with ``groups`` (conversation key -> group name, e.g. the
    pool's category) also ``by_group``: the same figures per group."""
    depth = depth or max(cfg.unroll, 4)
    ecfg = cfg.model_copy(update={"unroll": depth})
    head.eval()
    total = _Tally(depth)
    by_group: dict[str, _Tally] = {}
    for i in tqdm(idx, desc="eval", unit="conv", disable=not progress, dynamic_ncols=True):
        tallies = [total]
        if groups is not None:
            name = groups.get(corpus.keys[i], "other")
            tallies.append(by_group.setdefault(name, _Tally(depth)))
        tokens, feats, p = corpus.conversation(i)
        ex = make_example(tokens, feats, p, fz.in_vocab, ecfg.max_prompt_context, 10**9)
        if ex is None:
            continue
        # chains: every start i whose depth targets all lie in the answer (draft vocab not required); the same
        # pairs as ``ex`` (only the loss mask differs), so the head's unrolled predictions serve both
        raw = make_example(tokens, feats, p, None, ecfg.max_prompt_context, 10**9)
        n = raw.features.shape[0]
        nxt = torch.zeros(n + depth - 1, dtype=torch.long)
        m = min(n + depth - 1, raw.tokens.numel() - 1)
        nxt[:m] = raw.tokens[1 : m + 1]
        outs = unrolled(head, raw.features.float(), fz.embed[nxt], raw.offset, depth)
        loss, s = example_loss(head, ex, fz, ecfg, train=False, outs=outs)
        chosen = raw.tokens[2:][raw.valid]  # tokens the answer targets choose
        covered = chosen.numel() if fz.in_vocab is None else int(fz.in_vocab[chosen].sum())
        for t in tallies:
            t.convs += 1
            t.topk.add(s)
            t.loss_sum += float(loss)
            t.loss_n += s.targets[0] if s.targets else 0
            t.answer_targets += chosen.numel()
            t.covered += covered
        starts = torch.nonzero(raw.valid[: max(0, n - depth + 1)])[:, 0]  # [s]
        if starts.numel() == 0:
            continue
        hits = []
        for k, g in enumerate(outs):
            logits = g[starts] @ fz.lm_head  # [s, V_d]
            draft = logits.argmax(-1)
            if fz.vocab is not None:
                draft = fz.vocab[draft]
            truth = raw.tokens[starts + k + 2]  # x_{c+i+k+2}: the token f_{c+i+k+1} chooses
            hits.append(draft == truth)
            probs = (raw.targets[starts + k].float() @ fz.full_head).softmax(-1)  # [s, vocab]: full target dist
            pk = probs.gather(1, draft[:, None])[:, 0]
            ok = torch.stack(hits[:k]).all(0) if k else torch.ones_like(pk, dtype=torch.bool)
            for t in tallies:
                t.t1_sum[k] += float(pk[ok].sum())
                t.t1_n[k] += int(ok.sum())
        if float(corpus.temperature[i]) == 0.0:
            h = torch.stack(hits, 1).int()  # [s, depth]
            for t in tallies:
                t.accepted.append(h.cumprod(1).sum(1))
    out = total.result()
    out["heldout_conversations"] = len(idx)
    if groups is not None:
        out["by_group"] = {name: by_group[name].result() for name in sorted(by_group)}
    return out
