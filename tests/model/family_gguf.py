"""A tiny HF checkpoint of a newer family (qwen3, gemma3, phi3) written as GGUF the way llama.cpp's converter writes
it: its metadata keys, its tensor names (Gemma's pre-MLP norm as ``ffn_norm``, its norms as 1 + w; Phi-3's fused
``attn_qkv`` and gate|up ``ffn_up``, its LongRoPE factors as ``rope_factors_{long,short}`` tensors and the attention
factor in the metadata), no q/k permutation (these families rotate halves, as transformers does)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from flowspec_p2p.model.weights import _GGUF_GLOBAL, _GGUF_LAYER, _GGUF_LAYER_BY_ARCH

_HF_ARCH = {"gemma3_text": "gemma3"}


def write_family_gguf(path: Path, folder: Path, *, ftype: str = "F32", qtypes: dict | None = None) -> Path:
    """``folder`` (config.json + model.safetensors) as a GGUF at ``path``; tensors in ``ftype`` (F32 or F64), or
    ``qtypes[gguf name]`` (a GGML quantization type) for a matrix."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    arch = _HF_ARCH.get(cfg["model_type"], cfg["model_type"])
    layer = {**_GGUF_LAYER, **_GGUF_LAYER_BY_ARCH.get(arch, {})}
    to_gguf = {hf: g for g, hf in _GGUF_GLOBAL.items()}
    for i in range(cfg["num_hidden_layers"]):
        to_gguf |= {f"model.layers.{i}.{hf}": f"blk.{i}.{g}" for g, hf in layer.items()}
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // heads
    rope = cfg.get("rope_parameters") or {}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny {arch}")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(rope.get("full_attention", rope).get("rope_theta", 10000.0))
    w.add_vocab_size(cfg["vocab_size"])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    extra: list[tuple[str, np.ndarray]] = []
    if arch == "gemma3":
        w.add_sliding_window(cfg["sliding_window"])
        if cfg.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    elif arch == "phi3":
        w.add_rope_dimension_count(head_dim)
        w.add_sliding_window(cfg.get("sliding_window") or 0)
        if rope.get("rope_type") == "longrope":
            original = rope["original_max_position_embeddings"]
            w.add_rope_scaling_orig_ctx_len(original)
            scale = cfg["max_position_embeddings"] / original
            w.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(scale) / np.log(original))) if scale > 1 else 1.0)
            extra = [("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32)),
                     ("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))]
    np_dtype = {"F32": np.float32, "F64": np.float64}[ftype]
    for name, t in sorted(load_file(folder / "model.safetensors").items()):
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings", arch == "gemma3"):
            continue
        if arch == "gemma3" and name.endswith("norm.weight"):
            t = 1.0 + t.float()  # the converter stores Gemma's multiplier (in float32, as transformers computes it)
        arr = t.to(torch.float64).numpy()
        qtype = (qtypes or {}).get(to_gguf[name])
        if qtype is None:
            w.add_tensor(to_gguf[name], np.ascontiguousarray(arr.astype(np_dtype)))
        else:
            w.add_tensor(to_gguf[name], gguf.quants.quantize(arr.astype(np.float32), qtype), raw_dtype=qtype)
    for name, arr in extra:
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
