"""The pure core of a pipeline stage: per-request KV caches and pending-tree bookkeeping, driven by data-plane
messages (messages.py) applied strictly in arrival order. No asyncio, no I/O: the async worker feeds it.

Invariant (flowspec-algorithm.md §5.3), for every request on every stage after every message:

    KV slots = [committed prefix | pending tree nodes 0 .. P-1 that are live, in tree-index order]

and ``parents[i]`` / ``depth[i]`` / ``slot[i]`` describe pending node i (parent -1 = hangs off the committed
prefix; slot = its offset in the pending KV region, or None for a *dead* node: one a queued prune discards, which
this stage skipped — see messages.py, look-ahead). A node's position is committed + depth; it attends to the
committed prefix, its pending ancestors and itself. Dead nodes are never anyone's ancestor (prunes keep
ancestor-closed sets), and the next prune removes them from the indexing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise

import torch

from ..errors import ContextOverflow, FlowSpecError, ForwardStopped, ProtocolError
from ..model.dtypes import dtype_name
from ..model.engine import BatchRows, Shard
from ..model.kv_cache import KVCache
from .messages import MAX_ERROR_TEXT, MAX_NODES, DataMessage, Forward, Prune, Release, StageError, TensorSpec

log = logging.getLogger(__name__)

MAX_REQUESTS = 16  # request states one inbound link may hold; its least recently used one is evicted beyond this
MAX_TOTAL_REQUESTS = 64  # request states a stage holds over all its links; a new request beyond this is refused
MAX_PENDING = MAX_NODES  # pending tree nodes (live and dead) a request may hold on a stage
MAX_RETAINED = 16  # finished requests' KV kept for a later request (Release.retain); the oldest goes beyond this


Tensors = dict[str, torch.Tensor]


@dataclass
class _Planned:
    """A forward checked and placed, before its live rows run (StageCore._plan)."""

    state: RequestState
    msg: Forward
    parents: list[int]  # the pending tree with the new nodes
    depth: list[int]
    dead: set[int]  # rows of msg not computed
    slot: list[int | None]
    live: list[int]  # rows of msg computed, in order
    rows: BatchRows | None  # the live rows' input, cache, positions and mask; None when none is live


@dataclass
class RequestState:
    cache: KVCache
    parents: list[int] = field(default_factory=list)  # per pending node
    depth: list[int] = field(default_factory=list)  # per pending node
    slot: list[int | None] = field(default_factory=list)  # per pending node: pending KV offset, None if dead
    next_seq: int = 0
    link: int = 0  # the inbound link that opened it: only messages of that link touch it


def ancestor_mask(committed: int, parents: list[int], first: int, slot: list[int | None] | None = None,
                  rows: list[int] | None = None) -> torch.Tensor:
    """Visibility of new nodes over [committed prefix | pending KV]. Nodes ``first + r`` for r in ``rows`` (default
    all from ``first``); ``slot`` maps a node to its pending KV offset (default: the node index itself).
    -> bool [len(rows), committed + width], width = number of pending slots including the new ones."""
    n = len(parents)
    rows = list(range(n - first)) if rows is None else rows
    width = n if slot is None else 1 + max((s for s in slot if s is not None), default=-1)
    mask = torch.zeros(len(rows), committed + width, dtype=torch.bool)
    mask[:, :committed] = True
    for r, i in enumerate(rows):
        j = first + i
        while j != -1:
            mask[r, committed + (j if slot is None else slot[j])] = True
            j = parents[j]
    return mask


def is_chain(parents: list[int], first: int) -> bool:
    """True when the new nodes continue a plain sequence: node first+i has parent first+i-1 (or -1 at 0)."""
    return first == 0 and all(p == i - 1 for i, p in enumerate(parents))


class StageCore:
    """Applies data-plane messages to one shard. ``handle`` returns the message (and tensors) to pass on."""

    def __init__(self, shard: Shard, *, index: int, capacity: int, wire_dtype: torch.dtype = torch.float16,
                 caches: int = 0):
        """``caches``: KV caches made now, one per request the plan holds in flight, so the stage's memory is what
        the planner counted from the first request on (and stays so under load) instead of growing with it."""
        self.shard = shard
        self.index = index
        self.capacity = capacity
        self.wire_dtype = wire_dtype
        self.requests: dict[str, RequestState] = {}
        self.retained: dict[str, RequestState] = {}  # finished requests' committed KV, oldest first (the prompt cache)
        self._free: list[KVCache] = [self._touched(shard.new_cache(capacity)) for _ in range(caches)]
        self.counters = {"forwards": 0, "tokens": 0, "prunes": 0, "errors": 0, "retained": 0, "reused": 0}

    # ------------------------------------------------------------------------------------------ dispatch

    def handle(self, msg: DataMessage, tensors: Tensors, upcoming: Sequence[DataMessage] = (),
               stop: Callable[[], bool] | None = None, link: int = 0) -> tuple[DataMessage, Tensors] | None:
        """Apply one message that arrived on inbound link ``link``. Errors specific to a request become a StageError
        passed on; they never raise. ``upcoming``: messages of the same link queued behind this one (look-ahead: a
        Forward skips rows a queued Prune discards). ``stop``: asked between layers of a tree forward; yes means a
        prune that arrived since discards every node of it, so the forward stops there and passes its rows on as
        dead (the worker decides, worker.py). -> None when the message names a request another link holds: it is
        dropped (logged and counted), and that request goes on untouched."""
        held = self.requests.get(msg.request_id)
        if held is not None and held.link != link:
            self.counters["foreign"] = self.counters.get("foreign", 0) + 1
            log.warning("stage %d: dropped a %s for request %s from link %d: link %d holds it", self.index, msg.kind,
                        msg.request_id, link, held.link)
            return None
        if isinstance(msg, StageError):
            self.drop(msg.request_id)
            return msg, {}
        try:
            state = self._state(msg, link)
            if isinstance(msg, Forward):
                out = self._forward(state, msg, tensors, _next_prune(msg.request_id, upcoming), stop)
            elif isinstance(msg, Prune):
                self._prune(state, msg)
                out = (msg, {})
            elif isinstance(msg, Release):
                self._release(msg, state)
                out = (msg, {})
            else:
                raise ProtocolError(f"unexpected message {type(msg).__name__}")
            state.next_seq = msg.seq + 1
            return out
        except Exception as e:
            return self._failed(msg, e)

    def _failed(self, msg: DataMessage, e: Exception) -> tuple[StageError, Tensors]:
        """A request's message failed: that request ends here (its state freed), never the stage."""
        self.counters["errors"] += 1
        self.drop(msg.request_id)
        if isinstance(e, FlowSpecError):
            log.warning("stage %d: request %s failed: %s", self.index, msg.request_id, e)
        else:
            log.error("stage %d: request %s failed", self.index, msg.request_id, exc_info=e)
        text = f"{type(e).__name__}: {e}" if not isinstance(e, FlowSpecError) else str(e)
        return StageError(request_id=msg.request_id, seq=msg.seq, stage=self.index, message=text[:MAX_ERROR_TEXT]), {}

    def drop(self, rid: str, retained: bool = False) -> None:
        """Forget a request's state (one in flight, or with ``retained`` a retained one); its KV cache goes back to
        the pool the next request's comes from, so a stage under load reuses the same memory instead of growing."""
        state = (self.retained if retained else self.requests).pop(rid, None)
        if state is not None and state.cache is not None and len(self._free) < MAX_REQUESTS:
            self._free.append(state.cache)

    @staticmethod
    def _touched(cache: KVCache) -> KVCache:
        for t in (cache.k, cache.v):
            t.zero_()  # resident now, not at the first requests
        return cache

    def _new_cache(self) -> KVCache:
        """A request's KV cache: a freed one (emptied: slots beyond ``length`` are never read) or a new one."""
        if self._free:
            cache = self._free.pop()
            cache.reset()
            return cache
        return self.shard.new_cache(self.capacity)

    def _release(self, msg: Release, state: RequestState) -> None:
        """Free the request's state, or keep its first ``retain`` committed positions for a later request."""
        if msg.retain is None or state.cache is None:
            self.drop(msg.request_id)
            return
        self.requests.pop(msg.request_id, None)
        if msg.retain > state.cache.committed:
            raise ProtocolError(f"request {msg.request_id} retains {msg.retain} positions; it committed "
                                f"{state.cache.committed}")
        state.cache.truncate(msg.retain)
        state.parents, state.depth, state.slot = [], [], []
        self.retained[msg.request_id] = state
        self.counters["retained"] += 1
        while len(self.retained) > MAX_RETAINED:
            dropped = next(iter(self.retained))
            log.warning("stage %d: dropping retained request %s (more than %d kept)", self.index, dropped,
                        MAX_RETAINED)
            self.drop(dropped, retained=True)

    def _reused(self, msg: Forward, link: int) -> RequestState:
        """A request's first forward that starts from a retained request's KV: its first ``positions[0]``
        committed positions (the rest dropped), taken over by the new request."""
        old = self.retained.get(msg.reuse)
        if old is None or old.link != link:
            raise ProtocolError(f"request {msg.request_id} reuses {msg.reuse}, which this stage does not hold")
        keep = min(msg.positions) if msg.positions else 0
        if not 0 < keep <= old.cache.committed:
            raise ProtocolError(f"request {msg.request_id} reuses {keep} positions of {msg.reuse}, which holds "
                                f"{old.cache.committed}")
        del self.retained[msg.reuse]
        old.cache.truncate(keep)
        self.counters["reused"] += 1
        return RequestState(cache=old.cache, link=link)

    def _state(self, msg: DataMessage, link: int) -> RequestState:
        state = self.requests.get(msg.request_id)
        if state is None:
            if msg.seq != 0 or not isinstance(msg, Forward):
                if isinstance(msg, Release):  # releasing an unknown request is harmless; a retained one is freed
                    held = self.retained.get(msg.request_id)
                    if held is not None and held.link == link and msg.retain is None:
                        self.drop(msg.request_id, retained=True)
                    return RequestState(cache=None)  # type: ignore[arg-type]
                raise ProtocolError(f"unknown request {msg.request_id} at seq {msg.seq}")
            self._check_opening(msg)
            mine = [rid for rid, st in self.requests.items() if st.link == link]
            if len(mine) >= MAX_REQUESTS:
                log.warning("stage %d: evicting request %s (link %d holds %d requests)", self.index, mine[0], link,
                            len(mine))
                self.drop(mine[0])
            elif len(self.requests) >= MAX_TOTAL_REQUESTS:
                raise ProtocolError(f"this stage holds {len(self.requests)} requests; refusing a new one")
            if msg.reuse is not None:
                state = self._reused(msg, link)
            else:
                state = RequestState(cache=self._new_cache(), link=link)
        else:
            if msg.seq != state.next_seq:
                raise ProtocolError(f"request {msg.request_id}: expected seq {state.next_seq}, got {msg.seq}")
            del self.requests[msg.request_id]  # re-inserted below: the dict's order is least recently used first
        self.requests[msg.request_id] = state
        return state

    def _check_opening(self, msg: Forward) -> None:
        """A request's first forward, checked before its KV cache is allocated: it starts an empty tree at
        position 0 and fits the capacity."""
        m = len(msg.parents)
        if m == 0 or len(msg.positions) != m or msg.first != 0:
            raise ProtocolError(f"a request's first forward starts at node 0 with one position per node (got "
                                f"first {msg.first}, {m} parents, {len(msg.positions)} positions)")
        if msg.reuse is None and min(msg.positions) != 0:
            raise ProtocolError(f"request {msg.request_id} starts at position {min(msg.positions)} without a "
                                "retained request to reuse")
        if m > self.capacity or max(msg.positions) >= self.capacity:
            raise ContextOverflow(f"request {msg.request_id} exceeds this stage's KV capacity {self.capacity}")

    # ---------------------------------------------------------------------------------------- messages

    def _forward(self, state: RequestState, msg: Forward, tensors: Tensors, ahead: Prune | None,
                 stop: Callable[[], bool] | None = None) -> tuple[Forward, Tensors]:
        """Check the new nodes against the pending tree, skip the dead ones, run the live ones through the shard."""
        plan = self._plan(state, msg, tensors, ahead)
        y = None
        if plan.rows is not None:
            try:
                with torch.inference_mode():
                    y = self.shard(plan.rows.x, plan.rows.cache, positions=plan.rows.positions, mask=plan.rows.mask,
                                   stop=None if msg.commit else stop)[0]  # [n_live, hidden]
            except ForwardStopped as e:  # the reserved slots hold nothing: no node points at them, the prune drops them
                log.debug("stage %d: request %s forward %d %s", self.index, msg.request_id, msg.tag, e)
                plan.dead |= set(plan.live)
                plan.slot = [None if i >= msg.first and i - msg.first in plan.dead else s
                             for i, s in enumerate(plan.slot)]
                plan.live = []
                self.counters["stopped"] = self.counters.get("stopped", 0) + 1
        return self._finish(plan, y)

    def _plan(self, state: RequestState, msg: Forward, tensors: Tensors, ahead: Prune | None) -> _Planned:
        """Everything about a forward but running it: the tree extended, the rows placed, the live rows' input,
        positions and mask (``rows``; None when no row is live)."""
        cache, first = state.cache, msg.first
        parents, depth = self._extend_tree(state, msg)
        dead, slot, live = self._place_rows(state, msg, ahead)
        rows = None
        if live:
            mask = None
            if dead or not (cache.pending == 0 and is_chain(msg.parents, 0)):
                mask = ancestor_mask(cache.committed, parents, first, slot, live)[None]  # [1, n_live, C + slots]
            x = self._input(msg, tensors, len(msg.parents))  # [1, m] ids or [1, m, hidden]
            positions = torch.tensor([[msg.positions[i] for i in live]], dtype=torch.long)  # [1, n_live]
            rows = BatchRows(x[:, torch.tensor(live)], cache, positions, mask)
        return _Planned(state, msg, parents, depth, dead, slot, live, rows)

    def _finish(self, plan: _Planned, y: torch.Tensor | None) -> tuple[Forward, Tensors]:
        """Bookkeeping after the live rows ran (``y`` [n_live, hidden]): the pending tree, a commit, the output."""
        state, msg = plan.state, plan.msg
        m = len(msg.parents)
        name = "features" if self.shard.has_head else "hidden"
        out = torch.zeros(m, self.shard.cfg.hidden_size, dtype=self.wire_dtype)  # [m, hidden]
        if plan.live and y is not None:
            out[torch.tensor(plan.live)] = y.to(self.wire_dtype)
        state.parents, state.depth, state.slot = plan.parents, plan.depth, plan.slot
        if msg.commit:
            state.cache.commit(m)
            state.parents, state.depth, state.slot = [], [], []
        self.counters["forwards"] += 1
        self.counters["tokens"] += len(plan.live)
        self.counters["skipped"] = self.counters.get("skipped", 0) + m - len(plan.live)
        spec = TensorSpec(name=name, dtype=dtype_name(self.wire_dtype), shape=tuple(out.shape))
        return msg.model_copy(update={"tensors": [spec], "dead": sorted(plan.dead)}), {name: out}

    def handle_batch(self, items: Sequence[tuple[Forward, Tensors, Sequence[DataMessage], int]]
                     ) -> list[tuple[DataMessage, Tensors] | None]:
        """Forwards of different requests (each (msg, tensors, upcoming, link), as ``handle`` takes them) applied
        together: every live row of every request in one ``shard.forward_batch`` call, each request's rows under
        its own cache and mask, so each gets exactly what ``handle`` would give it alone. -> per item what
        ``handle`` returns."""
        assert len({msg.request_id for msg, *_ in items}) == len(items), "one forward per request in a batch"
        results: list[tuple[DataMessage, Tensors] | None] = [None] * len(items)
        plans: dict[int, _Planned] = {}
        for i, (msg, tensors, upcoming, link) in enumerate(items):
            held = self.requests.get(msg.request_id)
            if held is not None and held.link != link:
                results[i] = self.handle(msg, tensors, upcoming, link=link)  # dropped, as handle does
                continue
            try:
                plans[i] = self._plan(self._state(msg, link), msg, tensors, _next_prune(msg.request_id, upcoming))
            except Exception as e:
                results[i] = self._failed(msg, e)
        live = [i for i, p in plans.items() if p.rows is not None]
        outs: list[torch.Tensor] = []
        try:
            with torch.inference_mode():
                outs = [o[0] for o in self.shard.forward_batch([plans[i].rows for i in live])] if live else []
        except Exception as e:
            for i in plans:
                results[i] = self._failed(items[i][0], e)
            return results
        ys = dict(zip(live, outs, strict=True))
        for i, plan in plans.items():
            results[i] = self._finish(plan, ys.get(i))
            plan.state.next_seq = plan.msg.seq + 1
        self.counters["batches"] = self.counters.get("batches", 0) + (len(items) > 1)
        return results

    def _extend_tree(self, state: RequestState, msg: Forward) -> tuple[list[int], list[int]]:
        """Validate the new nodes (parents before children, positions = committed + depth, a commit is a plain
        chain on an empty tree) -> (parents, depth) of the pending tree with them."""
        m, first = len(msg.parents), msg.first
        if m == 0 or len(msg.positions) != m:
            raise ProtocolError(f"forward needs one parent and one position per node (got {m}, {len(msg.positions)})")
        if first != len(state.parents):
            raise ProtocolError(f"forward starts at node {first} but this stage holds {len(state.parents)} pending")
        if first + m > MAX_PENDING:
            raise ProtocolError(f"forward would grow the pending tree to {first + m} nodes (at most {MAX_PENDING})")
        if state.cache.committed + first + m > state.cache.capacity:  # every node, dead or live, counts
            raise ContextOverflow(f"request {msg.request_id} exceeds this stage's KV capacity {state.cache.capacity}")
        if msg.commit and (state.parents or msg.dead):
            raise ProtocolError("a committing forward needs an empty pending tree and no dead rows")
        if any(not 0 <= r < m for r in msg.dead):
            raise ProtocolError(f"dead rows {msg.dead} out of range")
        parents = state.parents + list(msg.parents)
        depth = list(state.depth)
        for i, p in enumerate(msg.parents):
            if not -1 <= p < first + i:
                raise ProtocolError(f"node {first + i} has invalid parent {p}")
            d = 0 if p == -1 else depth[p] + 1
            if msg.positions[i] != state.cache.committed + d:
                raise ProtocolError(f"node {first + i}: position {msg.positions[i]} != {state.cache.committed + d}")
            depth.append(d)
        if msg.commit and not is_chain(msg.parents, 0):
            raise ProtocolError("a committing forward must be a plain chain")
        return parents, depth

    def _place_rows(self, state: RequestState, msg: Forward, ahead: Prune | None
                    ) -> tuple[set[int], list[int | None], list[int]]:
        """Dead rows (marked upstream, or discarded by the prune queued behind: look-ahead) take no KV slot.
        -> (dead rows, pending slot per node, live rows)"""
        cache, first = state.cache, msg.first
        dead = set(msg.dead)
        if ahead is not None and not msg.commit:
            kept = set(ahead.keep)
            dead |= {i for i in range(len(msg.parents)) if first + i not in kept}
        slot = list(state.slot)
        live = []
        for i, p in enumerate(msg.parents):
            if p >= 0 and slot[p] is None and i not in dead:
                raise ProtocolError(f"node {first + i} is live but its parent {p} is dead")
            if i in dead:
                slot.append(None)
            else:
                slot.append(cache.pending + len(live))
                live.append(i)
        if cache.length + len(live) > cache.capacity:
            raise ContextOverflow(f"request {msg.request_id} exceeds this stage's KV capacity {cache.capacity}")
        return dead, slot, live

    def _input(self, msg: Forward, tensors: Tensors, m: int) -> torch.Tensor:
        hidden = self.shard.cfg.hidden_size
        if self.shard.has_embed:
            t = tensors.get("tokens")
            if t is None or t.dtype != torch.int64 or tuple(t.shape) != (m,):
                raise ProtocolError(f"stage {self.index} needs tokens int64 [{m}]")
            if int(t.min()) < 0 or int(t.max()) >= self.shard.cfg.vocab_size:
                raise ProtocolError("token id out of range")
            return t[None]
        t = tensors.get("hidden")
        if t is None or not t.is_floating_point() or tuple(t.shape) != (m, hidden):
            raise ProtocolError(f"stage {self.index} needs hidden [{m}, {hidden}]")
        return t[None].to(self.shard.dtype)

    def _prune(self, state: RequestState, msg: Prune) -> None:
        cache = state.cache
        keep, a = msg.keep, msg.accept
        pending = len(state.parents)
        if any(k < 0 or k >= pending for k in keep) or any(y <= x for x, y in pairwise(keep)):
            raise ProtocolError(f"prune keeps {keep}: need strictly increasing indices below {pending}")
        if a > len(keep):
            raise ProtocolError(f"prune accepts {a} of only {len(keep)} kept nodes")
        parents, slot = state.parents, state.slot
        if any(slot[k] is None for k in keep):
            raise ProtocolError("prune keeps a node this stage skipped as dead")
        for i in range(a):  # the accepted nodes form a chain hanging off the committed prefix
            want = -1 if i == 0 else keep[i - 1]
            if parents[keep[i]] != want:
                raise ProtocolError(f"accepted node {keep[i]} does not continue the accepted path")
        last = keep[a - 1] if a else -1
        new_index = {old: new - a for new, old in enumerate(keep) if new >= a}
        new_parents, new_depth = [], []
        for old in keep[a:]:
            p = parents[old]
            if p == last:
                new_parents.append(-1)
            elif p in new_index:
                new_parents.append(new_index[p])
            else:
                raise ProtocolError(f"kept node {old} lost its parent {p}")
            new_depth.append(state.depth[old] - a)
        cache.keep([slot[k] for k in keep])
        cache.commit(a)
        state.parents, state.depth = new_parents, new_depth
        state.slot = list(range(len(new_parents)))
        self.counters["prunes"] += 1


def _next_prune(request_id: str, upcoming: Sequence[DataMessage]) -> Prune | None:
    """The first Prune of ``request_id`` among the queued messages, unless a Release or an error comes first."""
    for m in upcoming:
        if getattr(m, "request_id", None) != request_id:
            continue
        if isinstance(m, Prune):
            return m
        if isinstance(m, Release | StageError):
            return None
    return None
