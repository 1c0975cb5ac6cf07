"""The capability-aware pipeline planner: a pure function from devices and a model to an ordered list of stages.

No asyncio, no I/O (``describe_model`` only reads tensor sizes and the config of an open source). Anchors: Petals
``server/block_selection.py`` (pure re-balancer), exo 1.x ``master/placement.py`` (plan + transition diff).

Glossary (used the same way in cluster.py, agent.py and the rendering below):

    stage        a device holding a contiguous, half-open range of decoder layers ``[start, end)``. Stage 1 also
                 holds the token embedding (it receives token ids), the last stage the final norm
    leader       the device serving the API. As in FlowSpec (flowspec-algorithm.md §1.1) it holds the embedding,
                 the LM head and the draft head, and may *also* be stage 1 when that is faster
    step         one pipeline step: ``tokens_per_step`` tokens (a segment) pass through every stage
    busy time    seconds a stage is occupied per step: its layers' compute + serialising the activations it sends
    bottleneck   the largest busy time (the leader's head/draft work included): with segments in flight
                 (Chunk-PP, FlowSpec) it sets the throughput
    round trip   busy times + hop latencies + leader work: the latency of one token when nothing overlaps (AR)
    cost         bottleneck + ROUND_TRIP_WEIGHT * round trip -- what the planner minimises

Algorithm: for each candidate set of layer-holding devices (all subsets up to EXHAUSTIVE_MAX_DEVICES devices,
prefixes of a few orderings beyond), in a fixed order (leader first, then by compute), find the smallest
bottleneck B for which a greedy front-to-back assignment fits every layer -- greedy is optimal for a fixed order
because a stage's capacity (time and memory) only shrinks with a shorter remaining suffix -- by binary search
over the finitely many candidate busy times. The cheapest candidate wins; ties go to fewer stages, then ids.
A device left out gets a reason (memory, or the cost of the best plan that would include it). A single device
wins whenever it is cheaper than any split, which on a fast leader with enough memory is common.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Literal

from pydantic import Field

from ..errors import PlanInfeasible
from ..types import FrozenModel, LayerRange

ROUND_TRIP_WEIGHT = 0.25  # share of the round trip that pipelined decoding cannot hide (verification points)
EXHAUSTIVE_MAX_DEVICES = 8  # beyond this many devices, only prefixes of a few orderings are tried
DEFAULT_LINK_MBPS = 100.0  # a device that reports no link estimate
ACTIVATION_FACTOR = 24  # working-set floats per token per hidden unit (qkv, MLP intermediate, scores)
MB = 1024 * 1024


class Device(FrozenModel):
    """What the planner knows of a device (from its advertised profile)."""

    id: str
    memory_bytes: int = Field(ge=0)  # offered for weights + KV cache + activations
    gflops: float = Field(gt=0)  # measured decoder-block throughput (after any emulated slowdown)
    link_mbps: float | None = Field(default=None, gt=0)  # its link to the LAN; None = DEFAULT_LINK_MBPS
    latency_ms: float = Field(default=0.0, ge=0)  # one-way latency of its link
    leader: bool = False


class ModelSizes(FrozenModel):
    """What the planner knows of a model: sizes in the *runtime* dtype, FLOPs per token."""

    name: str
    fingerprint: str = ""
    num_layers: int = Field(ge=1)
    layer_bytes: tuple[int, ...]  # per layer, runtime dtype
    embed_bytes: int  # token embedding table (stage 1 and the leader)
    tied_embeddings: bool = False  # the leader's embedding is a view of its LM head (shard.py): no extra bytes
    head_bytes: int  # final norm + LM head (the leader)
    norm_bytes: int = 0  # the final norm alone (the last stage)
    draft_bytes: int = 0  # draft head (the leader)
    kv_bytes_per_token: int  # K + V of one token in one layer, runtime dtype
    hidden_size: int
    vocab_size: int
    context: int = Field(ge=1)  # tokens of KV cache each stage reserves per request
    layer_flops: float  # per token per layer
    head_flops: float  # per token: LM head (the leader computes logits of every returned node)
    draft_flops: float = 0.0  # per drafted token on the leader
    wire_bytes: int = 2  # bytes per activation element on the wire (float16)
    dtype_bytes: int = 4


class PlanOptions(FrozenModel):
    tokens_per_step: int = Field(default=16, ge=1)  # segment size (1 for plain autoregressive decoding)
    stages: int | None = Field(default=None, ge=1)  # exactly this many layer-holding stages (benchmarks)
    leader_layers: Literal["auto", "always", "never"] = "auto"  # may the leader also be stage 1?
    kv_requests: int = Field(default=1, ge=1)  # concurrent requests whose KV each stage must hold


class Stage(FrozenModel):
    agent_id: str
    layers: LayerRange
    embed: bool
    head: bool
    memory_bytes: int
    busy_ms: float


class Excluded(FrozenModel):
    agent_id: str
    reason: str


class Plan(FrozenModel):
    model: str
    fingerprint: str = ""
    num_layers: int
    leader_id: str
    stages: tuple[Stage, ...]
    leader_memory_bytes: int
    leader_work_ms: float  # LM head + draft per step, on the leader
    bottleneck_ms: float
    round_trip_ms: float
    cost_ms: float
    tokens_per_step: int
    excluded: tuple[Excluded, ...] = ()

    def stage_of(self, agent_id: str) -> Stage | None:
        return next((s for s in self.stages if s.agent_id == agent_id), None)

    @property
    def agents(self) -> tuple[str, ...]:
        return tuple(s.agent_id for s in self.stages)


class Change(FrozenModel):
    """One explicit transition between two plans (see ``diff``)."""

    kind: Literal["assign", "release", "move", "reorder", "leader"]
    agent_id: str
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


def describe_model(source, *, context: int, name: str | None = None, fingerprint: str = "",
                   draft_params: int | None = None, dtype_bytes: int = 4, packed: bool = False,
                   draft_extra_bytes: int = 0) -> ModelSizes:
    """A ModelSizes from an open weight source's config (runtime sizes are parameters x ``dtype_bytes``).
    ``packed``: stages keep a second, packed copy of their layers for tree forwards (shard.py), so a
    layer (and the draft head's block, and the LM head) takes twice its bytes. ``draft_extra_bytes``: what the
    leader's drafter holds beyond its head (HeadDrafter.extra_bytes: its reduced LM-head copy)."""
    cfg = source.config
    h, v = cfg.hidden_size, cfg.vocab_size
    layer = cfg.layer_params()
    if draft_params is None:  # EAGLE-1 head: fc 2H->H + one decoder block without the input norm
        draft_params = 2 * h * h + layer - h
    return ModelSizes(
        name=name or (getattr(source, "path", None) and source.path.name) or cfg.arch,
        fingerprint=fingerprint,
        num_layers=cfg.num_layers,
        layer_bytes=(layer * dtype_bytes * (2 if packed else 1),) * cfg.num_layers,
        embed_bytes=v * h * dtype_bytes,
        tied_embeddings=cfg.tie_embeddings,
        head_bytes=(v * h * (2 if packed else 1) + h) * dtype_bytes,
        norm_bytes=h * dtype_bytes,
        draft_bytes=(draft_params + (layer if packed else 0)) * dtype_bytes + draft_extra_bytes,  # block packed too
        kv_bytes_per_token=cfg.kv_bytes_per_token(dtype_bytes),
        hidden_size=h,
        vocab_size=v,
        context=min(context, cfg.max_position),
        layer_flops=2.0 * layer,
        head_flops=2.0 * h * v,
        draft_flops=2.0 * draft_params,
        dtype_bytes=dtype_bytes,
    )


# ------------------------------------------------------------------------------------------ the costs


class _Costs:
    """Per-device cost functions for one (model, options). All times in seconds."""

    def __init__(self, model: ModelSizes, opts: PlanOptions):
        self.m = model
        self.t = opts.tokens_per_step
        self.kv_per_layer = model.kv_bytes_per_token * model.context * opts.kv_requests
        self.act = ACTIVATION_FACTOR * self.t * model.hidden_size * model.dtype_bytes
        self.prefix = [0, *itertools.accumulate(model.layer_bytes)]  # prefix sums of layer bytes

    def leader_work_s(self, d: Device) -> float:
        return self.t * (self.m.head_flops + self.m.draft_flops) / (d.gflops * 1e9)

    def leader_extra_bytes(self) -> int:
        m = self.m
        embed = 0 if m.tied_embeddings else m.embed_bytes
        return embed + m.head_bytes + m.draft_bytes + 2 * self.t * m.vocab_size * 4

    def per_layer_s(self, d: Device) -> float:
        return self.t * self.m.layer_flops / (d.gflops * 1e9)

    def send_s(self, d: Device) -> float:
        mbps = d.link_mbps or DEFAULT_LINK_MBPS
        return self.t * self.m.hidden_size * self.m.wire_bytes * 8 / (mbps * 1e6)

    def fixed_bytes(self, d: Device, embed: bool, head: bool) -> int:
        """Memory a stage needs besides its layers' weights and KV."""
        if d.leader:  # the leader holds embedding, head and draft anyway
            return self.leader_extra_bytes() + self.act
        return self.act + (self.m.embed_bytes if embed else 0) + (self.m.norm_bytes if head else 0)

    def range_bytes(self, start: int, end: int) -> int:
        return self.prefix[end] - self.prefix[start] + (end - start) * self.kv_per_layer

    def fits(self, d: Device, start: int, end: int, embed: bool, head: bool) -> bool:
        return self.fixed_bytes(d, embed, head) + self.range_bytes(start, end) <= d.memory_bytes


class _Candidate:
    def __init__(self, cost: float, order: tuple[Device, ...], counts: tuple[int, ...], bottleneck: float,
                 round_trip: float, busy: tuple[float, ...]):
        self.cost, self.order, self.counts = cost, order, counts
        self.bottleneck, self.round_trip, self.busy = bottleneck, round_trip, busy

    def key(self) -> tuple:
        return (round(self.cost, 12), len(self.order), tuple(d.id for d in self.order))


def _assign(c: _Costs, order: Sequence[Device], bound: float) -> list[int] | None:
    """Greedy front-to-back: each stage takes as many layers as fit ``bound`` seconds and its memory, leaving at
    least one layer for every later stage. -> layer counts, or None if the layers do not all fit."""
    L = c.m.num_layers
    counts: list[int] = []
    start = 0
    k = len(order)
    for i, d in enumerate(order):
        embed, head = i == 0, i == k - 1
        fixed = (c.leader_work_s(d) if d.leader else 0.0) + (0.0 if d.leader and k == 1 else c.send_s(d))
        per = c.per_layer_s(d)
        by_time = math.floor((bound - fixed) / per + 1e-9) if bound >= fixed else 0
        most = min(by_time, L - start - (k - 1 - i))
        if head:  # the last stage must take the rest
            most = L - start if most >= L - start else -1
        if most < 1:
            return None
        while most >= 1 and not c.fits(d, start, start + most, embed, head):
            if head:
                return None
            most -= 1
        if most < 1:
            return None
        counts.append(most)
        start += most
    return counts if start == L else None


def _hop_latency_s(a: Device, b: Device) -> float:
    return (a.latency_ms + b.latency_ms) / 1e3


def _evaluate(c: _Costs, order: tuple[Device, ...], leader: Device) -> _Candidate | None:
    """Minimal-bottleneck assignment for this ordered set of stages, or None if infeasible."""
    L = c.m.num_layers
    k = len(order)
    bounds = set()
    for d in order:
        fixed = (c.leader_work_s(d) if d.leader else 0.0) + (0.0 if d.leader and k == 1 else c.send_s(d))
        per = c.per_layer_s(d)
        bounds.update(fixed + n * per for n in range(1, L + 1))
    cand = sorted(bounds)
    lo, hi = 0, len(cand) - 1
    if _assign(c, order, cand[hi]) is None:
        return None
    while lo < hi:  # smallest feasible bound
        mid = (lo + hi) // 2
        if _assign(c, order, cand[mid]) is None:
            lo = mid + 1
        else:
            hi = mid
    counts = _assign(c, order, cand[lo])
    assert counts is not None
    busy = []
    for d, n in zip(order, counts, strict=True):
        send = 0.0 if d.leader and k == 1 else c.send_s(d)
        busy.append(n * c.per_layer_s(d) + send + (c.leader_work_s(d) if d.leader else 0.0))
    leader_busy = 0.0 if leader in order else c.leader_work_s(leader)
    path = ([] if order[0].leader else [leader]) + list(order) + [leader]  # the ring, leader to leader
    hops = sum(_hop_latency_s(a, b) for a, b in itertools.pairwise(path) if a.id != b.id)
    bottleneck = max([*busy, leader_busy])
    round_trip = sum(busy) + leader_busy + hops
    cost = bottleneck + ROUND_TRIP_WEIGHT * round_trip
    return _Candidate(cost, order, tuple(counts), bottleneck, round_trip, tuple(busy))


def _orders(devices: Sequence[Device]) -> list[tuple[Device, ...]]:
    """Orders worth trying for one set of stages. Busy times do not depend on the order; only memory does (stage 1
    holds the embedding, the last stage the head). So: leader first (it holds the embedding anyway), then fastest
    first; plus variants that put the roomiest devices at the two ends."""
    base = tuple(sorted(devices, key=lambda d: (not d.leader, -d.gflops, d.id)))
    if len(base) < 2:
        return [base]
    pinned = base[:1] if base[0].leader else ()
    free = base[len(pinned):]
    roomy = sorted(free, key=lambda d: (-d.memory_bytes, d.id))[:2]
    out = [base]
    firsts = [None] if pinned else roomy
    for first in firsts:
        for last in roomy:
            if last is first:
                continue
            mid = [d for d in free if d is not first and d is not last]
            order = (*pinned, *([first] if first else []), *mid, last)
            if order not in out:
                out.append(order)
    return out


def _subsets(devices: Sequence[Device], leader: Device, opts: PlanOptions):
    others = [d for d in devices if not d.leader]
    pool = [leader, *others] if opts.leader_layers != "never" else others
    sizes = [opts.stages] if opts.stages else range(1, len(pool) + 1)
    if len(pool) <= EXHAUSTIVE_MAX_DEVICES:
        for k in sizes:
            for combo in itertools.combinations(pool, k):
                if opts.leader_layers == "always" and leader not in combo:
                    continue
                yield combo
        return
    seen = set()
    orderings = [
        sorted(pool, key=lambda d: (-d.gflops, d.id)),
        sorted(pool, key=lambda d: (-d.memory_bytes, d.id)),
        sorted(pool, key=lambda d: (-d.gflops * d.memory_bytes, d.id)),
    ]
    for ordering in orderings:
        for with_leader in (True, False):
            seq = [d for d in ordering if with_leader or not d.leader]
            if with_leader and leader in seq:
                seq = [leader] + [d for d in seq if not d.leader]
            for k in sizes:
                combo = tuple(seq[:k])
                if len(combo) != k or (opts.leader_layers == "always" and leader not in combo):
                    continue
                if opts.leader_layers == "never" and leader in combo:
                    continue
                ids = frozenset(d.id for d in combo)
                if ids not in seen:
                    seen.add(ids)
                    yield combo


def plan(devices: Sequence[Device], model: ModelSizes, options: PlanOptions | None = None) -> Plan:
    """Choose the stages. Deterministic: the same devices (in any order), model and options give the same plan."""
    opts = options or PlanOptions()
    devices = sorted(devices, key=lambda d: d.id)
    if len({d.id for d in devices}) != len(devices):
        raise PlanInfeasible("device ids must be unique")
    leaders = [d for d in devices if d.leader]
    if len(leaders) != 1:
        raise PlanInfeasible(f"a plan needs exactly one leader device (got {len(leaders)})")
    if len(model.layer_bytes) != model.num_layers:
        raise PlanInfeasible("layer_bytes must list every layer")
    leader = leaders[0]
    c = _Costs(model, opts)
    need = c.leader_extra_bytes() + c.act
    if need > leader.memory_bytes:
        raise PlanInfeasible(
            f"the leader {leader.id} needs {need / MB:.0f} MB for the embedding, LM head and draft head "
            f"but offers {leader.memory_bytes / MB:.0f} MB"
        )
    best: _Candidate | None = None
    best_with: dict[str, float] = {}
    for combo in _subsets(devices, leader, opts):
        for order in _orders(combo):
            cand = _evaluate(c, order, leader)
            if cand is None:
                continue
            for d in combo:
                best_with[d.id] = min(best_with.get(d.id, math.inf), cand.cost)
            if best is None or cand.key() < best.key():
                best = cand
    if best is None:
        total = sum(d.memory_bytes for d in devices)
        want = f" in exactly {opts.stages} stages" if opts.stages else ""
        raise PlanInfeasible(
            f"{model.name} ({model.num_layers} layers, {model.context}-token context) does not fit{want} on "
            f"{len(devices)} device(s) offering {total / MB:.0f} MB in all"
        )
    return _build(c, model, opts, best, leader, devices, best_with)


def _build(c: _Costs, model: ModelSizes, opts: PlanOptions, best: _Candidate, leader: Device,
           devices: Sequence[Device], best_with: dict[str, float]) -> Plan:
    stages = []
    start = 0
    k = len(best.order)
    for i, (d, n, busy) in enumerate(zip(best.order, best.counts, best.busy, strict=True)):
        embed, head = i == 0, i == k - 1
        mem = c.fixed_bytes(d, embed, head) + c.range_bytes(start, start + n)
        stages.append(Stage(agent_id=d.id, layers=LayerRange(start=start, end=start + n), embed=embed, head=head,
                            memory_bytes=mem, busy_ms=round(busy * 1e3, 4)))
        start += n
    chosen = {d.id for d in best.order}
    excluded = []
    for d in devices:
        if d.id in chosen or d.leader:
            continue
        one = c.fixed_bytes(d, False, False) + c.range_bytes(0, 1)
        if one > d.memory_bytes:
            reason = f"memory: one layer needs {one / MB:.0f} MB, it offers {d.memory_bytes / MB:.0f} MB"
        elif d.id in best_with:
            reason = (f"would slow the pipeline: best plan with it costs {best_with[d.id] * 1e3:.2f} ms "
                      f"per step vs {best.cost * 1e3:.2f} ms")
        else:
            reason = "no feasible plan includes it"
        excluded.append(Excluded(agent_id=d.id, reason=reason))
    leader_stage = next((s for s in stages if s.agent_id == leader.id), None)
    leader_mem = leader_stage.memory_bytes if leader_stage else c.fixed_bytes(leader, False, False)
    return Plan(
        model=model.name,
        fingerprint=model.fingerprint,
        num_layers=model.num_layers,
        leader_id=leader.id,
        stages=tuple(stages),
        leader_memory_bytes=leader_mem,
        leader_work_ms=round(c.leader_work_s(leader) * 1e3, 4),
        bottleneck_ms=round(best.bottleneck * 1e3, 4),
        round_trip_ms=round(best.round_trip * 1e3, 4),
        cost_ms=round(best.cost * 1e3, 4),
        tokens_per_step=opts.tokens_per_step,
        excluded=tuple(excluded),
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
