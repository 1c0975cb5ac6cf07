"""Synthetic GGUF models: a real architecture's tensor names, shapes, block types and metadata, filled with
deterministic pseudo-random weights, for the paths that only matter at sizes no test can download (fetching,
memory, planning, load times at several GB).

    shape        a model's dimensions (``SHAPES`` by name: the shapes of Llama-3.1-8B, Qwen2.5-7B, Llama-3.2-1B, ...;
                 or any layers/hidden/... given)
    file type    a llama.cpp quantisation mix by name (``FILE_TYPES``): Q4_K_M is Q4_K everywhere but Q6_K for the
                 LM head and for attn_v and ffn_down in the layers llama.cpp gives more bits (``use_more_bits``)
    block        one quantised block of a tensor: random quant bytes, finite fp16 scales of random sign whose size
                 gives the dequantised weights a standard deviation of about 1/sqrt(columns) (so activations stay
                 bounded through the layers), norms exactly one

The tokenizer (and its chat template) is the default model's, copied entry by entry, so the vocabulary is the
default model's. The metadata says the file is synthetic (``SYNTHETIC_KEY``); ``is_synthetic`` reads it, and
``flowspec generate`` warns that such a model's text is meaningless. ``write`` streams to disk a chunk of rows at a
time (never the whole model in memory) into ``PATH.part``, renamed to PATH once complete; the same arguments give
the same bytes. llama.cpp loads these files (bench/scale.py runs it on one).
"""

from __future__ import annotations

import functools
import logging
import math
import mmap
import os
import struct
import sys
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ConfigError

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger(__name__)

SYNTHETIC_KEY = "flowspec.synthetic"
ALIGNMENT = 32
CHUNK_BYTES = 16 << 20  # bytes of a tensor generated and written at a time
NORM_BIAS_STD = 0.02  # qwen2's q/k/v biases


@dataclass(frozen=True)
class Shape:
    """A decoder's dimensions, as a GGUF file's metadata spells them."""

    arch: str  # llama | qwen2 | mistral
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    context: int = 4096
    tied: bool = False  # the LM head is the token embedding
    bias: bool = False  # q/k/v projections carry biases (qwen2)
    llama3_rope: tuple[float, float, float, int] | None = None  # factor, low, high, original context

    def check(self) -> Shape:
        for name in ("layers", "hidden", "intermediate", "heads", "kv_heads", "head_dim", "context"):
            if getattr(self, name) < 1:
                raise ConfigError(f"a synthetic model's {name} must be at least 1")
        if self.heads % self.kv_heads:
            raise ConfigError(f"{self.heads} heads cannot share {self.kv_heads} KV heads evenly")
        if self.head_dim % 2:
            raise ConfigError("the head dimension must be even (rotary pairs)")
        return self


SHAPES: dict[str, Shape] = {
    "llama-3.1-8b": Shape("llama", 32, 4096, 14336, 32, 8, 128, 1e-5, 500000.0, 131072,
                          llama3_rope=(8.0, 1.0, 4.0, 8192)),
    "llama-3.2-1b": Shape("llama", 16, 2048, 8192, 32, 8, 64, 1e-5, 500000.0, 131072, tied=True,
                          llama3_rope=(32.0, 1.0, 4.0, 8192)),
    "llama-3.2-3b": Shape("llama", 28, 3072, 8192, 24, 8, 128, 1e-5, 500000.0, 131072, tied=True,
                          llama3_rope=(32.0, 1.0, 4.0, 8192)),
    "qwen2.5-7b": Shape("qwen2", 28, 3584, 18944, 28, 4, 128, 1e-6, 1000000.0, 32768, bias=True),
    "qwen2.5-14b": Shape("qwen2", 48, 5120, 13824, 40, 8, 128, 1e-5, 1000000.0, 32768, bias=True),
    "qwen2.5-0.5b": Shape("qwen2", 24, 896, 4864, 14, 2, 64, 1e-6, 1000000.0, 32768, tied=True, bias=True),
}

# llama.cpp's file types (general.file_type) and the block type of each tensor in them
FILE_TYPES = {"F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q6_K": 18, "Q4_K_M": 15, "Q5_K_M": 17}
_GGML_IDS = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
# columns and bytes per block of each block type (ggml's geometry, as native/formats.py and gguf have it)
_BLOCKS = {"F32": (1, 4), "F16": (1, 2), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34), "Q4_K": (256, 144),
           "Q5_K": (256, 176), "Q6_K": (256, 210)}
