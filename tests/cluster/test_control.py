"""Control-plane messages round-trip, reject malformed or foreign-version input; request signatures."""

import pytest

from flowspec_p2p.cluster import control
from flowspec_p2p.cluster.control import (
    Ack,
    Bye,
    Heartbeat,
    Hello,
    PeerInfo,
    StageStatus,
    auth_tag,
    check_signature,
    decode_message,
    encode_message,
    sign,
)
from flowspec_p2p.cluster.profile import DeviceProfile
from flowspec_p2p.errors import ProtocolError

PROFILE = DeviceProfile(memory_bytes=1 << 30, gflops=12.5, threads=2, link_mbps=100.0)
ME = PeerInfo(id="abc", cluster="home", role="member", host="127.0.0.1", port=4242, pid=7, profile=PROFILE)


@pytest.mark.parametrize("msg", [
    Hello(peer=ME), Heartbeat(agent_id="abc", epoch=3, state="ready", counters={"forwards": 2.0}), Ack(epoch=3),
    StageStatus(agent_id="abc", epoch=3, state="failed", detail="out of memory"), Bye(agent_id="abc"),
])
def test_messages_round_trip(msg):
    assert decode_message(encode_message(msg)) == msg


def test_malformed_and_foreign_messages_are_refused():
    with pytest.raises(ProtocolError, match="malformed"):
        decode_message(b'{"kind": "hello"}')
    with pytest.raises(ProtocolError, match="malformed"):
        decode_message(b'{"kind": "launch_missiles", "v": 1}')
    with pytest.raises(ProtocolError, match="malformed"):  # strict: no string-to-int coercion
        decode_message(b'{"kind": "ack", "v": 1, "epoch": "3"}')
    with pytest.raises(ProtocolError, match="protocol 99"):
        decode_message(b'{"kind": "ack", "v": 99}')
    with pytest.raises(ProtocolError, match="exceeds"):
        decode_message(b" " * (control.MAX_CONTROL_BYTES + 1))


def test_signatures_bind_secret_method_path_body_and_time():
    secret = b"correct horse battery"
    h = sign(secret, "POST", "/control", b"{}", now=1000.0)
    check_signature(secret, h, "POST", "/control", b"{}", now=1001.0)
    for args in [(b"wrong secret!", h, "POST", "/control", b"{}"), (secret, h, "GET", "/control", b"{}"),
                 (secret, h, "POST", "/ring", b"{}"), (secret, h, "POST", "/control", b"{ }")]:
        with pytest.raises(ProtocolError, match="bad signature"):
            check_signature(*args, now=1001.0)
    with pytest.raises(ProtocolError, match="clock"):
        check_signature(secret, h, "POST", "/control", b"{}", now=1000.0 + control.MAX_CLOCK_SKEW_S + 1)
    with pytest.raises(ProtocolError, match="missing"):
        check_signature(secret, None, "POST", "/control", b"{}")


def test_auth_tags_match_only_for_the_same_secret_and_cluster():
    assert auth_tag(b"s3cret-one", "home") == auth_tag(b"s3cret-one", "home")
    assert auth_tag(b"s3cret-one", "home") != auth_tag(b"s3cret-two", "home")
    assert auth_tag(b"s3cret-one", "home") != auth_tag(b"s3cret-one", "work")
    assert auth_tag(None, "home") == ""
