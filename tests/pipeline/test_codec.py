"""Wire frames: exact round trips, and every malformed frame rejected with a ProtocolError (never another error)."""

import contextlib
import json
import random
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flowspec_p2p.errors import ProtocolError
from flowspec_p2p.model.dtypes import DTYPE_NAMES
from flowspec_p2p.pipeline import codec
from flowspec_p2p.pipeline.messages import PROTOCOL_VERSION, Forward, Prune, Release, StageError


def forward(m=4, **kw):
    return Forward(request_id="r1", seq=2, first=0, parents=[-1, *range(m - 1)], positions=list(range(10, 10 + m)),
                   **kw)


def frame_with_header(header: dict, payload: bytes = b"") -> bytes:
    hb = json.dumps(header).encode()
    return struct.pack("<4sI", codec.MAGIC, len(hb)) + hb + payload


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_forward_round_trips_bit_exactly_in_every_float_dtype(dtype):
    hidden = torch.randn(4, 8, dtype=torch.float64).to(dtype)
    msg = forward(tag=7, commit=True)
    out, tensors = codec.decode(codec.encode(msg, {"hidden": hidden, "tokens": torch.arange(4)}))
    assert out.model_copy(update={"tensors": []}) == msg
    assert [(s.name, s.dtype, s.shape) for s in out.tensors] == [
        ("hidden", DTYPE_NAMES[dtype], (4, 8)), ("tokens", "int64", (4,))]
    assert torch.equal(tensors["hidden"], hidden)
    assert tensors["hidden"].dtype == dtype
    assert torch.equal(tensors["tokens"], torch.arange(4))


def test_float_dtype_casts_activations_but_not_tokens():
    _msg, tensors = codec.decode(codec.encode(forward(), {"hidden": torch.randn(4, 8), "tokens": torch.arange(4)},
                                             float_dtype=torch.bfloat16))
    assert tensors["hidden"].dtype == torch.bfloat16
    assert tensors["tokens"].dtype == torch.int64


@pytest.mark.parametrize("msg", [
    Prune(request_id="a", seq=3, accept=2, keep=[0, 1, 5]),
    StageError(request_id="a", seq=4, stage=2, message="lost", reason="link_lost"),
    Release(request_id="a", seq=5),
    StageError(request_id="a", seq=6, stage=2, message="KV cache full ✗"),
])
def test_control_messages_round_trip(msg):
    out, tensors = codec.decode(codec.encode(msg))
    assert out == msg
    assert tensors == {}


def test_decoded_tensors_are_writable_and_independent_of_the_frame():
    frame = bytearray(codec.encode(forward(), {"hidden": torch.ones(4, 8)}))
    _, tensors = codec.decode(frame)
    frame[-4:] = b"\0\0\0\0"
    tensors["hidden"].add_(1)  # no warning about a read-only buffer, no effect on the frame
    assert torch.equal(tensors["hidden"], torch.full((4, 8), 2.0))


def test_encode_refuses_tensors_that_do_not_fit_the_message():
    with pytest.raises(ProtocolError, match="one row per node"):
        codec.encode(forward(m=4), {"hidden": torch.zeros(3, 8)})
    with pytest.raises(ProtocolError, match="carries no tensors"):
        codec.encode(Release(request_id="a", seq=0), {"hidden": torch.zeros(1, 8)})
    with pytest.raises(ProtocolError, match="cannot go on the wire"):
        codec.encode(forward(m=1), {"hidden": torch.zeros(1, 8, dtype=torch.complex64)})


GOOD = codec.encode(forward(), {"hidden": torch.randn(4, 8, dtype=torch.float16)})


def _header(frame: bytes) -> dict:
    n = struct.unpack_from("<I", frame, 4)[0]
    return json.loads(frame[8 : 8 + n])


def _payload(frame: bytes) -> bytes:
    n = struct.unpack_from("<I", frame, 4)[0]
    return frame[8 + n :]


def _with(path: list, value) -> bytes:
    head = _header(GOOD)
    d = head
    for k in path[:-1]:
        d = d[k]
    d[path[-1]] = value
    return frame_with_header(head, _payload(GOOD))


