"""Frames of the data plane: one data-plane message (messages.py) and its tensors in one binary frame. Pure.

Layout (all integers little-endian)::

    magic      4 bytes   b"FSPF"
    header_len u32       length of the header
    header     JSON      {"v": PROTOCOL_VERSION, "msg": <the message, with its ``tensors`` list of TensorSpec>}
    payload    raw bytes the tensors named in ``msg.tensors``, in that order, C-contiguous, little-endian

Dtypes travel by name (messages.WIRE_DTYPES); there is no pickle and no ``torch.save`` anywhere on the wire
(flowspec-algorithm.md §10.2, STYLE.md anti-pattern 5). ``decode`` validates everything before it builds a
tensor: frame and header size limits, the protocol version, the message schema, tensor names and dtypes, that
the shapes account for exactly the payload's bytes, that a Forward's tensors have one row per node, and that
float tensors are finite. Every failure raises ``ProtocolError`` with the reason.

Activations go on the wire in float16 or bfloat16 (``encode(..., float_dtype=...)``; tests use float64 so
pipelines stay exact). A link agrees on its wire dtype at the handshake (transport.RingHello); the sender makes
every value representable in it (clamped to its range) and the receiver refuses float tensors of another dtype.
"""

from __future__ import annotations

import json
import logging
import math
import struct
import sys

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

from ..errors import ProtocolError
from ..model.dtypes import DTYPE_NAMES, FLOAT_DTYPES, TORCH_DTYPES
from .messages import PROTOCOL_VERSION, TENSOR_NAMES, WIRE_DTYPES, DataMessage, Forward, TensorSpec

log = logging.getLogger(__name__)

MAGIC = b"FSPF"
PREFIX = struct.Struct("<4sI")  # magic, header length
MAX_FRAME_BYTES = 256 * 1024 * 1024  # a 512-token prefill chunk of a 8192-wide model in float32 is 16 MiB
MAX_HEADER_BYTES = 1024 * 1024  # parents + positions of a few thousand nodes
MAX_DIMS = 4

assert set(WIRE_DTYPES) <= set(TORCH_DTYPES)
FLOAT_WIRE_DTYPES = tuple(d for d in WIRE_DTYPES if d in FLOAT_DTYPES)

if sys.byteorder != "little":  # pragma: no cover - every device we target is little-endian
    raise ImportError("flowspec_p2p's wire codec assumes a little-endian host")

Tensors = dict[str, torch.Tensor]


