"""Public EAGLE heads as their authors publish them: a folder with the head's ``config.json`` and its weights
(``model.safetensors`` or ``pytorch_model.bin``, read with ``torch.load(weights_only=True)``: tensors only, no
code), for a target of a supported architecture.

    EAGLE-1/2   (arXiv 2401.15077; EAGLE-2 drafts dynamic trees with the same network) a ``config.json`` that is the
                target's with ``num_hidden_layers: 1``; weights ``fc.weight`` [H, 2H] (+ ``fc.bias``) and
                ``layers.0.*`` named as transformers names a Llama block, without ``input_layernorm`` (layer 0 of
                EAGLE has none). It is our own head's network (model/draft_head.py): the weights are renamed into
                its fused layout and run on the target's engine (``Engine.draft_net``), in a cluster too.
    EAGLE-3     (arXiv 2503.01840) ``architectures: ["LlamaForCausalLMEagle3"]``, ``draft_vocab_size``; weights
                ``fc.weight`` [H, 3H] fusing the target's hidden states entering three of its layers (low, middle,
                high: ``eagle_config.eagle_aux_hidden_state_layer_ids``, by default 2, L//2 and L-3), ``midlayer.*``
                (a block whose attention reads [norm(embed) ; hidden_norm(h)], 2H wide), ``norm.weight``, its own
                ``lm_head.weight`` [V_d, H] over a reduced draft vocabulary, ``d2t`` [V_d] (target id = draft id +
                d2t[draft id]) and ``t2d`` [V] (which target ids are in it). Run by eagle3.py on one device.

A head is matched to a target by architecture (hidden size, heads, head size, vocabulary) and, when found rather
than given, by the probe as our own bundles are (decoder.load_drafter).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from .. import env
from ..errors import ConfigError, UnsupportedModel, WeightsError
from ..model.arch import ModelConfig, config_from_hf
from ..model.draft_head import DraftHead
from .head import ASSETS

log = logging.getLogger(__name__)

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


@dataclass(frozen=True)
class EagleCheckpoint:
    """A public EAGLE head as read from its folder."""

    path: Path
    kind: str  # "eagle1" (EAGLE-1/2) or "eagle3"
    config: dict  # its config.json
    head: ModelConfig  # the head's own shapes (one layer)
    state: dict[str, torch.Tensor]  # as stored (names as published)

    @property
    def target_hidden(self) -> int:
        return int(self.config.get("target_hidden_size") or self.head.hidden_size)

    def taps(self, num_layers: int) -> tuple[int, ...]:
        """EAGLE-3: the target layers whose entering hidden states the head fuses (low, middle, high)."""
        ids = (self.config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        taps = tuple(int(i) for i in ids) if ids else (2, num_layers // 2, num_layers - 3)
        if any(not 1 <= i < num_layers for i in taps):
            raise UnsupportedModel(f"{self.path}: EAGLE-3 taps layers {list(taps)} of a {num_layers}-layer target; "
                                   f"they must lie in [1, {num_layers})")
        return taps

    def mismatch(self, target: ModelConfig) -> str | None:
        """Why this head cannot draft for ``target`` (None: the architecture matches)."""
        h = self.head
        if self.kind == "eagle3":
            want = {"hidden size": (self.target_hidden, target.hidden_size),
                    "vocabulary": (int(self.config.get("vocab_size", target.vocab_size)), target.vocab_size)}
            if "embed_tokens.weight" not in self.state:  # it embeds with the target's table
                want["head hidden size"] = (h.hidden_size, target.hidden_size)
        else:
            want = {"hidden size": (h.hidden_size, target.hidden_size), "heads": (h.num_heads, target.num_heads),
                    "kv heads": (h.num_kv_heads, target.num_kv_heads), "head size": (h.head_dim, target.head_dim),
                    "vocabulary": (h.vocab_size, target.vocab_size)}
        bad = [f"{k} {a} (the model's: {b})" for k, (a, b) in want.items() if a != b]
        return None if not bad else f"{self.path} was trained for another model: " + ", ".join(bad)


def is_checkpoint(path: Path) -> bool:
    path = Path(path)
    return path.is_dir() and (path / "config.json").is_file() and any((path / f).is_file() for f in WEIGHT_FILES)


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    state: dict[str, torch.Tensor] = {}
    if files:
        for f in files:
            with safe_open(str(f), "pt") as st:
                state |= {k: st.get_tensor(k) for k in st.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    elif (folder / "pytorch_model.bin").is_file():
        try:
            loaded = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
        except Exception as e:  # a pickle that is more than tensors is refused by weights_only
            raise WeightsError(f"{folder}/pytorch_model.bin is not a plain state dict of tensors: {e}") from None
        state = dict(loaded)
    else:
        raise WeightsError(f"{folder} holds no weights ({' or '.join(WEIGHT_FILES)})")
    return {k.removeprefix("model."): v for k, v in state.items()}


def read_checkpoint(folder: str | Path) -> EagleCheckpoint:
    """Read the head in ``folder``; raise WeightsError / UnsupportedModel for what is no EAGLE head we run."""
    folder = Path(folder).expanduser()
    if not is_checkpoint(folder):
        raise WeightsError(f"{folder} is no EAGLE checkpoint (config.json + {' or '.join(WEIGHT_FILES)})")
    config = json.loads((folder / "config.json").read_text())
    state = _weights(folder)
    eagle3 = "midlayer.self_attn.q_proj.weight" in state or "d2t" in state or any(
        "Eagle3" in a for a in config.get("architectures") or [])
    if eagle3:
        state = {k.replace("layers.0.", "midlayer.", 1) if k.startswith("layers.0.") else k: v
                 for k, v in state.items()}
        need = ("fc.weight", "midlayer.self_attn.q_proj.weight", "norm.weight", "lm_head.weight")
    else:
        need = ("fc.weight", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight")
    missing = [n for n in need if n not in state]
    if missing:
        raise WeightsError(f"{folder}: not an EAGLE{'-3' if eagle3 else ''} head, missing {', '.join(missing)}")
    head = config_from_hf({**config, "num_hidden_layers": 1})
    return EagleCheckpoint(path=folder, kind="eagle3" if eagle3 else "eagle1", config=config, head=head,
                           state=state)


def eagle1_state(ckpt: EagleCheckpoint, target: ModelConfig) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """An EAGLE-1/2 head as our DraftHead's config and state dict (``Engine.draft_net`` takes them)."""
    assert ckpt.kind == "eagle1"
    why = ckpt.mismatch(target)
    if why is not None:
        raise ConfigError(why)
    t = ckpt.state
    cfg = target.model_copy(update={
        "intermediate_size": ckpt.head.intermediate_size, "rms_eps": ckpt.head.rms_eps,
        "rope_theta": ckpt.head.rope_theta, "rope_scaling": ckpt.head.rope_scaling,
        "attention_bias": "layers.0.self_attn.q_proj.bias" in t})
    head = DraftHead(cfg)
    head.block.load_hf(t, "layers.0.")
    with torch.no_grad():
        head.fc.weight.copy_(t["fc.weight"])
        if "fc.bias" in t:
            head.fc.bias.copy_(t["fc.bias"])
        else:
            head.fc.bias.zero_()
    return cfg, {k: v.detach().clone() for k, v in head.state_dict().items()}


def installed(search: list[Path] | None = None) -> Iterator[Path]:
    """Every EAGLE checkpoint folder in ``search`` (default: the package's assets, then the cache folder's drafts/)."""
    for folder in search or [ASSETS, env.cache_dir() / "drafts"]:
        if folder.is_dir():
            yield from (p for p in sorted(folder.iterdir()) if is_checkpoint(p))


def compatible(target: ModelConfig, kind: str, search: list[Path] | None = None) -> Iterator[EagleCheckpoint]:
    """The installed checkpoints of ``kind`` whose architecture matches ``target`` (unreadable ones logged)."""
    for folder in installed(search):
        try:
            ckpt = read_checkpoint(folder)
        except (WeightsError, UnsupportedModel, ValueError, KeyError) as e:
            log.warning("skipping the EAGLE head in %s: %s", folder, e)
            continue
        if ckpt.kind == kind and ckpt.mismatch(target) is None:
            yield ckpt
