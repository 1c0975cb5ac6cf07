"""Token log-probabilities (ledger.TokenLogprob) in OpenAI's two shapes: the chat API's ``logprobs.content``
list and the legacy completions API's parallel lists. A token's text is its own decoding; ``bytes`` its UTF-8."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..ledger import TokenLogprob

Decode = Callable[[list[int]], str]


def _entry(decode: Decode, token: int, logprob: float) -> dict:
    text = decode([token])
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def chat_logprobs(entries: Sequence[TokenLogprob], decode: Decode) -> dict:
    """-> ``{"content": [{token, logprob, bytes, top_logprobs: [...]}, ...], "refusal": None}``"""
    content = [{**_entry(decode, e.token, e.logprob), "top_logprobs": [_entry(decode, t, lp) for t, lp in e.top]}
               for e in entries]
    return {"content": content, "refusal": None}


def completion_logprobs(entries: Sequence[TokenLogprob], decode: Decode, offset: int = 0) -> dict:
    """-> ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``; ``offset``: characters of the reply
    before the first of ``entries``."""
    tokens = [decode([e.token]) for e in entries]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{decode([t]): lp for t, lp in e.top} for e in entries], "text_offset": offsets}
