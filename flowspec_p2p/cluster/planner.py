"""The capability-aware pipeline planner: a pure function from devices and a model to an ordered list of stages.

No asyncio, no I/O; the data it works on and produces (devices, model sizes, the plan, diffs) is plans.py's.
Anchors: Petals ``server/block_selection.py`` (pure re-balancer), exo 1.x ``master/placement.py`` (plan +
transition diff).

Glossary (used the same way in membership.py, plans.py and agent.py):

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

Memory: a device offers ``memory_bytes`` for the model (``--memory-mb``; its agent's own runtime comes on top). The
planner counts against it the weights as the engine holds them (describe_model asks the engine, tensor by tensor),
the KV cache of ``kv_requests`` requests over ``context`` tokens on its layers, and the activations, and leaves
``headroom`` of each offer free. ``Stage.memory_bytes`` is that count and ``Stage.expected_rss`` adds the agent's
runtime (``runtime_bytes``, measured by the agent): what the stage's resident set should be (bench/scale.py checks
it). When nothing fits, PlanInfeasible says by how much (``shortfall``): the least extra memory, spread as the
closest plan would need it, that makes a plan fit.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from ..errors import PlanInfeasible
from ..types import LayerRange
from .plans import DEFAULT_RUNTIME_BYTES, MB, Device, Excluded, ModelSizes, Plan, PlanOptions, Stage

ROUND_TRIP_WEIGHT = 0.25  # share of the round trip that pipelined decoding cannot hide (verification points)
EXHAUSTIVE_MAX_DEVICES = 8  # beyond this many devices, only prefixes of a few orderings are tried
DEFAULT_LINK_MBPS = 100.0  # a device that reports no link estimate
DEFAULT_MAX_REQUESTS = 8  # requests in flight the leader plans for when none is configured (fewer where memory ends)
ACTIVATION_FACTOR = 24  # working-set floats per token per hidden unit (qkv, MLP intermediate, scores)


# ------------------------------------------------------------------------------------------ the costs


def runtime_bytes(d: Device) -> int:
    return DEFAULT_RUNTIME_BYTES if d.runtime_bytes is None else d.runtime_bytes


class _Costs:
    """Per-device cost functions for one (model, options). All times in seconds."""

    def __init__(self, model: ModelSizes, opts: PlanOptions):
        self.m = model
        self.t = opts.tokens_per_step
        self.kv_per_layer = model.kv_bytes_per_token * model.context * opts.kv_requests
        self.act = ACTIVATION_FACTOR * self.t * model.hidden_size * model.dtype_bytes
        self.prefix = [0, *itertools.accumulate(model.layer_bytes)]  # prefix sums of layer bytes
        self.headroom = opts.headroom

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

    def fixed_s(self, d: Device, stages: int) -> float:
        """A stage's busy time per step besides its layers: the leader's head and draft work, and sending the
        activations on (nothing to send when the leader is the only stage)."""
        return (self.leader_work_s(d) if d.leader else 0.0) + (0.0 if d.leader and stages == 1 else self.send_s(d))

    def fixed_bytes(self, d: Device, embed: bool, head: bool) -> int:
        """Memory a stage needs besides its layers' weights and KV."""
        if d.leader:  # the leader holds embedding, head and draft anyway
            return self.leader_extra_bytes() + self.act
        return self.act + (self.m.embed_bytes if embed else 0) + (self.m.norm_bytes if head else 0)

    def range_bytes(self, start: int, end: int) -> int:
        return self.prefix[end] - self.prefix[start] + (end - start) * self.kv_per_layer

    def usable(self, d: Device) -> int:
        """Bytes of ``d``'s offer the plan may use: all but the headroom."""
        return int(d.memory_bytes * (1.0 - self.headroom))

    def fits(self, d: Device, start: int, end: int, embed: bool, head: bool) -> bool:
        return self.fixed_bytes(d, embed, head) + self.range_bytes(start, end) <= self.usable(d)


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
        fixed = c.fixed_s(d, k)
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
        fixed, per = c.fixed_s(d, k), c.per_layer_s(d)
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
    busy = [c.fixed_s(d, k) + n * c.per_layer_s(d) for d, n in zip(order, counts, strict=True)]
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


def plan(devices: Sequence[Device], model: ModelSizes, options: PlanOptions | None = None, *,
         explain: bool = True) -> Plan:
    """Choose the stages. Deterministic: the same devices (in any order), model and options give the same plan.
    Raises PlanInfeasible, saying by how much memory falls short unless ``explain`` is False (quicker)."""
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
    if need > c.usable(leader):
        _infeasible(devices, model, opts, explain,
                    f"the leader {leader.id} needs {need / MB:.0f} MB for the embedding, LM head and draft head "
                    f"and {opts.headroom:.0%} headroom, but offers {leader.memory_bytes / MB:.0f} MB")
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
        _infeasible(devices, model, opts, explain,
                    f"{model.name} ({model.num_layers} layers, {model.context}-token context, KV for "
                    f"{opts.kv_requests} request(s)) does not fit{want} on {len(devices)} device(s) offering "
                    f"{total / MB:.0f} MB in all")
    return _build(c, model, opts, best, leader, devices, best_with)


