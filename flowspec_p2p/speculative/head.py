"""EAGLE-style draft head (EAGLE-1/2 design, arXiv 2401.15077 §4; speculative-decoding-notes §1.1).

Glossary:
    feature f_t      the target's final-normed hidden state at position t (input of its LM head)
    pair (f_t, x_t+1) what the head consumes at draft position t: the feature of token t and the embedding of
                     the *next* token (the "shifted token"); from it the head predicts f_t+1
    draft vocabulary the V_d most frequent target tokens; drafting scores only those (the LM head is ~80% of a
                     draft step on SmolLM2). Lossless regardless: the target verifies over its full vocabulary.

    h     = fc([embed(x_t+1) ; f_t])                 fc: 2H -> H (bias)
    f^t+1 = DecoderBlock(h)  (no input norm, as EAGLE's layer 0; the same block code as the target)
    logits = f^t+1 @ lm_head[draft vocab]^T          (the target's frozen LM head)

Positions: the pair at draft position t uses rotary position t. The head keeps its own one-layer KV cache.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from .. import env
from ..errors import WeightsError
from ..model.arch import ModelConfig
from ..model.kv_cache import KVCache
from ..model.shard import DecoderBlock, Rotary

log = logging.getLogger(__name__)

ASSETS = Path(__file__).parent / "assets"
FORMAT_VERSION = 1


class DraftHead(nn.Module):
    """The trainable part of the drafter: ``fc`` and one decoder block. Embedding and LM head are the target's."""

    def __init__(self, cfg: ModelConfig, max_position: int = 4096):
        super().__init__()
        h = cfg.hidden_size
        self.cfg = cfg
        self.fc = nn.Linear(2 * h, h, bias=True)
        self.block = DecoderBlock(cfg, input_norm=False)
        self.max_position = max_position
        self._rotary: Rotary | None = None
        self.reset_parameters()

    def reset_parameters(self, seed: int = 0, std: float = 0.02) -> DraftHead:
        """Random init for training: fc and the block's matrices ~ N(0, std), biases zero, norms one."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in (self.fc.weight, self.block.wqkv, self.block.wo, self.block.w13, self.block.w2):
                p.copy_(torch.randn(p.shape, generator=g) * std)
            for p in (self.fc.bias, self.block.bqkv):
                if p is not None:
                    p.zero_()
            self.block.mlp_norm.weight.fill_(1.0)
        return self

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def rotary(self) -> Rotary:
        dtype = self.dtype
        if self._rotary is None or self._rotary.cos.dtype != dtype:
            self._rotary = Rotary(self.cfg, self.max_position, dtype)
        return self._rotary

    def new_cache(self, capacity: int, batch: int = 1) -> KVCache:
        c = self.cfg
        return KVCache(1, c.num_kv_heads, c.head_dim, capacity, batch=batch, dtype=self.dtype)

    def forward(
        self,
        features: torch.Tensor,  # [batch, n, hidden]  f_t (target features, or the head's own predictions)
        next_embeds: torch.Tensor,  # [batch, n, hidden]  embed(x_t+1)
        positions: torch.Tensor,  # [batch, n]  t
        cache: KVCache | None = None,
        mask: torch.Tensor | None = None,  # [batch, n, cache.length + n] bool, or None (causal)
    ) -> torch.Tensor:
        """-> predicted features f^_t+1 [batch, n, hidden]. Appends to ``cache`` when given."""
        x = self.fc(torch.cat([next_embeds, features], dim=-1))
        _b, n, _ = x.shape
        cos, sin = self.rotary().gather(positions)
        start = 0 if cache is None else cache.reserve(n)
        attn_mask, causal = None, False
        if mask is not None:
            attn_mask = mask.unsqueeze(1)
        elif n > 1:
            if start == 0:
                causal = True
            else:
                attn_mask = torch.ones(n, start + n, dtype=torch.bool).tril(start)[None, None]
        out = self.block(x, cos, sin, None if cache is None else (cache, 0, start), attn_mask, causal)
        if cache is not None:
            cache.advance(n)
        return out


@dataclass
class DraftBundle:
    """A trained head plus what it was trained for. ``meta`` keys: format, target_fingerprint, target_config,
    draft_vocab_size, and what export records (data, training, heldout_top1, ...; train/export.py)."""

    head: DraftHead
    draft_vocab: torch.Tensor | None  # [V_d] int64 target token ids, or None for the full vocabulary
    meta: dict

    def save(self, stem: Path, dtype: torch.dtype = torch.float32) -> None:
        """Write ``stem.safetensors`` (weights in ``dtype``, draft vocabulary) and ``stem.json`` (metadata).
        ``load`` restores any stored dtype to the one it is asked for (float16 halves the file)."""
        stem = Path(stem)
        stem.parent.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().to(dtype).contiguous() for k, v in self.head.state_dict().items()}
        if self.draft_vocab is not None:
            tensors["draft_vocab"] = self.draft_vocab.to(torch.int64).contiguous()
        save_file(tensors, str(stem.with_suffix(".safetensors")))
        meta = {**self.meta, "format": FORMAT_VERSION, "weights_dtype": str(dtype).removeprefix("torch."),
                "draft_vocab_size": None if self.draft_vocab is None else int(self.draft_vocab.numel()),
                "target_config": json.loads(self.head.cfg.canonical_json())}
        stem.with_suffix(".json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")

    @staticmethod
    def read(stem: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], torch.Tensor | None, dict]:
        """The stored bundle as it is on disk: (target config, head state_dict in its stored dtype, draft
        vocabulary or None, metadata)."""
        stem = Path(stem)
        if stem.suffix in (".json", ".safetensors"):
            stem = stem.with_suffix("")
        meta_path = stem.with_suffix(".json")
        if not meta_path.is_file():
            raise WeightsError(f"draft head metadata {meta_path} not found")
        meta = json.loads(meta_path.read_text())
        with safe_open(str(stem.with_suffix(".safetensors")), "pt") as f:  # one tensor at a time: no whole-file copy
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
        vocab = tensors.pop("draft_vocab", None)
        return ModelConfig(**meta["target_config"]), tensors, vocab, meta

    @classmethod
    def load(cls, stem: Path, dtype: torch.dtype = torch.float32) -> DraftBundle:
        cfg, tensors, vocab, meta = cls.read(stem)
        head = DraftHead(cfg)
        head.load_state_dict({k: v.to(torch.float32) for k, v in tensors.items()})
        return cls(head.to(dtype).eval(), vocab, meta)


def _installed(search: list[Path] | None) -> Iterator[tuple[Path, dict]]:
    """(stem, metadata) of every draft head in ``search`` (default: the package's shipped assets, then
    ~/.cache/flowspec_p2p/drafts), in that order."""
    for folder in search or [ASSETS, env.cache_dir() / "drafts"]:
        if not folder.is_dir():
            continue
        for meta_path in sorted(folder.glob("*.json")):
            try:
                meta = json.loads(meta_path.read_text())
            except (OSError, ValueError):
                log.warning("unreadable draft metadata %s", meta_path)
                continue
            if isinstance(meta, dict) and meta_path.with_suffix(".safetensors").is_file():
                yield meta_path.with_suffix(""), meta


def find_draft(target_fingerprint: str, search: list[Path] | None = None) -> Path | None:
    """The stem of a draft head trained for exactly ``target_fingerprint`` (the same weights), or None."""
    for stem, meta in _installed(search):
        if meta.get("target_fingerprint") == target_fingerprint:
            return stem
    return None


def find_compatible_drafts(target: ModelConfig, search: list[Path] | None = None) -> list[Path]:
    """Stems of draft heads trained for a model of the same architecture as ``target`` (the same config: layer
    shapes, vocabulary size, rotary settings): another quantization of the same model is such a model, and so is a
    fine-tune; a tolerance test on the loaded weights (``HeadDrafter.agreement``) tells them apart."""
    want = json.loads(target.canonical_json())
    return [stem for stem, meta in _installed(search) if meta.get("target_config") == want]
