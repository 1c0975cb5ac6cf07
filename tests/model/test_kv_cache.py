"""KV cache: unit tests of keep / commit / truncate / overflow, and the property test of causal-consistent pruning.

Property: after any sequence of draft-tree appends, keeps (prunes closed under ancestors) and
commits, the cache holds exactly what a fresh prefill of the committed sequence would hold, and the next
forward gives the logits of a from-scratch run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flowspec_p2p.errors import ContextOverflow
from flowspec_p2p.model.kv_cache import KVCache
from flowspec_p2p.model.torch_shard import TorchShard
from flowspec_p2p.model.weights import open_source
from flowspec_p2p.types import LayerRange

VOCAB = 96
CAPACITY = 96


def _filled(cache: KVCache, n: int) -> torch.Tensor:
    """Append n entries whose K/V (every layer, head and dim) hold the slot's value 1..n. -> values [n]"""
    start = cache.reserve(n)
    vals = torch.arange(start + 1, start + n + 1, dtype=cache.k.dtype)  # [n]
    kv = vals[None, None, :, None].expand(cache.batch, cache.k.shape[2], n, cache.k.shape[4])
    for layer in range(cache.k.shape[0]):
        cache.write(layer, start, kv, -kv)
    cache.advance(n)
    return vals


def _slot_values(cache: KVCache) -> list[float]:
    return cache.k[0, 0, 0, : cache.length, 0].tolist()


def test_keep_compacts_survivors_after_the_committed_prefix():
    cache = KVCache(2, 2, 4, 16)
    _filled(cache, 3)
    cache.commit(3)
    _filled(cache, 5)  # pending values 4..8
    cache.keep([1, 2, 4])
    assert (cache.committed, cache.length, cache.pending) == (3, 6, 3)
    assert _slot_values(cache) == [1, 2, 3, 5, 6, 8]
    assert torch.equal(cache.v[1, :, :, :6], -cache.k[1, :, :, :6])  # V moved with K, in every layer


def test_keep_nothing_drops_the_pending_region():
    cache = KVCache(1, 1, 2, 8)
    _filled(cache, 2)
    cache.commit(2)
    _filled(cache, 3)
    cache.keep([])
    assert (cache.committed, cache.length) == (2, 2)


def test_keep_rejects_unordered_or_out_of_range_indices():
    cache = KVCache(1, 1, 2, 8)
    _filled(cache, 4)
    with pytest.raises(AssertionError):
        cache.keep([2, 1])
    with pytest.raises(AssertionError):
        cache.keep([4])


def test_commit_moves_the_boundary_and_refuses_more_than_pending():
    cache = KVCache(1, 1, 2, 8)
    _filled(cache, 4)
    cache.commit(1)
    cache.commit(2)
    assert (cache.committed, cache.pending) == (3, 1)
    with pytest.raises(AssertionError):
        cache.commit(2)


def test_truncate_drops_pending_then_committed_entries():
    cache = KVCache(1, 1, 2, 8)
    _filled(cache, 6)
    cache.commit(4)
    cache.truncate(5)
    assert (cache.committed, cache.length) == (4, 5)
    cache.truncate(2)
    assert (cache.committed, cache.length) == (2, 2)
    _filled(cache, 1)  # appends land right after the truncation point
    assert _slot_values(cache) == [1, 2, 3]


def test_overflow_raises_and_leaves_the_cache_untouched(tiny_shard):
    cache = tiny_shard.new_cache(10)
    tiny_shard(torch.arange(8)[None], cache)
    with pytest.raises(ContextOverflow, match="capacity 10"):
        tiny_shard(torch.arange(3)[None], cache)
    assert cache.length == 8
    with pytest.raises(ContextOverflow):
        KVCache(1, 1, 2, 4).reserve(5)


def test_position_beyond_the_model_limit_raises(tiny_shard):
    cache = tiny_shard.new_cache(4)
    with pytest.raises(ContextOverflow, match="model limit"):
        tiny_shard(torch.tensor([[3]]), cache, positions=torch.tensor([[tiny_shard.max_position]]))
    assert cache.length == 0


# ---------------------------------------------------------------------------------------- property test


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models gain nothing from a second thread, and lose milliseconds per op when the cores are shared."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny_shard(tiny_llama) -> TorchShard:
    src = open_source(tiny_llama)
    whole = LayerRange(start=0, end=src.config.num_layers)
    return TorchShard.from_source(src, whole, embed=True, head=True, dtype=torch.float64).eval()


@dataclass
class TreeState:
    """The model of what the cache should hold: committed tokens, and the pending draft-tree nodes in slot order.
    ``parent[i]`` is an index into ``pending`` or -1 (a child of the last committed token)."""

    committed: list[int]
    tokens: list[int] = field(default_factory=list)
    parent: list[int] = field(default_factory=list)

    def ancestors(self, i: int) -> list[int]:
        """Pending nodes on the path to node i, root first, i included."""
        path = []
        while i != -1:
            path.append(i)
            i = self.parent[i]
        return path[::-1]

    def depth(self, i: int) -> int:
        return len(self.ancestors(i)) - 1


