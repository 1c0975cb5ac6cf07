"""Single-device generation: the autoregressive decoder, and the text layer every decoder shares.

A *decoder* knows nothing about text: given prompt ids it yields the committed token ids, in chunks (one token
per chunk for autoregressive decoding, several for speculative modes), and appends what it does to the request's
``Ledger`` (ledger.py: prefill, steps, walks, timings; ``steps`` counts the prefill, so autoregressive τ = 1).
``stream_text`` turns any decoder's chunks into text deltas, applying stop strings; closing it stops the decoder.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from ..errors import ContextOverflow
from ..ledger import Ledger
from .engine import Shard
from .kv_cache import KVCache
from .sampling import PositionalDraws, SamplingParams, choose
from .tokenizer import Detokenizer, Tokenizer

PREFILL_CHUNK = 512  # prompt tokens per prefill forward: bounds the [n, n] attention scores


class Decoder(Protocol):
    def __call__(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        max_new_tokens: int,
        stop_ids: frozenset[int],
        ledger: Ledger,
    ) -> Iterator[list[int]]: ...


def check_context(prompt_len: int, max_new_tokens: int, limit: int) -> int:
    """Clamp ``max_new_tokens`` to the context limit; raise if the prompt alone does not fit."""
    if prompt_len == 0:
        raise ContextOverflow("the prompt is empty")
    if prompt_len >= limit:
        raise ContextOverflow(f"the prompt has {prompt_len} tokens; the context limit is {limit}")
    return max(0, min(max_new_tokens, limit - prompt_len))


def next_token(model: Shard, features: torch.Tensor, params: SamplingParams,
               gen: torch.Generator | PositionalDraws | None, position: int) -> int:
    """The token at absolute ``position`` from the target's ``features`` [hidden] there: ``choose`` from its logits;
    greedy asks the LM head for its argmax alone (Shard.greedy_tokens, equal to the logits' argmax), so no [vocab]
    row of logits is made."""
    if params.greedy:
        return int(model.greedy_tokens(features))
    return choose(model.logits(features), params, gen, position)


def prefill_features(model: Shard, cache: KVCache, prompt: Sequence[int]) -> torch.Tensor:
    """Run the prompt through ``model`` in chunks (K/V appended to ``cache``); -> the features of every prompt
    token [n, hidden]."""
    ids = torch.tensor([list(prompt)], dtype=torch.long)  # [1, n]
    outs = [model(ids[:, a : a + PREFILL_CHUNK], cache)[0] for a in range(0, ids.shape[1], PREFILL_CHUNK)]
    return torch.cat(outs)


class ARDecoder:
    """Plain autoregressive decoding on a whole-model shard: the reference every other mode must equal."""

    mode = "ar"

    def __init__(self, model: Shard, max_context: int | None = None):
        assert model.has_embed
        assert model.has_head
        self.model = model
        self.max_context = max_context or model.max_position

    @torch.inference_mode()
    def __call__(self, prompt, params, max_new_tokens, stop_ids, ledger: Ledger) -> Iterator[list[int]]:
        budget = check_context(len(prompt), max_new_tokens, self.max_context)
        ledger.prompt_tokens = len(prompt)
        if budget == 0:
            return
        gen = None if params.greedy else PositionalDraws(params.seed)  # (seed, position) -> the token
        cache = self.model.new_cache(len(prompt) + budget)
        t0 = time.perf_counter()
        feat = prefill_features(self.model, cache, prompt)[-1]
        token = next_token(self.model, feat, params, gen, len(prompt))
        ledger.prefilled(len(prompt), time.perf_counter() - t0)
        made = 1
        t1 = time.perf_counter()
        try:
            yield [token]
            while made < budget and token not in stop_ids:
                feat = self.model(torch.tensor([[token]]), cache)[0, -1]
                token = next_token(self.model, feat, params, gen, len(prompt) + made)
                ledger.stepped(1)
                made += 1
                yield [token]
        finally:
            ledger.decoded(time.perf_counter() - t1)


@dataclass
class Delta:
    token_ids: list[int]
    text: str


def stream_text(
    chunks: Iterator[list[int]],
    tokenizer: Tokenizer,
    stop_strings: Sequence[str] = (),
) -> Iterator[Delta]:
    """Text deltas of a decoder's chunks. Stops (and closes the decoder) at the first stop string."""
    detok = Detokenizer(tokenizer, stop_strings)
    try:
        for ids in chunks:
            text = detok.push(ids)
            if text or ids:
                yield Delta(list(ids), text)
            if detok.finished:
                return
        tail = detok.flush()
        if tail:
            yield Delta([], tail)
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()


def generate_ids(
    decoder: Decoder,
    prompt: Sequence[int],
    params: SamplingParams,
    max_new_tokens: int,
    stop_ids: frozenset[int] = frozenset(),
) -> tuple[list[int], Ledger]:
    """Run a decoder to the end; return all committed ids and the request's ledger (tests, benchmarks)."""
    ledger = Ledger(mode=getattr(decoder, "mode", "?"))
    out: list[int] = []
    for chunk in decoder(prompt, params, max_new_tokens, stop_ids, ledger):
        out.extend(chunk)
    return out, ledger