@pytest.mark.parametrize(("frame", "reason"), [
    (b"", "shorter than"),
    (b"XXXX" + GOOD[4:], "bad magic"),
    (GOOD[:-1], "need a"),
    (GOOD + b"\0", "need a"),
    (GOOD[:20], "truncated frame"),
    (struct.pack("<4sI", codec.MAGIC, 2**31) + b"{}", "exceeds"),
    (frame_with_header({"v": PROTOCOL_VERSION}), "invalid header"),
    (struct.pack("<4sI", codec.MAGIC, 5) + b"\xff\xfe{}x", "invalid header"),
    (struct.pack("<4sI", codec.MAGIC, 4) + b"[1,]", "invalid header"),
    (_with(["v"], PROTOCOL_VERSION + 1), "protocol version"),
    (_with(["msg", "kind"], "explode"), "invalid header"),
    (_with(["msg", "seq"], "2"), "invalid header"),  # strict: no string -> int coercion
    (_with(["msg", "seq"], -1), "invalid header"),
    (_with(["msg", "surprise"], 1), "invalid header"),
    (_with(["msg", "tensors", 0, "dtype"], "float8"), "invalid header"),
    (_with(["msg", "tensors", 0, "name"], "weights"), "invalid header"),
    (_with(["msg", "tensors", 0, "shape"], [4, 9]), "need a"),  # lying shape: more bytes than present
    (_with(["msg", "tensors", 0, "shape"], [2, 8]), "one row per node"),
    (_with(["msg", "tensors", 0, "shape"], [4, -8]), "invalid shape"),
    (_with(["msg", "tensors", 0, "shape"], [4, 2**40, 2**40]), "exceeds"),
    (_with(["msg", "tensors", 0, "dtype"], "int64"), "floating point"),
    (_with(["msg", "positions"], [1, 2]), "positions"),
    (_with(["msg", "tensors"], [_header(GOOD)["msg"]["tensors"][0]] * 2), "duplicate"),
    (_with(["msg", "stage_s"], [0.01, -1.0]), "invalid header"),  # a stage's busy seconds: never negative,
    (_with(["msg", "stage_s"], [float("nan")]), "invalid header"),  # never NaN,
    (_with(["msg", "stage_s"], [0.01] * 1000), "invalid header"),  # at most one per stage of a sane ring
])
def test_malformed_frames_are_rejected_with_a_reason(frame, reason):
    with pytest.raises(ProtocolError, match=reason):
        codec.decode(frame)


def test_non_finite_activations_are_rejected():
    """A frame whose payload holds inf or NaN (written by hand: encode never sends them) is refused."""
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        for bad in (float("nan"), float("inf"), float("-inf")):
            frame = codec.encode(forward(), {"hidden": torch.zeros(4, 8, dtype=dtype)})
            tail = torch.tensor([bad], dtype=dtype).view(torch.uint8).numpy().tobytes()
            with pytest.raises(ProtocolError, match="non-finite"):
                codec.decode(frame[: len(frame) - len(tail)] + tail)


def test_the_sender_clamps_values_its_wire_dtype_cannot_hold():
    """Activations above float16's 65504 (or float64's 1e300 on a float32 wire), inf and NaN go out finite:
    clamped to the wire dtype's range, NaN as 0, so the receiver never drops the link over them."""
    h = torch.tensor([[1e5, -7e4, 1.5, float("inf")], [float("nan"), float("-inf"), 0.0, 65504.0]])
    _, t = codec.decode(codec.encode(forward(2), {"hidden": h}, float_dtype=torch.float16))
    top = torch.finfo(torch.float16).max
    assert t["hidden"].dtype == torch.float16
    assert t["hidden"].float().tolist() == [[top, -top, 1.5, top], [0.0, -top, 0.0, 65504.0]]
    big = torch.full((4, 8), 1e300, dtype=torch.float64)
    _, t = codec.decode(codec.encode(forward(), {"hidden": big}, float_dtype=torch.float32))
    assert bool(torch.isfinite(t["hidden"]).all())


def test_a_link_refuses_float_tensors_of_another_dtype_than_its_handshake_named():
    frame = codec.encode(forward(), {"hidden": torch.zeros(4, 8, dtype=torch.float64)})
    assert codec.decode(frame, float_dtype="float64")[1]["hidden"].dtype == torch.float64
    with pytest.raises(ProtocolError, match="this link carries float16"):
        codec.decode(frame, float_dtype="float16")


def test_frame_size_limit_is_enforced_before_parsing():
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        codec.decode(GOOD, max_frame_bytes=len(GOOD) - 1)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_only_ever_raise_protocol_error(data):
    for frame in (data, codec.MAGIC + data, GOOD[:8] + data):
        with contextlib.suppress(ProtocolError):
            codec.decode(frame)


def test_random_bit_flips_only_ever_raise_protocol_error():
    rng = random.Random(0)
    for _ in range(500):
        frame = bytearray(GOOD)
        for _ in range(rng.randrange(1, 4)):
            frame[rng.randrange(len(frame))] ^= 1 << rng.randrange(8)
        with contextlib.suppress(ProtocolError):
            codec.decode(bytes(frame))
