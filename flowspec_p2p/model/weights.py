"""Weight sources: a GGUF file or a Hugging Face checkpoint folder, read lazily, tensor by tensor.

Every tensor is addressed by its canonical (HF) name, e.g. ``model.layers.3.self_attn.q_proj.weight`` (GGUF names map
to them per family: Gemma's ``ffn_norm`` is its pre-MLP norm; Phi-3's fused q|k|v and gate|up are served as the row
ranges of separate matrices, in both kinds of source; ``load_tensor`` gives Gemma's norms as multipliers 1 + w).
A device that holds layers ``[a, b)`` asks only for those names (plus embedding / norm / head where its role
needs them), so only those tensors are ever dequantised or paged in:

    GGUF         memory-mapped; the header parsed here (``gguf.GGUFReader`` takes seconds on the tokenizer
                 arrays); each tensor dequantised on demand (torch for F32/F16/BF16/Q8_0/Q4_0/Q4_1, bit-identical
                 to ``gguf.quants``, which handles the other types), and the q/k rows un-permuted (llama.cpp
                 stores them interleaved for its rotary kernel).
    safetensors  the header is parsed once; each tensor is read by name from the memory-mapped file.

Fingerprints are SHA-256 digests of the *stored* bytes of each tensor (quantised bytes for GGUF), combined
with the canonical config; two peers with equal fingerprints for a range run bit-identical weights.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import re
import struct
import weakref
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from ..errors import ConfigError, UnsupportedModel, WeightsError
from ..types import LayerRange
from .arch import (  # noqa: F401
    EMBED,
    HEAD,
    NORM,
    ROPE_FREQS,
    ModelConfig,
    config_from_gguf,
    config_from_hf,
    is_norm,
    layer_tensor_names,
    shard_tensor_names,
)
from .default import DEFAULT_GGUF_NAME, DEFAULT_GGUF_PACKAGE, default_model_path  # noqa: F401
from .dtypes import SAFETENSORS_NAMES, TORCH_DTYPES
from .gguf_file import GGUFTensor, dequantize, parse_gguf
from .registry import resolve_model

log = logging.getLogger(__name__)

_GGUF_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",  # Phi-3: q|k|v fused, split by rows (split_fused)
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_LAYER_BY_ARCH = {  # where a family's GGUF names mean other HF names
    "gemma3": {"ffn_norm.weight": "pre_feedforward_layernorm.weight",
               "post_attention_norm.weight": "post_attention_layernorm.weight",
               "post_ffw_norm.weight": "post_feedforward_layernorm.weight"},
    "phi3": {"ffn_up.weight": "mlp.gate_up_proj.weight"},  # gate|up fused (llama.cpp's Phi-3 has no ffn_gate)
}
_GGUF_GLOBAL = {"token_embd.weight": EMBED, "output_norm.weight": NORM, "output.weight": HEAD, ROPE_FREQS: ROPE_FREQS}
_GGUF_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


def _gguf_to_hf(name: str, arch: str = "llama") -> str | None:
    if name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[name]
    m = _GGUF_BLOCK.match(name)
    if m:
        hf = _GGUF_LAYER_BY_ARCH.get(arch, {}).get(m.group(2), _GGUF_LAYER.get(m.group(2)))
        if hf is not None:
            return f"model.layers.{m.group(1)}.{hf}"
    return None


def _fused(cfg: ModelConfig) -> dict[str, list[tuple[str, int]]]:
    """Fused matrices (HF suffix) -> their parts (HF suffix, rows), in row order: Phi-3 stores q|k|v and gate|up."""
    inter = cfg.intermediate_size
    return {"self_attn.qkv_proj.weight": [("self_attn.q_proj.weight", cfg.q_dim),
                                          ("self_attn.k_proj.weight", cfg.kv_dim),
                                          ("self_attn.v_proj.weight", cfg.kv_dim)],
            "self_attn.qkv_proj.bias": [("self_attn.q_proj.bias", cfg.q_dim), ("self_attn.k_proj.bias", cfg.kv_dim),
                                        ("self_attn.v_proj.bias", cfg.kv_dim)],
            "mlp.gate_up_proj.weight": [("mlp.gate_proj.weight", inter), ("mlp.up_proj.weight", inter)]}


def split_fused(cfg: ModelConfig, names, split) -> dict:
    """For every fused tensor among ``names`` (canonical layer names): ``split(name, [(part name, first row, rows)])``
    -> {part name: entry}; the parts' row counts must cover the tensor's."""
    out = {}
    fused = _fused(cfg)
    for name in names:
        m = re.match(r"^(model\.layers\.\d+\.)(.+)$", name)
        if m and m.group(2) in fused:
            parts, row = [], 0
            for suffix, rows in fused[m.group(2)]:
                parts.append((m.group(1) + suffix, row, rows))
                row += rows
            out |= split(name, parts)
    return out


# -------------------------------------------------------------------------------------------- sources


class WeightSource(Protocol):
    path: Path
    config: ModelConfig

    def names(self) -> list[str]: ...
    def load(self, name: str) -> torch.Tensor: ...
    def raw_bytes(self, name: str) -> memoryview: ...
    def raw_info(self, name: str) -> dict: ...


def tensor_shape(source: WeightSource, name: str) -> tuple[int, ...]:
    """The logical shape of the stored tensor ``name`` (as torch sees it: [out, in] for a matrix), from its
    ``raw_info`` alone (nothing is read)."""
    info = source.raw_info(name)
    if info["format"] != "gguf":
        return tuple(info["shape"])
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    shape = list(info["byte_shape"])
    if np.dtype(info["dtype"]) == np.uint8:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[info["qtype"]]]
        shape[-1] = shape[-1] // size * block
    return tuple(shape)


def unpermute_rows(w, n_head: int):
    """Undo llama.cpp's q/k row permutation (interleaved rotary pairs -> rotate-half layout). numpy or torch."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFSource:
    """A GGUF file, memory-mapped; tensors dequantised one at a time.

    The header (metadata and tensor directory) is parsed here in one pass (~0.1 s; ``gguf.GGUFReader`` takes
    ~5 s on the tokenizer arrays), and the common tensor types are dequantised with torch (see ``dequantize``).
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        if self.path.stat().st_size < 24:
            raise WeightsError(f"{self.path} is too short to be a GGUF file")
        with open(self.path, "rb") as fh:
            # copy-on-write: a writable buffer lets torch view it without a copy or a warning; we never write
            self._mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
        self.metadata, tensors = parse_gguf(self._mm, self.path)
        by_name = {t.name: t for t in tensors}

        def read(name: str) -> torch.Tensor:
            t = by_name[name]
            return dequantize(torch.frombuffer(self._mm, dtype=torch.uint8, count=t.nbytes, offset=t.offset), t.qtype,
                              t.shape)

        self.config = config_from_gguf(self.metadata, set(by_name), read)
        arch = self.config.arch
        self._tensors: dict[str, GGUFTensor] = {}
        for t in tensors:
            hf = _gguf_to_hf(t.name, arch)
            if hf is not None:
                self._tensors[hf] = t
        self._tensors |= split_fused(self.config, list(self._tensors), self._split)
        # the header's pages (a large vocabulary's tokenizer arrays: megabytes) are not needed again
        header = min((t.offset for t in tensors), default=0) // mmap.PAGESIZE * mmap.PAGESIZE
        if header:
            self._mm.madvise(mmap.MADV_DONTNEED, 0, header)

    def _split(self, name: str, parts) -> dict[str, GGUFTensor]:
        t = self._tensors.pop(name)
        rows = t.shape[0]
        if sum(r for _, _, r in parts) != rows or t.nbytes % rows:
            raise WeightsError(f"{self.path.name}: {t.name} has {rows} rows, its parts {[r for *_, r in parts]}")
        row_bytes = t.nbytes // rows
        return {part: GGUFTensor(f"{t.name}[{r0}:{r0 + n}]", t.qtype, (n, *t.shape[1:]), t.offset + r0 * row_bytes,
                                 n * row_bytes) for part, r0, n in parts}

    def names(self) -> list[str]:
        return list(self._tensors)

    def _tensor(self, name: str) -> GGUFTensor:
        try:
            return self._tensors[name]
        except KeyError:
            raise WeightsError(f"{self.path.name} has no tensor {name!r}") from None

    def raw_bytes(self, name: str) -> memoryview:
        t = self._tensor(name)
        return memoryview(self._mm)[t.offset : t.offset + t.nbytes]

    def raw_info(self, name: str) -> dict:
        """How to read ``raw_bytes``: as a numpy array of ``dtype`` and ``byte_shape`` (gguf.GGUFReader's view
        of the tensor), dequantised as ``qtype``."""
        t = self._tensor(name)
        return {"format": "gguf", "qtype": t.qtype.name, "byte_shape": list(t.byte_shape), "dtype": t.np_dtype}

    def load(self, name: str) -> torch.Tensor:
        t = self._tensor(name)
        raw = torch.frombuffer(self._mm, dtype=torch.uint8, count=t.nbytes, offset=t.offset)  # [nbytes] view
        return _unpermute_for(self.config, name, dequantize(raw, t.qtype, t.shape))

    def release(self, name: str, start: int = 0, end: int | None = None) -> None:
        """Drop the file pages of ``name``'s bytes [start, end) from this process's memory (after packing them;
        they are read again if used)."""
        t = self._tensor(name)
        end = t.nbytes if end is None else end
        page = mmap.PAGESIZE
        a = (t.offset + start) // page * page
        b = min(-(-(t.offset + end) // page) * page, len(self._mm))
        if b > a:
            self._mm.madvise(mmap.MADV_DONTNEED, a, b - a)


def _unpermute_for(cfg: ModelConfig, name: str, w: torch.Tensor) -> torch.Tensor:
    """llama.cpp stores llama/mistral q/k rows interleaved for its rotary kernel; put them back."""
    if cfg.arch in ("llama", "mistral"):
        if name.endswith("q_proj.weight"):
            return unpermute_rows(w, cfg.num_heads)
        if name.endswith("k_proj.weight"):
            return unpermute_rows(w, cfg.num_kv_heads)
    return w


def gguf_tensor_from_raw(cfg: ModelConfig, name: str, info: dict, raw: bytes | memoryview) -> torch.Tensor:
    """A float32 tensor from GGUF bytes described by ``GGUFSource.raw_info`` (e.g. fetched from a peer)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    qtype = GGMLQuantizationType[info["qtype"]]
    byte_shape = list(info["byte_shape"])
    if np.dtype(info["dtype"]) == np.uint8:
        block, size = GGML_QUANT_SIZES[qtype]
        shape = (*byte_shape[:-1], byte_shape[-1] // size * block)
    else:
        shape = tuple(byte_shape)
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if len(raw) else torch.empty(0, dtype=torch.uint8)
    return _unpermute_for(cfg, name, dequantize(data, qtype, shape))


def safetensors_dtype(name: str) -> torch.dtype | None:
    """The torch dtype of a safetensors header dtype ("F16", "BF16", ...), None for one we do not read."""
    ours = SAFETENSORS_NAMES.get(name)
    return None if ours is None else TORCH_DTYPES[ours]


class SafetensorsSource:
    """A HF checkpoint folder: ``config.json`` plus one or many ``*.safetensors`` files."""

    def __init__(self, folder: Path):
        self.path = Path(folder)
        cfg_path = self.path / "config.json"
        if not cfg_path.is_file():
            raise ConfigError(f"{self.path} has no config.json; pass a GGUF file or a HF checkpoint folder")
        self.config = config_from_hf(json.loads(cfg_path.read_text()))
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise WeightsError(f"{self.path} holds no *.safetensors files (PyTorch .bin checkpoints are not read)")
        self._index: dict[str, tuple[mmap.mmap, dict, int]] = {}
        for f in files:
            with open(f, "rb") as fh:
                mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            (n,) = struct.unpack("<Q", mm[:8])
            header = json.loads(mm[8 : 8 + n])
            for name, info in header.items():
                if name != "__metadata__":
                    self._index[name] = (mm, info, 8 + n)
        self._index |= split_fused(self.config, list(self._index), self._split)

    def _split(self, name: str, parts) -> dict[str, tuple[mmap.mmap, dict, int]]:
        mm, info, base = self._index.pop(name)
        rows = info["shape"][0]
        a, b = info["data_offsets"]
        row_bytes = (b - a) // rows
        if sum(r for _, _, r in parts) != rows:
            raise WeightsError(f"{self.path}: {name} has {rows} rows, its parts {[r for *_, r in parts]}")
        return {part: (mm, {**info, "shape": [n, *info["shape"][1:]],
                            "data_offsets": [a + r0 * row_bytes, a + (r0 + n) * row_bytes]}, base)
                for part, r0, n in parts}

    def names(self) -> list[str]:
        return list(self._index)

    def _entry(self, name: str) -> tuple[mmap.mmap, dict, int]:
        try:
            return self._index[name]
        except KeyError:
            raise WeightsError(f"{self.path} has no tensor {name!r}") from None

    def raw_bytes(self, name: str) -> memoryview:
        mm, info, base = self._entry(name)
        a, b = info["data_offsets"]
        return memoryview(mm)[base + a : base + b]

    def raw_info(self, name: str) -> dict:
        _, info, _ = self._entry(name)
        return {"format": "safetensors", "dtype": info["dtype"], "shape": info["shape"]}

    def load(self, name: str) -> torch.Tensor:
        _, info, _ = self._entry(name)
        dtype = safetensors_dtype(info["dtype"])
        if dtype is None:
            raise UnsupportedModel(f"tensor {name} has unsupported dtype {info['dtype']}")
        buf = self.raw_bytes(name)
        if len(buf) == 0:
            return torch.empty(info["shape"], dtype=dtype)
        return torch.frombuffer(bytearray(buf), dtype=dtype).reshape(info["shape"])


def load_tensor(source: WeightSource, name: str) -> torch.Tensor:
    """``source.load(name)`` as every engine uses it: a norm weight that HF stores as an offset from one (Gemma:
    x * (1 + w)) comes back as the multiplier 1 + w, computed in float32 as transformers does (a GGUF file stores the
    multiplier already)."""
    t = source.load(name)
    if source.config.norm_offset and is_norm(name) and source.raw_info(name)["format"] != "gguf":
        return 1.0 + t.float()
    return t


def open_source(path: str | Path | None = None) -> GGUFSource | SafetensorsSource:
    """Open a GGUF file or a HF checkpoint folder, or the model a name stands for (registry.resolve_model: a pulled
    model, an installed model package); ``None`` means the packaged default model."""
    p = resolve_model(path)
    if p.is_dir():
        return SafetensorsSource(p)
    if p.is_file() and p.suffix == ".gguf":
        return GGUFSource(p)
    if not p.exists():
        raise ConfigError(f"model path {p} does not exist")
    raise ConfigError(f"{p} is neither a .gguf file nor a HF checkpoint folder (config.json + *.safetensors)")


# ------------------------------------------------------------------------------------ materialising


DIGEST_WINDOW = 4 << 20  # bytes of a tensor hashed at a time


_DIGESTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # source -> {name: digest}, computed once


def tensor_digest(source: WeightSource, name: str) -> str:
    """SHA-256 of a tensor's stored bytes, computed once per open source (a leader's model fingerprint and its weight
    server's manifests share them: a 4 GB model is hashed once). A GGUF file's pages are dropped from memory again a
    window at a time as they are hashed, so fingerprinting a model never holds more than a window of it."""
    try:
        known = _DIGESTS.setdefault(source, {})
    except TypeError:  # a source that cannot be weakly referenced: hashed each time
        known = {}
    if name not in known:
        known[name] = _digest(source, name)
    return known[name]


def _digest(source: WeightSource, name: str) -> str:
    raw = memoryview(source.raw_bytes(name)).cast("B")
    release = getattr(source, "release", None)
    h = hashlib.sha256()
    for a in range(0, len(raw), DIGEST_WINDOW):
        h.update(raw[a : a + DIGEST_WINDOW])
        if release is not None:
            release(name, a, min(len(raw), a + DIGEST_WINDOW))
    return h.hexdigest()


def fingerprint(config: ModelConfig, digests: dict[str, str]) -> str:
    """Fingerprint of a set of tensors: config + (name, digest) pairs, order-independent."""
    h = hashlib.sha256(config.canonical_json().encode())
    for name in sorted(digests):
        h.update(f"\n{name}={digests[name]}".encode())
    return h.hexdigest()[:32]


def range_fingerprint(source: WeightSource, layers: LayerRange, *, embed: bool, head: bool) -> str:
    names = shard_tensor_names(source.config, layers, embed=embed, head=head)
    return fingerprint(source.config, {n: tensor_digest(source, n) for n in names})


def model_fingerprint(source: WeightSource) -> str:
    """Fingerprint of the whole checkpoint (every tensor we use). Identifies a target for draft heads."""
    full = LayerRange(start=0, end=source.config.num_layers)
    return range_fingerprint(source, full, embed=True, head=True)