def _infeasible(devices: Sequence[Device], model: ModelSizes, opts: PlanOptions, explain: bool, what: str):
    """Raise PlanInfeasible: ``what`` went wrong and, when ``explain``, by how much memory (``shortfall``)."""
    short = shortfall(devices, model, opts) if explain else None
    if short is None:
        raise PlanInfeasible(what)
    n, needs = short
    raise PlanInfeasible(f"short by {math.ceil(n / MB)} MB: {what}; the closest plan needs "
                         + ", ".join(f"{math.ceil(b / MB)} MB more on {a}" for a, b in needs.items())
                         + "; give agents more --memory-mb, add agents, or lower --context/--max-requests",
                         short_bytes=n)


def shortfall(devices: Sequence[Device], model: ModelSizes, opts: PlanOptions) -> tuple[int, dict[str, int]] | None:
    """How much memory is missing for any plan: the smallest offer added to every device alike (to a MB) that lets
    a plan fit, and what that plan then needs beyond each device's real offer. -> (bytes in all, {agent: bytes}),
    or None when more memory would not help (a forced stage count beyond the devices)."""
    c = _Costs(model, opts)
    need = sum(model.layer_bytes) + model.num_layers * c.kv_per_layer + c.leader_extra_bytes() + model.embed_bytes
    need += len(devices) * (c.act + model.norm_bytes)
    hi = math.ceil(need / (1.0 - opts.headroom) / MB) + 1  # MB every device could add: enough for one to hold it all

    def attempt(mb: int) -> Plan | None:
        more = [d.model_copy(update={"memory_bytes": d.memory_bytes + mb * MB}) for d in devices]
        try:
            return plan(more, model, opts, explain=False)
        except PlanInfeasible:
            return None

    if attempt(hi) is None:
        return None
    lo = 0
    while lo < hi:
        mid = (lo + hi) // 2
        if attempt(mid) is None:
            lo = mid + 1
        else:
            hi = mid
    best = attempt(lo)
    offered = {d.id: d.memory_bytes for d in devices}
    counted = {s.agent_id: s.memory_bytes for s in best.stages}
    counted.setdefault(best.leader_id, best.leader_memory_bytes)
    needs = {a: math.ceil(b / (1.0 - opts.headroom) - offered[a]) for a, b in counted.items()}
    needs = {a: b for a, b in needs.items() if b > 0}
    return sum(needs.values()), needs


def plan_requests(devices: Sequence[Device], model: ModelSizes, options: PlanOptions | None = None, *,
                  requests: int | None = None, most: int = DEFAULT_MAX_REQUESTS) -> tuple[Plan, int]:
    """The plan for ``requests`` requests in flight (the KV of each on every stage, ``PlanOptions.kv_requests``),
    or, with None, for as many as fit, from ``most`` down to one (memory decides: the same devices hold fewer
    requests' KV beside more layers). -> (plan, requests it holds)"""
    opts = options or PlanOptions()
    if requests is not None:
        return plan(devices, model, opts.model_copy(update={"kv_requests": requests})), requests
    for n in range(most, 1, -1):
        try:
            return plan(devices, model, opts.model_copy(update={"kv_requests": n}), explain=False), n
        except PlanInfeasible:
            continue
    return plan(devices, model, opts.model_copy(update={"kv_requests": 1})), 1


def _build(c: _Costs, model: ModelSizes, opts: PlanOptions, best: _Candidate, leader: Device,
           devices: Sequence[Device], best_with: dict[str, float]) -> Plan:
    stages = []
    start = 0
    k = len(best.order)
    for i, (d, n, busy) in enumerate(zip(best.order, best.counts, best.busy, strict=True)):
        embed, head = i == 0, i == k - 1
        mem = c.fixed_bytes(d, embed, head) + c.range_bytes(start, start + n)
        stages.append(Stage(agent_id=d.id, layers=LayerRange(start=start, end=start + n), embed=embed, head=head,
                            memory_bytes=mem, busy_ms=round(busy * 1e3, 4), runtime_bytes=runtime_bytes(d)))
        start += n
    chosen = {d.id for d in best.order}
    excluded = []
    for d in devices:
        if d.id in chosen or d.leader:
            continue
        one = c.fixed_bytes(d, False, False) + c.range_bytes(0, 1)
        if one > c.usable(d):
            reason = (f"memory: one layer needs {one / MB:.0f} MB, it offers {d.memory_bytes / MB:.0f} MB "
                      f"({opts.headroom:.0%} kept free)")
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
        kv_requests=opts.kv_requests,
        headroom=opts.headroom,
    )
