"""What the planner works on and produces, pure data: devices, the model's sizes, the options, the plan (stages,
excluded devices), the changes from one plan to the next (``diff``) and a plain-text rendering (``render``).
Words as in planner.py's glossary."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from ..model.arch import EMBED, HEAD, NORM, layer_tensor_names
from ..types import FrozenModel, LayerRange, PeerId, Settings

if TYPE_CHECKING:
    from ..model.engine import Engine

MB = 1024 * 1024
# what an agent process holds before any weights (Python, torch, the engine, its servers), where the device does not
# say (agents measure their own: DeviceProfile.runtime_bytes): part of a stage's expected resident set
DEFAULT_RUNTIME_BYTES = 320 * MB
HEADROOM = 0.05  # share of each device's offer a plan leaves free (allocator slack, page tables, the OS's caches)


class Device(FrozenModel):
    """What the planner knows of a device (from its advertised profile)."""

    id: PeerId
    memory_bytes: int = Field(ge=0)  # offered for weights + KV cache + activations (its runtime comes on top)
    runtime_bytes: int | None = Field(default=None, ge=0)  # its own memory before weights (None: DEFAULT_RUNTIME_BYTES)
    gflops: float = Field(gt=0)  # measured decoder-block throughput (after any emulated slowdown)
    link_mbps: float | None = Field(default=None, gt=0)  # its link to the LAN; None = DEFAULT_LINK_MBPS
    latency_ms: float = Field(default=0.0, ge=0)  # one-way latency of its link
    leader: bool = False


class ModelSizes(FrozenModel):
    """What the planner knows of a model: bytes as its engine holds them (describe_model), FLOPs per token."""

    name: str
    fingerprint: str = ""
    num_layers: int = Field(ge=1)
    layer_bytes: tuple[int, ...]  # per layer, as the engine holds it
    embed_bytes: int  # token embedding table (stage 1 and the leader)
    tied_embeddings: bool = False  # the leader's embedding is a view of its LM head (shard.py): no extra bytes
    head_bytes: int  # final norm + LM head (the leader)
    norm_bytes: int = 0  # the final norm alone (the last stage)
    draft_bytes: int = 0  # draft head (the leader)
    kv_bytes_per_token: int  # K + V of one token in one layer, in the engine's cache
    hidden_size: int
    vocab_size: int
    context: int = Field(ge=1)  # tokens of KV cache each stage reserves per request
    layer_flops: float  # per token per layer
    head_flops: float  # per token: LM head (the leader computes logits of every returned node)
    draft_flops: float = 0.0  # per drafted token on the leader
    wire_bytes: int = 2  # bytes per activation element on the wire (float16)
    dtype_bytes: int = 4


class PlanOptions(Settings):
    tokens_per_step: int = Field(default=16, ge=1)  # segment size (1 for plain autoregressive decoding)
    stages: int | None = Field(default=None, ge=1)  # exactly this many layer-holding stages (benchmarks)
    leader_layers: Literal["auto", "always", "never"] = "auto"  # may the leader also be stage 1?
    kv_requests: int = Field(default=1, ge=1)  # concurrent requests whose KV each stage must hold
    headroom: float = Field(default=HEADROOM, ge=0.0, lt=1.0)  # share of each device's offer left free


class Stage(FrozenModel):
    agent_id: PeerId
    layers: LayerRange
    embed: bool
    head: bool
    memory_bytes: int  # what the planner counts against the agent's offer: weights + KV + activations
    busy_ms: float
    runtime_bytes: int = 0  # the agent's own memory before weights

    @property
    def expected_rss(self) -> int:
        """The agent's resident set once it serves this stage, as the planner counts it."""
        return self.runtime_bytes + self.memory_bytes


class Excluded(FrozenModel):
    agent_id: PeerId
    reason: str


class Plan(FrozenModel):
    model: str
    fingerprint: str = ""
    num_layers: int
    leader_id: PeerId
    stages: tuple[Stage, ...]
    leader_memory_bytes: int
    leader_work_ms: float  # LM head + draft per step, on the leader
    bottleneck_ms: float
    round_trip_ms: float
    cost_ms: float
    tokens_per_step: int
    excluded: tuple[Excluded, ...] = ()
    kv_requests: int = 1  # requests in flight whose KV every stage holds
    headroom: float = 0.0  # share of each device's offer the plan left free

    def stage_of(self, agent_id: PeerId) -> Stage | None:
        return next((s for s in self.stages if s.agent_id == agent_id), None)

    @property
    def agents(self) -> tuple[str, ...]:
        return tuple(s.agent_id for s in self.stages)


class Change(FrozenModel):
    """One explicit transition between two plans (see ``diff``)."""

    kind: Literal["assign", "release", "move", "reorder", "leader"]
    agent_id: PeerId
    old: LayerRange | None = None
    new: LayerRange | None = None

    def __str__(self) -> str:
        if self.kind == "assign":
            return f"assign {self.new} to {self.agent_id}"
        if self.kind == "release":
            return f"release {self.old} from {self.agent_id}"
        if self.kind == "move":
            return f"move {self.agent_id}: {self.old} -> {self.new}"
        if self.kind == "reorder":
            return f"reorder {self.agent_id} (same layers {self.new}, new place in the ring)"
        return f"leader is now {self.agent_id}"


# ------------------------------------------------------------------------------------------ the model


