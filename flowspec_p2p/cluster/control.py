"""Control-plane messages between agents.

The control plane is HTTP: every agent serves ``POST /control`` (one JSON message in, one JSON message out),
``GET /control/info`` (its ``PeerInfo``, for static peers) and ``GET /control/timeline`` (its stage's busy
intervals, for charts). The data plane (transport.py) is separate.

    member -> leader   Hello        "I am here, this is what I offer"     -> Welcome | Refused
    member -> leader   Heartbeat    every HEARTBEAT_INTERVAL_S (membership.py), with its stage state -> Ack
    leader -> member   PlanUpdate   phase 1: the new plan and the ring's addresses; load your range -> Ack
    member -> leader   StageStatus  "loaded" (or "failed") for that epoch                         -> Ack
    leader -> member   Activate     phase 2: switch to the epoch (ring links, worker)               -> Ack
    member -> leader   StageStatus  "ready": its worker runs and its link to the successor is open -> Ack
    leader -> member   Hello        a leader that learned of a member (static peer) invites it      -> Ack
    either             Bye          stopping gracefully (a leader names its standby: it takes over) -> Ack

Messages are frozen, strict pydantic models in a tagged union (``kind``), each with the protocol version ``v``.

With a cluster key (the default), every agent endpoint is served over TLS to peers that authenticated
(handshake.py, guard.py); a message that names its sender (``claimed_sender``) must name the authenticated one.
An agent's ``identity`` is its certificate's fingerprint ("" in the open mode of ``--insecure``: plain http).
"""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Literal

from pydantic import AfterValidator, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from ..errors import ProtocolError
from ..model.arch import ModelConfig
from ..types import FrozenModel, LayerRange, PeerId
from .device import DeviceProfile
from .plans import Plan

CONTROL_VERSION = 1
CONTROL_PATH = "/control"
INFO_PATH = "/control/info"
TIMELINE_PATH = "/control/timeline"
MAX_CONTROL_BYTES = 4 * 1024 * 1024
MAX_RING = 256  # stages of a plan
MAX_CONTEXT = 1 << 20  # a plan's KV capacity per request (the data plane's MAX_POSITION)
MAX_REQUESTS = 16  # requests in flight a plan may hold (pipeline/stage.py's MAX_REQUESTS per link)


def check_host(host: str) -> str:
    """An address a peer gives for itself: an IP address (in its canonical form), or a host name of dot-separated
    labels (letters, digits, hyphens; 1-63 characters each, 253 in all), in lower case without a trailing dot: one
    address has one spelling, so pins (pinning.py) keyed by it cannot be sidestepped by writing it another way."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    labels = host.rstrip(".").split(".")
    if len(host) > 253 or not all(_LABEL.fullmatch(x) for x in labels):
        raise ValueError(f"{host[:40]!r} is neither an IP address nor a host name")
    return host.rstrip(".").lower()


_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
Host = Annotated[str, AfterValidator(check_host)]


def agent_url(host: str, port: int, *, secure: bool) -> str:
    """An agent server's base URL: https with a cluster key, http in the open mode."""
    host = f"[{host}]" if ":" in host else host
    return f"{'https' if secure else 'http'}://{host}:{port}"


class _Msg(FrozenModel):
    # no NaN or infinity in any float of a control message (a start time, a load time, a counter): a peer's numbers
    # feed comparisons and arithmetic, where NaN passes every check
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)


Role = Literal["leader", "member"]


class PeerInfo(_Msg):
    """Who an agent is and what it offers: advertised over mDNS, sent in Hello, listed by ``GET /cluster``."""

    id: PeerId = Field(min_length=1, max_length=64)
    name: str = ""
    cluster: str
    role: Role
    host: Host  # the address its agent server is reachable at
    port: int = Field(ge=1, le=65535)
    pid: int = 0
    started: float = 0.0  # unix time; the older of two leaders wins
    profile: DeviceProfile
    model: str = ""  # fingerprint of the model copy it holds ("" = none: it fetches its range)
    version: int = CONTROL_VERSION
    identity: str = Field(default="", max_length=64)  # its certificate's fingerprint ("" = open mode, plain http)
    api_url: str = Field(default="", max_length=256)  # where it serves the API ("" = none; a member proxies it)

    @property
    def url(self) -> str:
        return agent_url(self.host, self.port, secure=bool(self.identity))


