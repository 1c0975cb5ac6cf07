"""Shared builders: tiny random checkpoints of each supported architecture, and the real default model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from flowspec_p2p import env

# One thread: the suite runs beside agent subprocesses, and for tiny models OpenMP hand-offs cost more than the
# arithmetic (a 64x64 matmul: 45 us at 1 thread, ~9 ms at 2 on a loaded 2-core host).
torch.set_num_threads(1)

# The models folder (where scripts/bootstrap.sh pulled the default model) and the compiled engine stay put in tests
# that point FLOWSPEC_CACHE_DIR at a temporary folder, and in the agents they start (else each such test compiles the
# engine again: 30-60 s on 2 busy cores).
os.environ.setdefault(env.MODELS_DIR, str(env.models_dir()))
os.environ.setdefault(env.NATIVE_DIR, str(env.native_dir()))

TINY_ARCHS = ("llama", "qwen2", "mistral", "llama-untied", "llama3-rope", "qwen3", "gemma3", "phi3")
# Phi-3's tiny LongRoPE: the long factors take over from this position (a 40-token forward stays on the short ones,
# as transformers' whole-sequence forward does; decoding past it exercises the long ones)
PHI3_ORIGINAL_CONTEXT = 40


def tiny_hf_config(kind: str = "llama", **overrides):
    """A small transformers config of ``kind`` (see TINY_ARCHS); no downloads."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.1,
    )
    if kind == "qwen2":
        cfg = Qwen2Config(**{**common, **overrides})
    elif kind == "mistral":
        cfg = MistralConfig(**{**common, "sliding_window": None, **overrides})
    elif kind == "llama-untied":
        cfg = LlamaConfig(**{**common, "tie_word_embeddings": False, **overrides})
    elif kind == "llama3-rope":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        cfg = LlamaConfig(**{**common, "rope_parameters": rope, **overrides})
    elif kind == "qwen3":
        from transformers import Qwen3Config

        cfg = Qwen3Config(**{**common, "head_dim": 16, **overrides})
    elif kind == "gemma3":
        from transformers import Gemma3TextConfig

        # a window of 8 keys on three of the four layers, local and global rotary bases, a query_pre_attn_scalar
        # other than head_dim, logit soft-capping: every Gemma 3 option matters on a 40-token forward
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}
        cfg = Gemma3TextConfig(**{**common, "head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 8,
                                  "layer_types": ["sliding_attention", "sliding_attention", "full_attention",
                                                  "sliding_attention"], "rope_parameters": rope,
                                  "final_logit_softcapping": 3.0, "pad_token_id": 0, **overrides})
    elif kind == "phi3":
        from transformers import Phi3Config

        half = 8  # head_dim 16
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 1.0,
                "short_factor": [1.0 + 0.1 * i for i in range(half)],
                "long_factor": [1.5 + 0.5 * i for i in range(half)],
                "original_max_position_embeddings": PHI3_ORIGINAL_CONTEXT}
        cfg = Phi3Config(**{**common, "tie_word_embeddings": False, "rope_parameters": rope, "sliding_window": 12,
                            "original_max_position_embeddings": PHI3_ORIGINAL_CONTEXT, "pad_token_id": 0,
                            **overrides})
    else:
        cfg = LlamaConfig(**{**common, **overrides})
    cfg._attn_implementation = "sdpa"  # eager attention softmaxes in float32; sdpa stays in float64
    return cfg


def build_tiny_checkpoint(folder: Path, kind: str = "llama", seed: int = 0, dtype=torch.float64, **overrides):
    """Write a random tiny checkpoint (config.json + model.safetensors) to ``folder``; return the HF model."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_hf_config(kind, **overrides)).to(dtype).eval()
    with torch.no_grad():  # transformers initialises biases and norms to constants: make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    return model


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    out = {}
    for i, kind in enumerate(TINY_ARCHS):
        build_tiny_checkpoint(root / kind, kind, seed=i)
        out[kind] = root / kind
    return out


@pytest.fixture(scope="session")
def tiny_llama(tiny_checkpoints) -> Path:
    return tiny_checkpoints["llama"]


@pytest.fixture(scope="session")
def default_model():
    """The real packaged SmolLM2-135M (float32), loaded once per session."""
    from flowspec_p2p.model.load import load_model

    return load_model(None, dtype=torch.float32)


@pytest.fixture(scope="session")
def synth_model(tmp_path_factory) -> Path:
    """A small synthetic GGUF (model/synth.py): Llama-3.1-8B's architecture and Q4_K_M block mix at 16 layers of
    hidden 256 (MLP 2048: the layers outweigh the LM head, so a planner splits them), tied embeddings, the default
    model's tokenizer (~24 MB)."""
    from flowspec_p2p.model import synth

    out = tmp_path_factory.mktemp("synth") / "synth-llama-16x256.gguf"
    shape, label = synth.resolve_shape("llama-3.1-8b", None, layers=16, hidden=256, intermediate=2048, heads=4,
                                       kv_heads=2, head_dim=64, context=2048, tied=True)
    synth.write(out, shape, "Q4_K_M", label=label, progress=False)
    return out
