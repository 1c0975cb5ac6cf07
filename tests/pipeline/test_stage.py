"""The pure stage core: a chain of StageCores equals one whole model, across tree forwards and prunes."""

import random

import pytest
import torch

from flowspec_p2p.model.torch_shard import TorchShard
from flowspec_p2p.model.weights import open_source
from flowspec_p2p.pipeline.messages import Forward, Prune, Release, StageError
from flowspec_p2p.pipeline.stage import StageCore, ancestor_mask
from flowspec_p2p.types import LayerRange

F64 = torch.float64
SEED_STOP = 2


@pytest.fixture(scope="module")
def pipeline(tiny_llama):
    src = open_source(tiny_llama)
    cuts = [(0, 1, True, False), (1, 3, False, False), (3, 4, False, True)]
    stages = [
        StageCore(TorchShard.from_source(src, LayerRange(start=a, end=b), embed=e, head=h, dtype=F64), index=i,
                  capacity=128, wire_dtype=F64)
        for i, (a, b, e, h) in enumerate(cuts)
    ]
    whole = TorchShard.from_source(src, LayerRange(start=0, end=4), embed=True, head=True, dtype=F64)
    return stages, whole


def run(stages, msg, tensors=None, ahead=None, sees=(), stops=None):
    """Pass ``msg`` through the chain; stages whose index is in ``sees`` find ``ahead`` queued behind it; stage i
    gets ``stops[i]`` as its stop callable (the worker's: a prune that arrived meanwhile discards the forward)."""
    for i, s in enumerate(stages):
        msg, tensors = s.handle(msg, tensors or {}, [ahead] if ahead is not None and i in sees else [],
                                (stops or {}).get(i))
        if isinstance(msg, StageError):
            return msg, tensors
    return msg, tensors


def reference(whole, committed, tokens, parents):
    """Features of tree nodes computed from scratch: prefill the committed ids, then the tree with its mask."""
    cache = whole.new_cache(128)
    with torch.inference_mode():
        whole(torch.tensor([committed]), cache)
        depth = []
        for p in parents:
            depth.append(0 if p == -1 else depth[p] + 1)
        mask = ancestor_mask(len(committed), parents, 0)[None]
        pos = torch.tensor([[len(committed) + d for d in depth]])
        return whole(torch.tensor([tokens]), cache, positions=pos, mask=mask)[0]


@pytest.mark.parametrize(("lookahead", "stop"), [(False, False), (True, False), (False, True)])
def test_tree_forwards_and_prunes_match_a_from_scratch_run(pipeline, lookahead, stop):
    """Random trees grown segment by segment, random prunes; with ``lookahead`` some stages see the next prune
    queued behind a forward and skip the rows it discards (the rest learn them from ``Forward.dead``). With
    ``stop``, a forward whose every node the next prune discards is stopped part-way through one stage (after
    0-2 of its layers), as when that prune arrives while the stage computes it."""
    stages, whole = pipeline
    rng = random.Random(SEED_STOP if stop else 1 if lookahead else 0)
    rid, seq = "r1", 0
    committed = [rng.randrange(96) for _ in range(9)]
    out, t = run(stages, Forward(request_id=rid, seq=seq, first=0, parents=[-1, *range(8)],
                                 positions=list(range(9)), commit=True), {"tokens": torch.tensor(committed)})
    seq += 1
    assert isinstance(out, Forward)
    assert t["features"].shape == (9, 64)
    tokens, parents = [], []
    for _ in range(6):
        # grow the pending tree by a random segment (parents among existing nodes), in one or two forwards
        n_new = rng.randrange(1, 6)
        for _ in range(n_new):
            parents.append(rng.randrange(-1, len(parents)) if parents else -1)
            tokens.append(rng.randrange(96))
        first = len(parents) - n_new
        depth = []
        for p in parents:
            depth.append(0 if p == -1 else depth[p] + 1)
        # choose the prune that will follow (accept a path off the committed prefix, keep one subtree below it)
        roots = [i for i, p in enumerate(parents) if p == -1]
        path = [rng.choice(roots)]
        while rng.random() < 0.6:
            kids = [i for i, p in enumerate(parents) if p == path[-1]]
            if not kids:
                break
            path.append(rng.choice(kids))
        accept = rng.randrange(0, len(path) + 1)
        acc = path[:accept]
        last = acc[-1] if acc else -1
        kids = [i for i, p in enumerate(parents) if p == last]
        sub = set()
        if kids:
            stack = [rng.choice(kids)]
            while stack:
                x = stack.pop()
                sub.add(x)
                stack += [i for i, p in enumerate(parents) if p == x]
        keep = sorted(set(acc) | sub)
        prune = Prune(request_id=rid, seq=seq + 1, accept=len(acc), keep=keep)
        msg = Forward(request_id=rid, seq=seq, first=first, parents=parents[first:],
                      positions=[len(committed) + d for d in depth[first:]])
        seq += 1
        skippable = any(i >= first and i not in keep for i in range(len(parents)))
        sees = {rng.randrange(3)} if lookahead and skippable else ()
        stops = None
        if stop and not set(keep) & set(range(first, len(parents))):
            calls = iter(range(rng.randrange(3) + 1))
            stops = {rng.randrange(3): lambda calls=calls: next(calls, None) is None}  # yes after 0-2 layers
        out, t = run(stages, msg, {"tokens": torch.tensor(tokens[first:])}, ahead=prune, sees=sees, stops=stops)
        assert isinstance(out, Forward), out
        ref = reference(whole, committed, tokens, parents)
        dead = set(out.dead)
        if sees:
            assert dead == {r for r in range(len(parents) - first) if first + r not in keep}
        elif stops:
            assert dead == set(range(len(parents) - first))
        else:
            assert not dead
        live = [r for r in range(len(parents) - first) if r not in dead]
        if live:
            assert (t["features"][live] - ref[first:][live]).abs().max() <= 1e-10
        assert not t["features"][sorted(dead)].any()
        out, _ = run(stages, prune)
        seq += 1
        assert isinstance(out, Prune), out
        committed += [tokens[i] for i in acc]
        remap = {old: new for new, old in enumerate(i for i in keep if i not in acc)}
        kept = [i for i in keep if i not in acc]
        tokens = [tokens[i] for i in kept]
        parents = [remap.get(parents[i], -1) for i in kept]
        for s in stages:
            st = s.requests[rid]
            assert st.cache.committed == len(committed)
            assert st.parents == parents
    # the caches now hold exactly the committed prefix + surviving nodes: a final forward still matches
    parents.append(-1)
    tokens.append(5)
    depth = []
    for p in parents:
        depth.append(0 if p == -1 else depth[p] + 1)
    first = len(parents) - 1
    out, t = run(stages, Forward(request_id=rid, seq=seq, first=first, parents=[-1],
                                 positions=[len(committed)]), {"tokens": torch.tensor([5])})
    assert (t["features"] - reference(whole, committed, tokens, parents)[first:]).abs().max() <= 1e-10
    if lookahead:
        assert sum(s.counters.get("skipped", 0) for s in stages) > 0, "look-ahead never skipped a row"
    if stop:
        assert sum(s.counters.get("stopped", 0) for s in stages) > 0, "no forward was stopped"
    out, _ = run(stages, Release(request_id=rid, seq=seq + 1))
    assert isinstance(out, Release)
    assert all(rid not in s.requests for s in stages)


