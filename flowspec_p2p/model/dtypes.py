"""Dtypes by name: the one table every part uses (configuration, the wire, safetensors headers)."""

from __future__ import annotations

import torch

from ..errors import ConfigError

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int8": torch.int8,
    "uint8": torch.uint8,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in TORCH_DTYPES.items()}
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
# safetensors header names -> ours
SAFETENSORS_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                     "I32": "int32", "I8": "int8", "U8": "uint8"}


def parse_dtype(name: str, allowed: tuple[str, ...] = FLOAT_DTYPES) -> torch.dtype:
    """A dtype given by name in configuration; ConfigError names the choices."""
    if name not in allowed:
        raise ConfigError(f"dtype {name!r} is not one of {', '.join(allowed)}")
    return TORCH_DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES[dtype]
