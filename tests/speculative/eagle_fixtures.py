"""Public EAGLE heads written exactly as their authors publish them, for a tiny target, with their networks written
the way the EAGLE code builds them from transformers' modules (the references the loaders are checked against).

    EAGLE-1/2  config.json = the target's with num_hidden_layers 1; pytorch_model.bin (or model.safetensors) with
               fc.weight/fc.bias and layers.0.* of a transformers decoder layer without input_layernorm
    EAGLE-3    config.json with architectures ["LlamaForCausalLMEagle3"], draft_vocab_size; weights fc.weight [H, 3H],
               midlayer.* (q/k/v read 2H), midlayer.hidden_norm, norm.weight, lm_head.weight [V_d, H], d2t, t2d
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn


def _randomize(module: nn.Module, seed: int, std: float = 0.08) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g, dtype=p.dtype))


def _save(folder: Path, config: dict, state: dict[str, torch.Tensor], fmt: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    state = {k: v.detach().contiguous() for k, v in state.items()}
    if fmt == "bin":
        torch.save(state, folder / "pytorch_model.bin")
    else:
        save_file(state, str(folder / "model.safetensors"))
    return folder


class Eagle1Reference(nn.Module):
    """EAGLE-1's cnets.Model: fc([embed ; feature]) then transformers' decoder layer, its input norm an identity."""

    def __init__(self, hf_config, seed: int = 0):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
        from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

        layer_cls = Qwen2DecoderLayer if hf_config.model_type == "qwen2" else LlamaDecoderLayer
        h = hf_config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=True)
        self.layers = nn.ModuleList([layer_cls(hf_config, 0)])
        self.layers[0].input_layernorm = nn.Identity()  # EAGLE's layer 0 has no input norm
        self.rotary = LlamaRotaryEmbedding(hf_config)
        _randomize(self, seed)

    def forward(self, features: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """features, embeds: [1, n, H] (the pairs at positions 0..n-1, causal) -> predicted features [1, n, H]"""
        x = self.fc(torch.cat([embeds, features], dim=-1))
        pos = torch.arange(x.shape[1])[None]
        return self.layers[0](x, position_ids=pos, position_embeddings=self.rotary(x, pos))

    def published_state(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.state_dict().items() if not k.startswith("rotary")}


def write_eagle1(folder: Path, hf_config, *, fmt: str = "bin", seed: int = 0, dtype=torch.float64
                 ) -> Eagle1Reference:
    ref = Eagle1Reference(hf_config, seed).to(dtype).eval()
    config = {**hf_config.to_dict(), "num_hidden_layers": 1, "architectures": [
        "Qwen2ForCausalLM" if hf_config.model_type == "qwen2" else "LlamaForCausalLM"]}
    _save(folder, config, ref.published_state(), fmt)
    return ref


class Eagle3Reference(nn.Module):
    """EAGLE-3's cnets.Model and its LlamaDecoderLayeremb, from transformers' Llama attention / MLP / norms."""

    def __init__(self, hf_config, draft_ids: torch.Tensor, seed: int = 0):
        super().__init__()
        from transformers.models.llama.modeling_llama import (
            LlamaAttention,
            LlamaMLP,
            LlamaRMSNorm,
            LlamaRotaryEmbedding,
        )

        h, eps = hf_config.hidden_size, hf_config.rms_norm_eps
        heads, kv, hd = hf_config.num_attention_heads, hf_config.num_key_value_heads, h // hf_config.num_attention_heads
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.midlayer = nn.Module()
        self.midlayer.self_attn = LlamaAttention(hf_config, 0)
        for name, out in (("q_proj", heads * hd), ("k_proj", kv * hd), ("v_proj", kv * hd)):
            setattr(self.midlayer.self_attn, name, nn.Linear(2 * h, out, bias=False))  # q/k/v read [embed ; h]
        self.midlayer.mlp = LlamaMLP(hf_config)
        self.midlayer.hidden_norm = LlamaRMSNorm(h, eps)
        self.midlayer.input_layernorm = LlamaRMSNorm(h, eps)
        self.midlayer.post_attention_layernorm = LlamaRMSNorm(h, eps)
        self.norm = LlamaRMSNorm(h, eps)
        self.lm_head = nn.Linear(h, len(draft_ids), bias=False)
        self.rotary = LlamaRotaryEmbedding(hf_config)
        _randomize(self, seed)
        self.register_buffer("d2t", draft_ids - torch.arange(len(draft_ids)))  # offsets, as EAGLE-3 stores them
        t2d = torch.zeros(hf_config.vocab_size, dtype=torch.bool)
        t2d[draft_ids] = True
        self.register_buffer("t2d", t2d)

    def step(self, hidden: torch.Tensor, embeds: torch.Tensor, fuse: bool) -> torch.Tensor:
        """hidden: [1, n, 3H] (fuse) or [1, n, H]; embeds [1, n, H]; causal, positions 0..n-1 -> h [1, n, H]"""
        m = self.midlayer
        x = self.fc(hidden) if fuse else hidden
        pos = torch.arange(x.shape[1])[None]
        both = torch.cat([m.input_layernorm(embeds), m.hidden_norm(x)], dim=-1)
        attn, _ = m.self_attn(hidden_states=both, position_embeddings=self.rotary(x, pos), attention_mask=None)
        x = x + attn
        return x + m.mlp(m.post_attention_layernorm(x))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h))

    def published_state(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.state_dict().items() if not k.startswith("rotary")}


def write_eagle3(folder: Path, hf_config, draft_ids: torch.Tensor, *, fmt: str = "bin", seed: int = 0,
                 dtype=torch.float64) -> Eagle3Reference:
    ref = Eagle3Reference(hf_config, draft_ids, seed).to(dtype).eval()
    ref.d2t, ref.t2d = ref.d2t.long(), ref.t2d.bool()
    config = {**hf_config.to_dict(), "num_hidden_layers": 1, "architectures": ["LlamaForCausalLMEagle3"],
              "draft_vocab_size": len(draft_ids), "target_hidden_size": hf_config.hidden_size}
    _save(folder, config, ref.published_state(), fmt)
    return ref