_FP16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v / ffn_down get more bits in a *_M mix."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_type(file_type: str, name: str, layer: int | None, layers: int) -> str:
    """The block type of tensor ``name`` (GGUF spelling) of layer ``layer`` in a ``file_type`` file."""
    if name.endswith("norm.weight") or name.endswith(".bias") or name == "rope_freqs.weight":
        return "F32"
    if file_type in ("F16", "Q4_0", "Q4_1", "Q8_0", "Q6_K"):
        if name == "output.weight" and file_type in ("Q4_0", "Q4_1"):
            return "Q6_K"  # llama.cpp keeps the LM head at 6 bits in the legacy 4-bit mixes
        return file_type
    base = "Q4_K" if file_type == "Q4_K_M" else "Q5_K"
    if name == "output.weight":
        return "Q6_K"
    if layer is not None and name.split(".", 2)[2] in ("attn_v.weight", "ffn_down.weight") \
            and use_more_bits(layer, layers):
        return "Q6_K"
    return base


@dataclass(frozen=True)
class Tensor:
    name: str  # GGUF name
    rows: int
    cols: int  # ne[0], the contiguous dimension
    qtype: str
    fill: str = "random"  # random | ones | bias | rope

    @property
    def dims(self) -> tuple[int, ...]:
        return (self.cols,) if self.rows == 1 else (self.cols, self.rows)

    @property
    def nbytes(self) -> int:
        block, size = _BLOCKS[self.qtype]
        return self.rows * (self.cols // block) * size


def tensors(shape: Shape, file_type: str, vocab: int) -> list[Tensor]:
    """Every tensor of the file, in file order (embedding, rope factors, the layers in order, final norm, head)."""
    s, h = shape, shape.hidden
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim

    def t(name: str, rows: int, cols: int, layer: int | None = None, fill: str = "random") -> Tensor:
        return Tensor(name, rows, cols, tensor_type(file_type, name, layer, s.layers), fill)

    out = [t("token_embd.weight", vocab, h)]
    if s.llama3_rope is not None:
        out.append(t("rope_freqs.weight", 1, s.head_dim // 2, fill="rope"))
    for i in range(s.layers):
        p = f"blk.{i}."
        out += [t(p + "attn_norm.weight", 1, h, i, "ones"), t(p + "attn_q.weight", q, h, i),
                t(p + "attn_k.weight", kv, h, i), t(p + "attn_v.weight", kv, h, i)]
        if s.bias:
            out += [t(p + "attn_q.bias", 1, q, i, "bias"), t(p + "attn_k.bias", 1, kv, i, "bias"),
                    t(p + "attn_v.bias", 1, kv, i, "bias")]
        out += [t(p + "attn_output.weight", h, q, i), t(p + "ffn_norm.weight", 1, h, i, "ones"),
                t(p + "ffn_gate.weight", s.intermediate, h, i), t(p + "ffn_up.weight", s.intermediate, h, i),
                t(p + "ffn_down.weight", h, s.intermediate, i)]
    out.append(t("output_norm.weight", 1, h, fill="ones"))
    if not s.tied:
        out.append(t("output.weight", vocab, h))
    for x in out:
        block = _BLOCKS[x.qtype][0]
        if x.cols % block:
            raise ConfigError(f"{x.name}: {x.cols} columns is not a multiple of {x.qtype}'s block of {block}; "
                              "pick dimensions that are multiples of 256 for the K-quant types")
    return out


# ------------------------------------------------------------------------------------------------ blocks


@functools.cache
def _unit_std(qtype: str) -> float:
    """Standard deviation of the weights of random blocks of ``qtype`` whose fp16 fields are all 1."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    size = _BLOCKS[qtype][1]
    blocks = np.random.default_rng(0).integers(0, 256, (256, size), dtype=np.uint8)
    for off in _FP16_FIELDS[qtype]:
        blocks[:, off:off + 2] = np.ones(256, np.float16).view(np.uint8).reshape(256, 2)
    w = quants.dequantize(blocks.reshape(1, -1), GGMLQuantizationType[qtype])
    return float(np.std(np.asarray(w, dtype=np.float64)))


def random_rows(t: Tensor, rng: np.random.Generator, rows: int) -> np.ndarray:
    """The next ``rows`` rows of ``t``'s bytes ([rows * row bytes] uint8), drawn from ``rng``."""
    import numpy as np

    block, size = _BLOCKS[t.qtype]
    std = 1.0 / math.sqrt(t.cols)
    if block == 1:
        w = rng.standard_normal(rows * t.cols, dtype=np.float32) * np.float32(std)
        return (w if t.qtype == "F32" else w.astype(np.float16)).view(np.uint8)
    n = rows * (t.cols // block)
    raw = rng.bit_generator.random_raw(-(-n * size // 8)).view(np.uint8)[: n * size]
    blocks = raw.reshape(n, size)
    unit = std / _unit_std(t.qtype)
    for off in _FP16_FIELDS[t.qtype]:
        d = rng.uniform(0.5, 1.5, n).astype(np.float32) * np.where(rng.random(n) < 0.5, -unit, unit)
        blocks[:, off:off + 2] = d.astype(np.float16).view(np.uint8).reshape(n, 2)
    return raw


def llama3_rope_factors(shape: Shape) -> np.ndarray:
    """llama.cpp's rope_freqs.weight for llama3 rope scaling: the divisor of each rotary frequency [head_dim / 2]."""
    import numpy as np

    factor, low, high, original = shape.llama3_rope
    freqs = shape.rope_theta ** -(np.arange(0, shape.head_dim, 2, dtype=np.float64) / shape.head_dim)
    wavelen = 2 * math.pi / freqs
    low_wl, high_wl = original / low, original / high
    smooth = (original / wavelen - low) / (high - low)
    out = np.where(wavelen < high_wl, 1.0, np.where(wavelen > low_wl, factor, 1 / ((1 - smooth) / factor + smooth)))
    return out.astype(np.float32)


def tensor_chunks(t: Tensor, seed: int, shape: Shape) -> Iterator[np.ndarray]:
    """``t``'s bytes in chunks of about CHUNK_BYTES: the same for the same (seed, name), whatever else is in the
    file."""
    import numpy as np

    if t.fill == "ones":
        yield np.ones(t.cols, np.float32).view(np.uint8)
        return
    if t.fill == "rope":
        yield llama3_rope_factors(shape).view(np.uint8)
        return
    rng = np.random.Generator(np.random.PCG64([seed, zlib.crc32(t.name.encode())]))
    if t.fill == "bias":
        yield (rng.standard_normal(t.cols, dtype=np.float32) * np.float32(NORM_BIAS_STD)).view(np.uint8)
        return
    row_bytes = t.nbytes // t.rows
    step = max(1, CHUNK_BYTES // row_bytes)
    for a in range(0, t.rows, step):
        yield random_rows(t, rng, min(step, t.rows - a))


# --------------------------------------------------------------------------------------------- the file

_U32, _F32, _BOOL, _STRING, _ARRAY, _U64 = 4, 6, 7, 8, 9, 10


def _str(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def _kv(key: str, value) -> bytes:
    if isinstance(value, bool):
        return _str(key) + struct.pack("<IB", _BOOL, value)
    if isinstance(value, int):
        return _str(key) + struct.pack("<II", _U32, value)
    if isinstance(value, float):
        return _str(key) + struct.pack("<If", _F32, value)
    return _str(key) + struct.pack("<I", _STRING) + _str(str(value))


def tokenizer_entries(source: Path) -> tuple[list[bytes], int]:
    """The tokenizer.* metadata entries of the GGUF ``source``, verbatim, and its vocabulary size."""
    from .gguf_file import metadata_spans, parse_gguf  # here: it imports torch, which writing needs not

    with open(source, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        meta, _ = parse_gguf(mm, source)
        entries = [bytes(mm[a:b]) for key, a, b in metadata_spans(mm, source) if key.startswith("tokenizer.")]
    return entries, int(meta["tokenizer.ggml.tokens.count"])


def metadata(shape: Shape, file_type: str, label: str, seed: int, vocab: int) -> dict:
    a = shape.arch if shape.arch != "mistral" else "llama"
    meta = {
        "general.architecture": a,
        "general.type": "model",
        "general.name": f"synthetic {label} ({file_type}, random weights)",
        "general.description": "SYNTHETIC: deterministic pseudo-random weights in a real architecture's shapes "
                               "(flowspec model synth); its text is meaningless",
        SYNTHETIC_KEY: True,
        f"{SYNTHETIC_KEY}.seed": seed,
        f"{SYNTHETIC_KEY}.shape": label,
        f"{a}.block_count": shape.layers,
        f"{a}.context_length": shape.context,
        f"{a}.embedding_length": shape.hidden,
        f"{a}.feed_forward_length": shape.intermediate,
        f"{a}.attention.head_count": shape.heads,
        f"{a}.attention.head_count_kv": shape.kv_heads,
        f"{a}.attention.key_length": shape.head_dim,
        f"{a}.attention.value_length": shape.head_dim,
        f"{a}.rope.dimension_count": shape.head_dim,
        f"{a}.rope.freq_base": float(shape.rope_theta),
        f"{a}.attention.layer_norm_rms_epsilon": float(shape.rms_eps),
        f"{a}.vocab_size": vocab,
        "general.file_type": FILE_TYPES[file_type],
        "general.quantization_version": 2,
    }
    return meta


def resolve_shape(name: str | None, arch: str | None, **dims) -> tuple[Shape, str]:
    """A Shape from a name in SHAPES and/or dimensions (given ones replace the named shape's). -> (shape, label)"""
    given = {k: v for k, v in dims.items() if v is not None}
    if name is not None:
        if name.lower() not in SHAPES:
            raise ConfigError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
        base = SHAPES[name.lower()]
        if arch is not None and arch != base.arch:
            raise ConfigError(f"shape {name} is a {base.arch} model, not {arch}")
        shape = replace(base, **given)
        label = name.lower() + ("" if not given else " (" + ", ".join(f"{k} {v}" for k, v in given.items()) + ")")
        return shape.check(), label
    if "layers" not in given or "hidden" not in given:
        raise ConfigError("give --shape NAME, or at least --layers and --hidden")
    arch = arch or "llama"
    hidden = given["hidden"]
    heads = given.get("heads") or max(1, hidden // 64)
    defaults = {"intermediate": -(-hidden * 8 // 3 // 256) * 256, "heads": heads,
                "kv_heads": max(1, heads // 4) if heads % 4 == 0 else heads, "head_dim": hidden // heads,
                "rope_theta": 1000000.0 if arch == "qwen2" else 10000.0, "bias": arch == "qwen2", "tied": False}
    shape = Shape(arch=arch, **{**defaults, **given})
    label = f"{arch} {shape.layers}x{shape.hidden}"
    return shape.check(), label


def write(out: Path, shape: Shape, file_type: str = "Q4_K_M", *, seed: int = 0, label: str | None = None,
          tokenizer_from: Path | None = None, progress: bool | None = None,
          on_bytes: Callable[[int], None] | None = None) -> int:
    """Write the synthetic GGUF to ``out`` (through ``out.part``, renamed when complete). ``tokenizer_from``: the GGUF
    whose tokenizer to copy (default: the default model). -> bytes written"""
    from tqdm import tqdm

    from .default import default_model_path

    if file_type not in FILE_TYPES:
        raise ConfigError(f"unknown type {file_type!r}; supported: {', '.join(FILE_TYPES)}")
    entries, vocab = tokenizer_entries(Path(tokenizer_from or default_model_path()))
    plan = tensors(shape, file_type, vocab)
    meta = metadata(shape, file_type, label or shape.arch, seed, vocab)
    head = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(plan), len(meta) + len(entries)))
    for k, v in meta.items():
        head += _kv(k, v)
    for e in entries:
        head += e
    offset = 0
    for t in plan:
        head += _str(t.name) + struct.pack(f"<I{len(t.dims)}Q", len(t.dims), *t.dims)
        head += struct.pack("<IQ", _GGML_IDS[t.qtype], offset)
        offset = -(-(offset + t.nbytes) // ALIGNMENT) * ALIGNMENT
    head += bytes(-len(head) % ALIGNMENT)
    total = len(head) + offset
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    part = out.with_name(out.name + ".part")
    with open(part, "wb") as f, tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                                     desc=f"writing {out.name}", disable=(not progress) if progress is not None
                                     else None) as bar:
        f.write(head)
        bar.update(len(head))
        for t in plan:
            written = 0
            for chunk in tensor_chunks(t, seed, shape):
                f.write(chunk.data)
                written += chunk.nbytes
                bar.update(chunk.nbytes)
                if on_bytes is not None:
                    on_bytes(chunk.nbytes)
            assert written == t.nbytes, (t.name, written, t.nbytes)
            pad = -written % ALIGNMENT
            f.write(bytes(pad))
            bar.update(pad)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, out)
    log.info("wrote %s: %s %s, %d tensors, %.2f GB", out, label or shape.arch, file_type, len(plan), total / 1e9)
    return total


def is_synthetic(source) -> bool:
    """Whether a weight source is a synthetic model (its GGUF metadata says so)."""
    return bool(getattr(source, "metadata", {}).get(SYNTHETIC_KEY))


def expected_size(shape: Shape, file_type: str, vocab: int = 49152) -> int:
    """Bytes of the tensors of such a file (its header aside)."""
    return sum(-(-t.nbytes // ALIGNMENT) * ALIGNMENT for t in tensors(shape, file_type, vocab))