class _Header(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    v: int
    msg: DataMessage


_HEADER = TypeAdapter(_Header)


def wire_dtype(name: str) -> torch.dtype:
    """The torch dtype of a float wire-dtype name (configuration: "float16", "bfloat16", ...)."""
    if name not in FLOAT_WIRE_DTYPES:
        raise ProtocolError(f"activation wire dtype {name!r} is not one of {', '.join(FLOAT_WIRE_DTYPES)}")
    return TORCH_DTYPES[name]


def encode(msg, tensors: Tensors | None = None, *, float_dtype: torch.dtype | None = None) -> bytes:
    """One frame for ``msg`` and ``tensors`` (name -> tensor). ``float_dtype`` casts float tensors first.

    The message's ``tensors`` list is rewritten from the tensors actually given, so it always matches."""
    tensors = tensors or {}
    specs, blobs = [], []
    for name, t in tensors.items():
        if t.is_floating_point():
            t = _representable(t, float_dtype or t.dtype)
        if DTYPE_NAMES.get(t.dtype) not in WIRE_DTYPES:
            raise ProtocolError(f"tensor {name!r} has dtype {t.dtype}, which cannot go on the wire")
        t = t.detach().contiguous().cpu()
        specs.append(TensorSpec(name=name, dtype=DTYPE_NAMES[t.dtype], shape=tuple(t.shape)))
        blobs.append(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    if "tensors" in type(msg).model_fields:
        msg = msg.model_copy(update={"tensors": specs})
    elif specs:
        raise ProtocolError(f"a {msg.kind} message carries no tensors")
    _check_specs(msg, specs)
    hb = b'{"v":%d,"msg":%s}' % (PROTOCOL_VERSION, msg.model_dump_json().encode())
    if len(hb) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(hb)} bytes exceeds {MAX_HEADER_BYTES}")
    frame = b"".join([PREFIX.pack(MAGIC, len(hb)), hb, *blobs])
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    return frame


def _representable(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` cast to the wire dtype ``dtype`` with every value finite there: values beyond the dtype's range are
    clamped to it (an activation above 65504 on a float16 wire), NaN becomes 0, so the receiver never sees a
    non-finite tensor from a sender that works. A frame with such values is rare; it is logged."""
    if t.numel() == 0:
        return t.to(dtype)
    top = torch.finfo(dtype).max
    if bool(torch.isfinite(t).all()) and float(t.abs().max()) <= top:
        return t.to(dtype)
    log.warning("a %s tensor holds values beyond %s's range or non-finite; clamped", tuple(t.shape), dtype)
    return torch.nan_to_num(t.double(), nan=0.0, posinf=top, neginf=-top).clamp(-top, top).to(dtype)


def decode(frame: bytes | bytearray | memoryview, *, max_frame_bytes: int = MAX_FRAME_BYTES,
           float_dtype: str | None = None) -> tuple[object, Tensors]:
    """Parse and validate one frame -> (message, tensors). ``float_dtype``: the wire dtype the link agreed on at
    its handshake; a float tensor of another dtype is refused. Raises ProtocolError with the reason."""
    size = len(frame)
    if size > max_frame_bytes:
        raise ProtocolError(f"frame of {size} bytes exceeds the limit of {max_frame_bytes}")
    if size < PREFIX.size:
        raise ProtocolError(f"frame of {size} bytes is shorter than the {PREFIX.size}-byte prefix")
    magic, hlen = PREFIX.unpack_from(frame, 0)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r}")
    if hlen > MAX_HEADER_BYTES:
        raise ProtocolError(f"header length {hlen} exceeds {MAX_HEADER_BYTES}")
    if PREFIX.size + hlen > size:
        raise ProtocolError(f"truncated frame: header of {hlen} bytes, only {size - PREFIX.size} present")
    msg = _parse_header(bytes(frame[PREFIX.size : PREFIX.size + hlen]))
    specs: list[TensorSpec] = list(getattr(msg, "tensors", []))
    if float_dtype is not None:
        for s in specs:
            if s.name != "tokens" and s.dtype != float_dtype:
                raise ProtocolError(f"tensor {s.name!r} is {s.dtype}; this link carries {float_dtype}")
    offset = PREFIX.size + hlen
    need = offset + sum(_nbytes(s) for s in _check_specs(msg, specs))
    if need != size:
        raise ProtocolError(f"tensor shapes need a {need}-byte frame but it has {size} bytes")
    buf = bytearray(frame[offset:]) if specs else bytearray()  # one copy: tensors then own writable memory
    tensors: Tensors = {}
    at = 0
    for s in specs:
        n = _nbytes(s)
        dtype = TORCH_DTYPES[s.dtype]
        if n:
            t = torch.frombuffer(buf, dtype=dtype, count=math.prod(s.shape), offset=at).view(s.shape)
        else:
            t = torch.empty(s.shape, dtype=dtype)
        if n and t.is_floating_point() and not _all_finite(t):
            raise ProtocolError(f"tensor {s.name!r} holds non-finite values")
        tensors[s.name] = t
        at += n
    return msg, tensors


def _parse_header(raw: bytes):
    """Strict JSON validation: no coercion of strings or booleans to numbers, no unknown fields."""
    try:
        head = _HEADER.validate_json(raw, strict=True)
    except ValidationError as e:
        version = _peek_version(raw)
        if version is not None and version != PROTOCOL_VERSION:
            raise ProtocolError(f"protocol version {version!r}; this agent speaks {PROTOCOL_VERSION}") from None
        first = e.errors()[0]
        where = ".".join(str(x) for x in first.get("loc", ())) or "header"
        raise ProtocolError(f"invalid header ({e.error_count()} errors; first at {where}: {first['msg']})") from None
    if head.v != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {head.v}; this agent speaks {PROTOCOL_VERSION}")
    return head.msg


def _peek_version(raw: bytes):
    try:
        d = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        return None
    return d.get("v") if isinstance(d, dict) else None


def _check_specs(msg, specs: list[TensorSpec]) -> list[TensorSpec]:
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ProtocolError(f"duplicate tensor names {names}")
    for s in specs:
        if s.name not in TENSOR_NAMES or s.dtype not in WIRE_DTYPES:  # the schema checks too; belt and braces
            raise ProtocolError(f"tensor {s.name!r} of dtype {s.dtype!r} is not allowed")
        if len(s.shape) > MAX_DIMS or any(d < 0 for d in s.shape):
            raise ProtocolError(f"tensor {s.name!r} has an invalid shape {s.shape}")
        if s.name == "tokens" and s.dtype not in ("int64", "int32"):
            raise ProtocolError(f"tokens must be integers, not {s.dtype}")
        if s.name != "tokens" and s.dtype not in FLOAT_WIRE_DTYPES:
            raise ProtocolError(f"tensor {s.name!r} must be floating point, not {s.dtype}")
        if isinstance(msg, Forward) and (not s.shape or s.shape[0] != len(msg.parents)):
            raise ProtocolError(f"tensor {s.name!r} of shape {s.shape} needs one row per node ({len(msg.parents)})")
    if isinstance(msg, Forward) and len(msg.positions) != len(msg.parents):
        raise ProtocolError(f"forward has {len(msg.parents)} parents but {len(msg.positions)} positions")
    return specs


_EXPONENT_MASK = {torch.float16: 0x7C00, torch.bfloat16: 0x7F80}  # all-ones exponent = inf or nan


def _all_finite(t: torch.Tensor) -> bool:
    """Fast finiteness test (torch's half-precision isfinite is slow on CPUs): look at the exponent bits."""
    mask = _EXPONENT_MASK.get(t.dtype)
    if mask is None:
        return bool(np.isfinite(t.numpy()).all())
    bits = t.view(torch.int16).numpy()
    return not bool(((bits & mask) == mask).any())


def _nbytes(s: TensorSpec) -> int:
    n = TORCH_DTYPES[s.dtype].itemsize
    for d in s.shape:
        n *= d
        if n > MAX_FRAME_BYTES:
            raise ProtocolError(f"tensor {s.name!r} of shape {s.shape} exceeds the frame limit")
    return n
