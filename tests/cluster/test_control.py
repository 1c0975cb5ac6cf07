"""Control-plane messages round-trip, reject malformed or foreign-version input, and name their senders."""

import pytest

from flowspec_p2p.cluster import control
from flowspec_p2p.cluster.control import (
    Ack,
    Bye,
    Heartbeat,
    Hello,
    PeerInfo,
    StageStatus,
    claimed_sender,
    decode_message,
    encode_message,
)
from flowspec_p2p.cluster.device import DeviceProfile
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


def test_messages_name_their_senders_and_urls_say_whether_the_agent_speaks_tls():
    keyed = ME.model_copy(update={"identity": "a" * 64})
    assert claimed_sender(Hello(peer=keyed)) == ("abc", "a" * 64)
    assert claimed_sender(Bye(agent_id="abc")) == ("abc", None)
    assert claimed_sender(Heartbeat(agent_id="abc", epoch=1, state="idle")) == ("abc", None)
    assert claimed_sender(Ack()) == (None, None)
    assert ME.url == "http://127.0.0.1:4242"
    assert keyed.url == "https://127.0.0.1:4242"


def test_no_float_of_a_control_message_or_an_advert_seal_may_be_nan_or_infinite():
    from flowspec_p2p.cluster.handshake import AdvertSeal
    from flowspec_p2p.cluster.keys import ClusterKey

    hello = encode_message(Hello(peer=ME)).decode()
    for bad in ("NaN", "Infinity", "-Infinity"):
        with pytest.raises(ProtocolError, match="malformed"):
            decode_message(hello.replace('"started":0.0', f'"started":{bad}'))
        with pytest.raises(ProtocolError, match="malformed"):
            decode_message(f'{{"kind": "status", "v": 1, "agent_id": "a", "epoch": 1, "state": "loaded", '
                           f'"load_s": {bad}}}')
    seal = AdvertSeal(ClusterKey.generate())
    for ts in ("nan", "inf", "-inf"):
        props = seal.seal({"id": "a"}, 4000, now=1000.0)
        props["ts"] = ts
        props["p"] = seal._proof(props, 4000)  # a holder of the key sealing a NaN timestamp
        with pytest.raises(ProtocolError, match="not a finite number"):
            seal.check(props, 4000, now=1000.0)


def test_host_names_have_one_spelling():
    assert PeerInfo(**{**ME.model_dump(), "host": "Leader.LAN."}).host == "leader.lan"
    assert PeerInfo(**{**ME.model_dump(), "host": "::FFFF:7F00:1"}).host == "::ffff:7f00:1"
    from flowspec_p2p.cluster.pinning import Pins

    pins = Pins()
    pins.expect("Leader.LAN", 4000, "a" * 64)
    assert pins.get(("leader.lan", 4000)).identity == "a" * 64


async def test_every_agent_endpoint_answers_503_until_the_agent_is_ready(tmp_path):
    from aiohttp import web

    from flowspec_p2p.agent import Agent
    from flowspec_p2p.config import AgentConfig

    agent = Agent(AgentConfig(state_dir=tmp_path, insecure=True))  # built, not started
    for handler in (agent._http_info, agent._http_control):
        with pytest.raises(web.HTTPServiceUnavailable):
            await handler(None)
