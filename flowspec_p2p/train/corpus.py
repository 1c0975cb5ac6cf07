"""The feature store in memory, the held-out split, the draft vocabulary, and EAGLE training examples.

EAGLE alignment (arXiv 2401.15077 §4; speculative-decoding-notes §1.2), for one conversation with tokens
x_0..x_{T-1} (prompt of P tokens, then the answer) and target features f_0..f_{T-2} (f_j predicts x_{j+1}):

    pair i          (f_i, x_{i+1}) at rotary position i: what the head consumes at draft position i
    step-k target   the unrolled head's k-th prediction from pair i estimates f_{i+k+1}; its token target is
                    the target's distribution softmax(f_{i+k+1} @ lm_head) (over the draft vocabulary), whose
                    greedy token is x_{i+k+2}
    loss mask       targets j = i+k+1 with P <= j <= T-2: features that predict answer tokens after the first
                    (the first comes from the target's prefill, never from the draft), and whose next token is
                    in the draft vocabulary

Held-out split: a conversation is held out when crc32(key) % 1000 < ``heldout_per_mille`` (stable as the
store grows).
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass

import torch

from .store import FeatureStore

HELDOUT_PER_MILLE = 50


@dataclass
class Corpus:
    keys: list[str]
    tokens: torch.Tensor  # [sum T_i] int64
    features: torch.Tensor  # [sum (T_i - 1), hidden] float16
    tok_off: torch.Tensor  # [n + 1]
    feat_off: torch.Tensor  # [n + 1]
    prompt_len: torch.Tensor  # [n]
    temperature: torch.Tensor  # [n]

    def __len__(self) -> int:
        return len(self.keys)

    def conversation(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """-> tokens [T], features [T - 1, hidden] (float16), prompt length."""
        a, b = int(self.tok_off[i]), int(self.tok_off[i + 1])
        c, d = int(self.feat_off[i]), int(self.feat_off[i + 1])
        return self.tokens[a:b], self.features[c:d], int(self.prompt_len[i])

    def answer_tokens(self, idx: list[int] | None = None) -> int:
        idx = range(len(self)) if idx is None else idx
        return sum(int(self.tok_off[i + 1] - self.tok_off[i] - self.prompt_len[i]) for i in idx)

    def split(self, heldout_per_mille: int = HELDOUT_PER_MILLE) -> tuple[list[int], list[int]]:
        """-> (train indices, held-out indices)"""
        train, held = [], []
        for i, k in enumerate(self.keys):
            (held if is_heldout(k, heldout_per_mille) else train).append(i)
        return train, held


def is_heldout(key: str, heldout_per_mille: int = HELDOUT_PER_MILLE) -> bool:
    """Whether the conversation of ``key`` is held out of training (stable as stores grow)."""
    return zlib.crc32(key.encode()) % 1000 < heldout_per_mille


def load_corpus(*stores: FeatureStore) -> Corpus:
    """Every conversation of ``stores``, concatenated (features stay float16: ~1.2 KB per token for H=576)."""
    keys, toks, feats, tl, fl, pl, temps = [], [], [], [], [], [], []
    for store, name in [(st, n) for st in stores for n in st.shard_names()]:
        t = store.load_shard(name)
        keys += json.loads((store.root / f"{name}.keys.json").read_text())
        toks.append(t["tokens"].long())
        feats.append(t["features"])
        tl.append(t["tok_off"][1:] - t["tok_off"][:-1])
        fl.append(t["feat_off"][1:] - t["feat_off"][:-1])
        pl.append(t["prompt_len"].long())
        temps.append(t["temperature"])
    hidden = stores[0].manifest["hidden"]
    if not keys:
        z = torch.zeros(0, dtype=torch.long)
        return Corpus([], z, torch.zeros(0, hidden, dtype=torch.float16), torch.zeros(1, dtype=torch.long),
                      torch.zeros(1, dtype=torch.long), z, torch.zeros(0))
    cat = torch.cat
    tok_off = torch.cat([torch.zeros(1, dtype=torch.long), cat(tl).cumsum(0)])
    feat_off = torch.cat([torch.zeros(1, dtype=torch.long), cat(fl).cumsum(0)])
    assert bool((tok_off[1:] - tok_off[:-1] - 1 == feat_off[1:] - feat_off[:-1]).all()), "store misaligned"
    return Corpus(keys, cat(toks), cat(feats), tok_off, feat_off, cat(pl), cat(temps))


def answer_token_counts(corpus: Corpus, idx: list[int], vocab_size: int) -> torch.Tensor:
    """How often each token is a draft target (an answer token after the first). -> [vocab] int64"""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for i in idx:
        tokens, _, p = corpus.conversation(i)
        counts += torch.bincount(tokens[p + 1 :], minlength=vocab_size)
    return counts


VOCAB_STEP = 1024  # draft vocabulary sizes ``size_for_coverage`` considers are multiples of this
VOCAB_LADDER = (1024, 2048, 4096, 8192, 12288, 16384, 24576, 32768)  # sizes ``coverage_table`` reports


def coverage_table(counts: torch.Tensor, sizes: tuple[int, ...] = VOCAB_LADDER,
                   measured: torch.Tensor | None = None) -> dict[int, float]:
    """Share of the ``measured`` answer tokens (default: the counted ones) that the ``size`` most frequent tokens
    by ``counts`` cover, per size (and for the full vocabulary). counts, measured: [vocab]"""
    measured = counts if measured is None else measured
    cum = measured.double()[counts.double().sort(descending=True, stable=True).indices].cumsum(0)
    total = float(cum[-1]) or 1.0
    return {n: round(float(cum[min(n, cum.numel()) - 1]) / total, 4) for n in (*sizes, counts.numel())
            if n <= counts.numel()}


def size_for_coverage(counts: torch.Tensor, coverage: float, measured: torch.Tensor | None = None) -> int:
    """The smallest multiple of VOCAB_STEP whose most frequent tokens (by ``counts``) cover ``coverage`` of the
    ``measured`` answer tokens (default: of ``counts`` itself), at most the full vocabulary. Measuring on held-out
    answers keeps a small corpus from picking a vocabulary that covers only its own tokens. counts, measured:
    [vocab]"""
    measured = counts if measured is None else measured
    order = counts.double().sort(descending=True, stable=True).indices
    cum = measured.double()[order].cumsum(0)
    need = int(torch.searchsorted(cum, coverage * float(cum[-1]))) + 1
    return min(counts.numel(), -(-need // VOCAB_STEP) * VOCAB_STEP)


def draft_vocab_from_counts(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The ``size`` most frequent token ids, ascending. -> [size] int64"""
    size = min(size, counts.numel())
    top = counts.sort(descending=True, stable=True).indices[:size]  # ties by id, as coverage_table counts them
    return top.sort().values