def _append_tree(shard: TorchShard, cache: KVCache, state: TreeState, tokens: list[int], parents: list[int]) -> None:
    """Run new draft nodes (parents index the pending list as extended by these nodes) with their tree mask."""
    c, p0, n = len(state.committed), len(state.tokens), len(tokens)
    state.tokens += tokens
    state.parent += parents
    mask = torch.zeros(1, n, c + p0 + n, dtype=torch.bool)  # [1, n, cache.length + n]
    mask[:, :, :c] = True
    for j in range(n):
        mask[0, j, [c + a for a in state.ancestors(p0 + j)]] = True
    positions = torch.tensor([[c + state.depth(p0 + j) for j in range(n)]])  # [1, n]
    shard(torch.tensor([tokens]), cache, positions=positions, mask=mask)


def _keep(cache: KVCache, state: TreeState, keep: list[int]) -> None:
    """Prune to ``keep`` (sorted, closed under ancestors) in the cache and in the model."""
    cache.keep(keep)
    remap = {old: new for new, old in enumerate(keep)}
    remap[-1] = -1
    state.parent = [remap[state.parent[i]] for i in keep]
    state.tokens = [state.tokens[i] for i in keep]


def _commit(cache: KVCache, state: TreeState, a: int) -> None:
    """Commit the chain of the first ``a`` pending nodes (the caller pruned everything off that chain)."""
    cache.commit(a)
    state.committed += state.tokens[:a]
    state.tokens = state.tokens[a:]
    state.parent = [-1 if p == a - 1 else p - a for p in state.parent[a:]]
    assert all(p >= -1 for p in state.parent)


@st.composite
def _tree(draw, pending: int) -> tuple[list[int], list[int]]:
    """A few new nodes, each the child of an existing pending node, an earlier new node, or the committed end."""
    n = draw(st.integers(1, 6))
    tokens = draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n))
    parents = [draw(st.integers(-1, pending + j - 1)) for j in range(n)]
    return tokens, parents


def _check_against_fresh_run(shard: TorchShard, cache: KVCache, state: TreeState, leaf: int, token: int) -> None:
    c = len(state.committed)
    fresh = shard.new_cache(CAPACITY)
    shard(torch.tensor([state.committed]), fresh)
    # 1. K/V of the committed prefix equal a fresh prefill of the committed sequence
    for ours, ref in ((cache.k, fresh.k), (cache.v, fresh.v)):
        assert (ours[:, :, :, :c] - ref[:, :, :, :c]).abs().max().item() <= 1e-10
    # 2. one more token, the child of ``leaf`` (or of the committed end), sees its ancestors only
    path = [] if leaf == -1 else state.ancestors(leaf)
    mask = torch.zeros(1, 1, cache.length + 1, dtype=torch.bool)  # [1, 1, cache.length + 1]
    mask[0, 0, :c] = True
    mask[0, 0, [c + a for a in path]] = True
    mask[0, 0, -1] = True
    ours = shard.logits(shard(torch.tensor([[token]]), cache, positions=torch.tensor([[c + len(path)]]), mask=mask))
    scratch = state.committed + [state.tokens[a] for a in path] + [token]
    ref = shard.logits(shard(torch.tensor([scratch]), None))[:, -1:]
    assert (ours - ref).abs().max().item() <= 1e-10


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_appends_keeps_and_commits_equal_a_fresh_prefill(tiny_shard, data):
    shard = tiny_shard
    prompt = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8), label="prompt")
    cache = shard.new_cache(CAPACITY)
    with torch.inference_mode():
        shard(torch.tensor([prompt]), cache)
        cache.commit(len(prompt))
        state = TreeState(committed=list(prompt))
        for _ in range(data.draw(st.integers(1, 5), label="rounds")):
            # 1. a draft tree (possibly hanging off the nodes that survived the last round)
            tokens, parents = data.draw(_tree(len(state.tokens)), label="tree")
            _append_tree(shard, cache, state, tokens, parents)
            # 2. optionally a bare prune: any subset closed under ancestors
            if data.draw(st.booleans(), label="prune"):
                chosen = data.draw(st.sets(st.integers(0, len(state.tokens) - 1)), label="survivors")
                _keep(cache, state, sorted({a for i in chosen for a in state.ancestors(i)}))
            # 3. verification: an accepted path from the committed end, plus a surviving subtree below its tip
            roots = [i for i, p in enumerate(state.parent) if p == -1]
            if not roots:
                continue
            path = [data.draw(st.sampled_from(roots), label="root")]
            while (kids := [i for i, p in enumerate(state.parent) if p == path[-1]]) and data.draw(st.booleans()):
                path.append(data.draw(st.sampled_from(kids), label="child"))
            below = [i for i in range(len(state.tokens)) if path[-1] in state.ancestors(i)[:-1]]
            survivors = data.draw(st.sets(st.sampled_from(below)) if below else st.just(set()), label="subtree")
            keep = sorted(set(path) | {a for i in survivors for a in state.ancestors(i)})
            _keep(cache, state, keep)
            _commit(cache, state, len(path))
        leaf = data.draw(st.integers(-1, len(state.tokens) - 1), label="leaf")
        _check_against_fresh_run(shard, cache, state, leaf, data.draw(st.integers(0, VOCAB - 1), label="token"))