class Hello(_Msg):
    kind: Literal["hello"] = "hello"
    v: int = CONTROL_VERSION
    peer: PeerInfo


class Welcome(_Msg):
    kind: Literal["welcome"] = "welcome"
    v: int = CONTROL_VERSION
    leader: PeerInfo
    epoch: int


class Refused(_Msg):
    kind: Literal["refused"] = "refused"
    v: int = CONTROL_VERSION
    reason: str
    leader: PeerInfo | None = None


StageState = Literal["idle", "loading", "loaded", "ready", "failed"]


class Heartbeat(_Msg):
    kind: Literal["heartbeat"] = "heartbeat"
    v: int = CONTROL_VERSION
    agent_id: PeerId
    epoch: int  # the plan epoch the agent runs (-1: none yet)
    state: StageState
    counters: dict[Annotated[str, Field(max_length=64)], Annotated[float, Field(allow_inf_nan=False)]] = Field(
        default_factory=dict, max_length=256)
    # peers whose ring link broke unexpectedly: the leader checks on them
    suspects: tuple[str, ...] = Field(default=(), max_length=64)


class Ack(_Msg):
    kind: Literal["ack"] = "ack"
    v: int = CONTROL_VERSION
    epoch: int = -1  # the leader's current plan epoch
    known: bool = True  # False: the leader does not know the sender (it restarted): send Hello again


class RingNode(_Msg):
    """One stage of a plan with the address its ``/ring`` and ``/control`` are served at."""

    agent_id: PeerId
    host: Host
    port: int = Field(ge=1, le=65535)
    layers: LayerRange
    embed: bool
    head: bool  # the last stage: applies the final norm and returns features (the LM head stays on the leader)
    fingerprint: str  # weight_server.stage_fingerprint of exactly this stage's tensors
    identity: str = Field(default="", max_length=64)  # the agent's certificate fingerprint (PeerInfo.identity)

    @property
    def url(self) -> str:
        return agent_url(self.host, self.port, secure=bool(self.identity))


class LeaderPolicy(_Msg):
    """How the leader that made a plan was set up, so that its standby leads the same way when it takes over."""

    context: int = Field(ge=16, le=MAX_CONTEXT)  # AgentConfig.planning.context
    stages: int | None = Field(default=None, ge=1, le=MAX_RING)
    leader_layers: Literal["auto", "always", "never"] = "auto"
    decoding: Literal["auto", "ar", "chunk", "pipedec", "flowspec"] | None = None
    max_requests: int | None = Field(default=None, ge=1, le=MAX_REQUESTS)


