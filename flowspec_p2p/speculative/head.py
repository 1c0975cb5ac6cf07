"""EAGLE-style draft heads (EAGLE-1/2 design, arXiv 2401.15077 §4; speculative-decoding-notes §1.1): a trained head's
bundle on disk (``DraftBundle``: weights, draft vocabulary, what it was trained for) and finding the installed ones.
The network itself is model/draft_head.py's ``DraftHead`` (re-exported here); an engine runs it
(``Engine.draft_net``).

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

from .. import env
from ..errors import WeightsError
from ..model.arch import ModelConfig
from ..model.draft_head import DraftHead

log = logging.getLogger(__name__)

ASSETS = Path(__file__).parent / "assets"
FORMAT_VERSION = 1


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