def describe_model(source, engine: Engine, *, context: int, name: str | None = None, fingerprint: str = "",
                   draft_bytes: int | None = None) -> ModelSizes:
    """A ModelSizes from an open weight source, its bytes asked of ``engine`` (model/engine.py): each tensor as
    the engine holds it once loaded (``tensor_bytes``), the KV cache per token and layer (``kv_bytes_per_token``).
    ``draft_bytes``: what the leader's drafter holds (HeadDrafter.nbytes: its network and reduced LM-head copy);
    default an EAGLE-1 head's parameters in the engine's dtype."""
    cfg = source.config
    h, v = cfg.hidden_size, cfg.vocab_size
    layer = cfg.layer_params()
    draft_params = 2 * h * h + layer - h  # EAGLE-1 head: fc 2H->H + one decoder block without the input norm
    dtype_bytes = engine.dtype.itemsize

    def held(n: str) -> int:
        return engine.tensor_bytes(source, n)

    return ModelSizes(
        name=name or (getattr(source, "path", None) and source.path.name) or cfg.arch,
        fingerprint=fingerprint,
        num_layers=cfg.num_layers,
        layer_bytes=tuple(sum(held(n) for n in layer_tensor_names(cfg, i)) for i in range(cfg.num_layers)),
        embed_bytes=held(EMBED),
        tied_embeddings=cfg.tie_embeddings,
        head_bytes=held(EMBED if cfg.tie_embeddings else HEAD) + held(NORM),
        norm_bytes=held(NORM),
        draft_bytes=draft_params * dtype_bytes if draft_bytes is None else draft_bytes,
        kv_bytes_per_token=engine.kv_bytes_per_token(cfg),
        hidden_size=h,
        vocab_size=v,
        context=min(context, cfg.max_position),
        layer_flops=2.0 * layer,
        head_flops=2.0 * h * v,
        draft_flops=2.0 * draft_params,
        dtype_bytes=dtype_bytes,
    )


# ------------------------------------------------------------------------------------ diff and rendering


def diff(old: Plan | None, new: Plan) -> list[Change]:
    """Explicit transitions from ``old`` to ``new``: releases first, then moves/reorders, then assignments."""
    if old is None:
        return [Change(kind="assign", agent_id=s.agent_id, new=s.layers) for s in new.stages]
    changes: list[Change] = []
    if old.leader_id != new.leader_id:
        changes.append(Change(kind="leader", agent_id=new.leader_id))
    before = {s.agent_id: (i, s) for i, s in enumerate(old.stages)}
    after = {s.agent_id: (i, s) for i, s in enumerate(new.stages)}
    for aid, (_, s) in before.items():
        if aid not in after:
            changes.append(Change(kind="release", agent_id=aid, old=s.layers))
    for aid, (i, s) in after.items():
        if aid not in before:
            continue
        j, o = before[aid]
        if (o.layers, o.embed, o.head) != (s.layers, s.embed, s.head):
            changes.append(Change(kind="move", agent_id=aid, old=o.layers, new=s.layers))
        elif i != j or _neighbours(old, aid) != _neighbours(new, aid):
            changes.append(Change(kind="reorder", agent_id=aid, old=o.layers, new=s.layers))
    for aid, (_, s) in after.items():
        if aid not in before:
            changes.append(Change(kind="assign", agent_id=aid, new=s.layers))
    return changes


def parallel_stations(ring_hosts: Sequence[str], leader_host: str, leader_in_ring: bool, emulated: bool,
                      leader_cores: int) -> int:
    """How many of a ring's compute stations (its stages and the leader) can work at once: one per device, but on
    the leader's host, which several may share, no more than its cores (the leader knows only its own host's); an
    emulated cluster's agents count as devices of their own."""
    stations = [*ring_hosts, *([] if leader_in_ring else [leader_host])]
    if emulated:
        return len(stations)
    hosts = Counter(stations)
    return sum(min(n, leader_cores) if h == leader_host else n for h, n in hosts.items())


def _neighbours(p: Plan, aid: str) -> tuple[str, str]:
    ring = [p.leader_id, *p.agents, p.leader_id]
    i = ring.index(aid, 1)
    return ring[i - 1], ring[i + 1]


def render(p: Plan, devices: Sequence[Device] = ()) -> str:
    """A readable table of the plan (``flowspec plan`` prints it; golden files carry it beside the JSON)."""
    offered = {d.id: d for d in devices}
    lines = [
        f"plan for {p.model}: {p.num_layers} layers on {len(p.stages)} stage(s), leader {p.leader_id}",
        f"  per {p.tokens_per_step}-token step: bottleneck {p.bottleneck_ms:.3f} ms, round trip "
        f"{p.round_trip_ms:.3f} ms, cost {p.cost_ms:.3f} ms; leader head+draft work {p.leader_work_ms:.3f} ms",
        f"  memory counted against each offer: weights, KV for {p.kv_requests} request(s), activations; "
        f"{p.headroom:.0%} of each offer left free",
        f"  {'#':>2}  {'agent':<20} {'layers':<10} {'roles':<12} {'memory MB':>16} {'busy ms':>9}",
    ]
    for i, s in enumerate(p.stages, 1):
        roles = ",".join(r for r, on in (("embed", s.embed), ("norm", s.head), ("leader", s.agent_id == p.leader_id))
                         if on) or "-"
        d = offered.get(s.agent_id)
        mem = f"{s.memory_bytes / MB:.0f}" + (f"/{d.memory_bytes / MB:.0f}" if d else "")
        lines.append(f"  {i:>2}  {s.agent_id:<20} {s.layers!s:<10} {roles:<12} {mem:>16} {s.busy_ms:>9.3f}")
    if p.stage_of(p.leader_id) is None:
        lines.append(f"  leader {p.leader_id} holds no layers (embedding, LM head, draft head: "
                     f"{p.leader_memory_bytes / MB:.0f} MB)")
    for e in p.excluded:
        lines.append(f"  left out {e.agent_id}: {e.reason}")
    return "\n".join(lines)