class PlanUpdate(_Msg):
    kind: Literal["plan"] = "plan"
    v: int = CONTROL_VERSION
    cluster: str
    epoch: int = Field(ge=1)
    leader: PeerInfo
    plan: Plan
    ring: tuple[RingNode, ...]  # in stage order; the leader closes the ring
    config: ModelConfig  # the architecture, so a member without a model copy can build its shard
    model_fingerprint: str
    context: int = Field(ge=2, le=MAX_CONTEXT)  # KV capacity per request each stage allocates
    dtype: Literal["float32", "bfloat16", "float64"] = "float32"  # compute dtype of every shard
    engine: Literal["native", "torch"]  # the engine every stage runs (the leader's: model/engine.py)
    max_requests: int = Field(default=1, ge=1, le=MAX_REQUESTS)  # requests in flight whose KV every stage holds
    wire_dtype: Literal["float16", "bfloat16", "float32", "float64"] = "float16"  # activations between stages
    # failover: the member that takes over when this leader is lost (it holds a replica of the model and the
    # leader's parts ahead of need), every member as the leader knows it, and how the leader is set up
    standby: str = Field(default="", max_length=64)
    members: tuple[PeerInfo, ...] = Field(default=(), max_length=MAX_RING)
    policy: LeaderPolicy | None = None

    @model_validator(mode="after")
    def _one_stage_each(self) -> PlanUpdate:
        ids = [n.agent_id for n in self.ring]
        if not ids or len(set(ids)) != len(ids) or len(ids) > MAX_RING:
            raise ValueError(f"a ring needs 1 to {MAX_RING} distinct agents, not {ids[:8]}")
        return self

    def node(self, agent_id: PeerId) -> RingNode | None:
        return next((n for n in self.ring if n.agent_id == agent_id), None)

    def member(self, agent_id: str) -> PeerInfo | None:
        return next((m for m in self.members if m.id == agent_id), None)

    @property
    def standby_info(self) -> PeerInfo | None:
        """The standby, as the leader knows it (None: none was chosen)."""
        return self.member(self.standby) if self.standby else None

    def successor(self, agent_id: PeerId) -> RingNode | PeerInfo:
        """Where a stage sends its output: the next stage, or the leader after the last one."""
        ids = [n.agent_id for n in self.ring]
        i = ids.index(agent_id)
        return self.ring[i + 1] if i + 1 < len(self.ring) else self.leader

    def predecessor_id(self, agent_id: PeerId) -> str:
        ids = [n.agent_id for n in self.ring]
        if agent_id == self.leader.id and agent_id not in ids:
            return ids[-1]
        i = ids.index(agent_id)
        return ids[i - 1] if i > 0 else self.leader.id


class Activate(_Msg):
    """Phase 2 of a re-plan: every stage has loaded its range of ``epoch``; switch to it now."""

    kind: Literal["activate"] = "activate"
    v: int = CONTROL_VERSION
    epoch: int


class StageStatus(_Msg):
    kind: Literal["status"] = "status"
    v: int = CONTROL_VERSION
    agent_id: PeerId
    epoch: int
    state: StageState
    detail: str = ""
    source: Literal["", "local", "fetched", "cache", "kept"] = ""  # where its weights came from
    load_s: float = 0.0
    fetched_bytes: int = 0


class Bye(_Msg):
    kind: Literal["bye"] = "bye"
    v: int = CONTROL_VERSION
    agent_id: PeerId
    reason: str = "stopping"
    # a leader that stops hands over: the standby of its latest plan takes over ("" = nobody does; members wait for
    # a leader)
    successor: str = Field(default="", max_length=64)


ControlMessage = Annotated[
    Hello | Welcome | Refused | Heartbeat | Ack | PlanUpdate | Activate | StageStatus | Bye, Field(discriminator="kind")
]
_ADAPTER: TypeAdapter = TypeAdapter(ControlMessage)


def encode_message(msg: _Msg) -> bytes:
    return msg.model_dump_json().encode()


def decode_message(data: bytes | str) -> _Msg:
    """Parse one control message; raise ProtocolError on anything malformed or of another protocol version."""
    if len(data) > MAX_CONTROL_BYTES:
        raise ProtocolError(f"control message of {len(data)} bytes exceeds {MAX_CONTROL_BYTES}")
    try:
        msg = _ADAPTER.validate_json(data)
    except ValidationError as e:
        raise ProtocolError(f"malformed control message: {str(e).splitlines()[0]}") from None
    if msg.v != CONTROL_VERSION:
        raise ProtocolError(f"control protocol {msg.v} is not {CONTROL_VERSION}; upgrade the older agent")
    return msg


def claimed_sender(msg: _Msg) -> tuple[str | None, str | None]:
    """(agent id, identity) a request message says it comes from; None where it does not say."""
    if isinstance(msg, Hello):
        return msg.peer.id, msg.peer.identity
    if isinstance(msg, PlanUpdate):
        return msg.leader.id, msg.leader.identity
    if isinstance(msg, Heartbeat | StageStatus | Bye):
        return msg.agent_id, None
    return None, None