def test_protocol_violations_become_stage_errors_and_drop_the_request(pipeline):
    stages, _ = pipeline
    ok = Forward(request_id="bad", seq=0, first=0, parents=[-1], positions=[0], commit=True)
    assert isinstance(run(stages, ok, {"tokens": torch.tensor([3])})[0], Forward)
    cases = [
        (Forward(request_id="bad", seq=5, first=0, parents=[-1], positions=[1]), {"tokens": torch.tensor([3])}),
        (Forward(request_id="bad", seq=1, first=0, parents=[-1], positions=[7]), {"tokens": torch.tensor([3])}),
        (Forward(request_id="bad", seq=1, first=0, parents=[-1], positions=[1]), {"tokens": torch.tensor([999])}),
        (Forward(request_id="bad", seq=1, first=0, parents=[3], positions=[1]), {"tokens": torch.tensor([3])}),
        (Prune(request_id="bad", seq=1, accept=0, keep=[2, 1]), None),
    ]
    for msg, tensors in cases:
        out, _ = run(stages, msg, tensors)
        assert isinstance(out, StageError), msg
        assert "bad" not in stages[0].requests
        run(stages, ok, {"tokens": torch.tensor([3])})  # recreate for the next case


def test_a_retained_request_s_kv_is_reused_by_the_next_turn_exactly_as_a_cold_prefill(tiny_llama):
    """Release(retain=n) keeps a finished request's first n committed positions; a new request's first forward with
    reuse= takes them over and prefills only the rest: its outputs equal a cold prefill's."""
    src = open_source(tiny_llama)
    shard = TorchShard.from_source(src, LayerRange(start=0, end=4), embed=True, head=True, dtype=F64)
    ids = torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(4))

    def chain(rid, seq, a, b, reuse=None):
        return Forward(request_id=rid, seq=seq, first=0, parents=list(range(-1, b - a - 1)),
                       positions=list(range(a, b)), commit=True, reuse=reuse)

    warm = StageCore(shard, index=1, capacity=32, wire_dtype=F64)
    warm.handle(chain("t1", 0, 0, 8), {"tokens": ids[:8]})
    warm.handle(Release(request_id="t1", seq=1, retain=6), {})
    assert "t1" in warm.retained
    assert not warm.requests
    out, tensors = warm.handle(chain("t2", 0, 6, 12, reuse="t1"), {"tokens": ids[6:12]})
    assert not isinstance(out, StageError)
    cold = StageCore(shard, index=1, capacity=32, wire_dtype=F64)
    ref = cold.handle(chain("c", 0, 0, 12), {"tokens": ids[:12]})[1]
    assert torch.allclose(tensors["features"], ref["features"][6:], atol=1e-12)
    assert warm.counters["reused"] == 1
    assert not warm.retained
    # reusing what is not retained, or more than it committed, fails only that request
    assert isinstance(warm.handle(chain("t3", 0, 6, 8, reuse="t1"), {"tokens": ids[6:8]})[0], StageError)
    warm.handle(Release(request_id="t2", seq=1, retain=12), {})
    assert isinstance(warm.handle(chain("t4", 0, 13, 14, reuse="t2"), {"tokens": ids[:1]})[0], StageError)
    assert isinstance(warm.handle(chain("t5", 0, 3, 5), {"tokens": ids[:2]})[0], StageError)  # no reuse named
    warm.handle(Release(request_id="t2", seq=0), {})  # the leader drops a retained entry
    assert not warm.retained
