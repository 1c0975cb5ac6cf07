"""Builders shared by the data-path tests: the tiny float64 model cut into a 3-stage ring, a byte tokenizer, and a
real Tokenizer over a word-level vocabulary (the tiny model's 96 ids) for the BOS rules of raw prompts."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flowspec_p2p.model.generate import ARDecoder, generate_ids
from flowspec_p2p.model.sampling import SamplingParams
from flowspec_p2p.model.tokenizer import Tokenizer
from flowspec_p2p.model.torch_shard import TorchShard
from flowspec_p2p.model.weights import open_source
from flowspec_p2p.types import LayerRange

F64 = torch.float64
CUTS = [(0, 1), (1, 3), (3, 4)]  # three stages of the 4-layer tiny model


@dataclass
class TinyParts:
    whole: TorchShard  # the whole model (reference decoder, oracle drafter)
    head: TorchShard  # the leader's piece: final norm + LM head (+ embedding)
    stages: list[TorchShard]  # stage 1 embeds; the last stage applies the final norm (returns features)
    stages_plain: list[TorchShard]  # no embedding on stage 1, no norm on stage N: the leader embeds and norms

    def reference(self, prompt, max_tokens, params=None, stop_ids=frozenset()):
        out, _ = generate_ids(ARDecoder(self.whole), prompt, params or SamplingParams(), max_tokens, stop_ids)
        return out


def tiny_parts(checkpoint) -> TinyParts:
    src = open_source(checkpoint)
    n = src.config.num_layers

    def cut(a, b, embed, head):
        return TorchShard.from_source(src, LayerRange(start=a, end=b), embed=embed, head=head, dtype=F64).eval()

    return TinyParts(
        whole=cut(0, n, True, True),
        head=cut(0, 0, True, True),
        stages=[cut(a, b, a == 0, b == n) for a, b in CUTS],
        stages_plain=[cut(a, b, False, False) for a, b in CUTS],
    )


class ByteTokenizer:
    """ids 0, 1, 2 = pad, bos, eos; 3..95 = the characters chr(32) .. chr(124). Enough for API tests."""

    stop_ids = frozenset({2})

    def encode(self, text: str) -> list[int]:
        return [ord(c) - 29 for c in text if 32 <= ord(c) <= 124]

    def encode_raw(self, text: str) -> list[int]:  # no BOS, as the default model's metadata says
        return self.encode(text)

    def decode(self, ids) -> str:
        return "".join(chr(i + 29) for i in ids if 3 <= i <= 95)

    def chat(self, messages) -> list[int]:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        return [1, *self.encode(text)]


WORDS = ["<pad>", "<bos>", "<eos>", *(f"w{i}" for i in range(3, 96))]  # "w7" is id 7


def word_tokenizer(post_bos: bool = False, add_bos: bool | None = None, template: str | None = None) -> Tokenizer:
    """A real ``Tokenizer`` over WORDS (whitespace-split): ``post_bos``, the backend's post-processor adds <bos>;
    ``add_bos``, the model's metadata flag; no ``template``: a base model, prompted raw."""
    import tokenizers
    from tokenizers import models, pre_tokenizers, processors

    backend = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(["<pad>", "<bos>", "<eos>"])
    if post_bos:
        backend.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    return Tokenizer(backend, chat_template=template, special={"bos_token": "<bos>", "eos_token": "<eos>"},
                     add_bos=add_bos)