@dataclass
class Example:
    """One conversation cropped for training (see the module doc for the alignment)."""

    features: torch.Tensor  # [n, hidden] f_{c..c+n-1}: step-0 input features
    tokens: torch.Tensor  # [n + 2] x_c..x_{c+n+1}: pair i consumes tokens[i + 1]; target row r chooses tokens[r + 2]
    offset: int  # c: rotary position of pair 0
    prompt_len: int
    targets: torch.Tensor  # [n, hidden] f_{c+1..c+n}: targets[j] = f_{c+j+1}; last row valid only if in range
    valid: torch.Tensor  # [n] bool: targets[j] takes part in the loss (before the unroll shift)


def make_example(tokens: torch.Tensor, features: torch.Tensor, prompt_len: int, in_vocab: torch.Tensor | None,
                 max_prompt_context: int, max_len: int) -> Example | None:
    """Crop a conversation to at most ``max_prompt_context`` prompt pairs before the answer and ``max_len`` pairs.

    tokens: [T]; features: [T - 1, hidden]; in_vocab: [vocab] bool (draft vocabulary membership) or None.
    Pairs i = c..T-3 (the last pair (f_{T-3}, x_{T-2}) predicts f_{T-2}); step-0 target of pair i is f_{i+1}.
    """
    t = tokens.numel()
    c = max(0, prompt_len - 1 - max_prompt_context)
    end = min(t - 2, c + max_len)  # pairs c..end-1
    n = end - c
    if n <= 0:
        return None
    feats = features[c:end]  # [n, hidden]  f_c..f_{end-1}
    nxt = tokens[c : end + 2]  # [n + 2]  x_c..x_{end+1}; pair i uses nxt[i + 1]
    targets = features[c + 1 : end + 1]  # [n, hidden] f_{c+1}..f_end
    j = torch.arange(c + 1, end + 1)  # target feature indices
    valid = j >= prompt_len
    if in_vocab is not None:
        valid &= in_vocab[tokens[j + 1]]  # the token each target predicts must be draftable
    return Example(feats, nxt, c, prompt_len, targets, valid)
