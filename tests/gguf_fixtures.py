"""Tiny GGUF files for the native engine's tests: a llama-family model whose every matrix is random valid blocks
of a chosen GGUF type (tests/model/native/reference.random_gguf), norms near one. The reference for such a model
is the torch Shard in float64 on the same file (it dequantizes the same bytes)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .model.native.reference import random_gguf

# K-quants need rows of a multiple of 256 columns: hidden 256, intermediate 512
TINY = dict(vocab=160, hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2, max_position=256)
LAYER_MATRICES = {  # GGUF name -> (rows, cols) as functions of the config
    "attn_q": lambda c: (c["heads"] * c["hidden"] // c["heads"], c["hidden"]),
    "attn_k": lambda c: (c["kv_heads"] * c["hidden"] // c["heads"], c["hidden"]),
    "attn_v": lambda c: (c["kv_heads"] * c["hidden"] // c["heads"], c["hidden"]),
    "attn_output": lambda c: (c["hidden"], c["hidden"]),
    "ffn_gate": lambda c: (c["intermediate"], c["hidden"]),
    "ffn_up": lambda c: (c["intermediate"], c["hidden"]),
    "ffn_down": lambda c: (c["hidden"], c["intermediate"]),
}


def write_random_gguf(path: Path, qtype: str = "Q4_1", *, embed_type: str = "Q8_0", tied: bool = True,
                      seed: int = 0, scale: float = 0.05, **overrides) -> Path:
    """A random llama GGUF at ``path``: every layer matrix of ``qtype``, the embedding of ``embed_type`` (tied to the
    LM head, or a separate ``output.weight`` of the same type)."""
    import gguf

    c = {**TINY, **overrides}
    rng = np.random.default_rng(seed)
    qt = gguf.GGMLQuantizationType
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"tiny random {qtype}")
    w.add_context_length(c["max_position"])
    w.add_embedding_length(c["hidden"])
    w.add_block_count(c["layers"])
    w.add_feed_forward_length(c["intermediate"])
    w.add_head_count(c["heads"])
    w.add_head_count_kv(c["kv_heads"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(c["vocab"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def matrix(name: str, kind: str, rows: int, cols: int, mscale: float = scale) -> None:
        if kind == "Q2_K":
            raw = random_q2_k(rows, cols, rng, mscale)
        else:
            raw = random_gguf(kind, rows, cols, rng, scale=mscale)  # [rows, row bytes]
        w.add_tensor(name, raw, raw_dtype=qt[kind])

    def norm(name: str) -> None:
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(c["hidden"])).astype(np.float32))

    matrix("token_embd.weight", embed_type, c["vocab"], c["hidden"], mscale=1.0)
    for i in range(c["layers"]):
        norm(f"blk.{i}.attn_norm.weight")
        norm(f"blk.{i}.ffn_norm.weight")
        for name, shape in LAYER_MATRICES.items():
            matrix(f"blk.{i}.{name}.weight", qtype, *shape(c))
    norm("output_norm.weight")
    if not tied:
        matrix("output.weight", embed_type, c["vocab"], c["hidden"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def random_q2_k(rows: int, cols: int, rng: np.random.Generator, scale: float) -> np.ndarray:
    """Random valid Q2_K bytes [rows, cols / 256 * 84] (a type the engine has no kernel for): random sub-scales
    and 2-bit quants, finite fp16 d and dmin (the last four bytes of each 84-byte block)."""
    nb = rows * cols // 256
    blocks = rng.integers(0, 256, (nb, 84), dtype=np.uint8)
    for off in (80, 82):
        d = rng.uniform(0.25, 1.0, nb) * scale / 16
        blocks[:, off:off + 2] = d.astype(np.float16).view(np.uint8).reshape(nb, 2)
    return blocks.reshape(rows, -1)


def requantized_copy(src: Path, dst: Path, qtype: str = "Q8_0", layers: int = 1) -> Path:
    """A copy of the GGUF ``src`` (every key, the tokenizer included) whose matrices in the first ``layers``
    blocks are dequantized and re-encoded as ``qtype``: another build of the same model, as a user would get by
    requantizing it, with different bytes and so a different fingerprint."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = gguf.GGUFValueType(field.types[0])
        sub = gguf.GGUFValueType(field.types[-1]) if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, field.contents(), vtype, sub_type=sub)
    target = gguf.GGMLQuantizationType[qtype]
    for t in reader.tensors:
        block = t.name.split(".")
        requant = (block[0] == "blk" and int(block[1]) < layers and t.name.endswith(".weight")
                   and len(t.shape) == 2 and t.tensor_type != target)
        if requant:
            values = gguf.quants.dequantize(t.data, t.tensor_type)  # [rows, cols] float32
            raw = gguf.quants.quantize(values, target)
            w.add_tensor(t.name, raw, raw_dtype=target)
        else:
            w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst
