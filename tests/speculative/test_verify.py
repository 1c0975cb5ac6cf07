"""Verification: greedy walks on crafted logits, and the statistical proof that tree rejection sampling
reproduces the target distribution (speculative-decoding-notes §2.2, §2.4 T3)."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats as sps

from flowspec_p2p.model.sampling import PositionalDraws, SamplingParams, inverse_cdf
from flowspec_p2p.speculative.tree import DraftTree
from flowspec_p2p.speculative.verify import (
    LazyRows,
    likely_next,
    verify_greedy,
    verify_greedy_tokens,
    verify_positional,
    verify_sampling,
    verify_walk,
    walk_rows,
    walk_tokens,
)

from .test_tree import trees

V = 8  # toy vocabulary


def one_hot_logits(argmax: list[int], vocab: int = V) -> torch.Tensor:
    """[n, vocab] logits whose argmax at node i is argmax[i]."""
    x = torch.randn(len(argmax), vocab, generator=torch.Generator().manual_seed(0))
    x[torch.arange(len(argmax)), torch.tensor(argmax)] = 10.0
    return x


# 0(r=5) -> 1(a=3), 2(b=4); 1 -> 3(c=6), 4(d=7); 3 -> 5(e=1)
FIG = DraftTree.from_lists([5, 3, 4, 6, 7, 1], [-1, 0, 0, 1, 1, 3])


def test_greedy_takes_the_longest_matching_path_and_the_bonus():
    v = verify_greedy(FIG, one_hot_logits([3, 6, 0, 1, 0, 2]))
    assert v.accepted == [0, 1, 3, 5]
    assert v.token == 2
    assert v.next_child is None
    assert v.emitted(FIG) == [3, 6, 1, 2]


def test_greedy_rejecting_the_root_children_emits_only_the_bonus():
    v = verify_greedy(FIG, one_hot_logits([0, 0, 0, 0, 0, 0]))
    assert v.accepted == [0]
    assert v.emitted(FIG) == [0]


def test_greedy_on_a_verified_prefix_stops_at_the_first_unverified_child():
    logits = one_hot_logits([3, 7, 0, 6, 0, 2])
    v = verify_greedy(FIG, logits[:3], verified_end=3)  # nodes 3.. not verified yet
    assert v.accepted == [0, 1]
    assert v.token == 7
    assert v.next_child == 4


def test_an_accepted_stop_token_ends_the_walk_without_a_bonus():
    v = verify_greedy(FIG, one_hot_logits([3, 6, 0, 1, 0, 2]), stop_ids=frozenset({6}))
    assert v.accepted == [0, 1, 3]
    assert v.token is None
    assert v.emitted(FIG) == [3, 6]
    probs = np.eye(V)[[3, 6, 0, 1, 0, 2]]  # deterministic target: sampling must walk the same way
    s = verify_sampling(FIG, probs, np.full(len(FIG) + 1, 0.5), stop_ids=frozenset({6}))
    assert s.accepted == [0, 1, 3]
    assert s.token is None


def test_lazy_rows_compute_only_the_visited_nodes():
    logits = one_hot_logits([0, 0, 0, 0, 0, 0])
    seen = []
    rows = LazyRows(len(FIG), lambda i: seen.append(i) or logits[i])
    verify_greedy(FIG, rows)
    assert seen == [0]


def test_walk_rows_batch_the_first_child_chain_then_the_other_children():
    assert likely_next(FIG, 0) == [1, 3, 5, 2]
    assert likely_next(FIG, 1) == [3, 5, 4]
    logits = one_hot_logits([3, 6, 0, 1, 0, 2])
    calls = []
    rows = walk_rows(FIG, len(FIG), lambda idx: calls.append(list(idx)) or logits[idx])
    v = verify_greedy(FIG, rows)
    assert v.accepted == [0, 1, 3, 5]
    assert calls == [[0, 1, 3, 5]]  # the whole accepted path in one LM-head call
    assert rows.computed == [0, 1, 3, 5]
    torch.testing.assert_close(rows[5], logits[5])
    rows[4]  # a miss: 4 and nothing else left to plan
    assert calls[-1] == [4]


def test_walk_rows_stay_inside_the_verified_prefix():
    calls = []
    rows = walk_rows(FIG, 3, lambda idx: calls.append(list(idx)) or torch.zeros(len(idx), V))
    rows[0]
    assert calls == [[0, 1, 2]]  # 3 and 5 are not verified yet


@settings(max_examples=80, deadline=None)
@given(trees(max_nodes=25, vocab=4), st.integers(0, 99), st.integers(1, 6), st.booleans())
def test_batched_rows_give_the_same_verdict_as_the_whole_tensor(tree, seed, batch, greedy):
    logits = torch.randn(len(tree), 4, generator=torch.Generator().manual_seed(seed))
    rows = LazyRows(len(tree), many=lambda idx: logits[idx], plan=lambda i: likely_next(tree, i), batch=batch)
    if greedy:
        assert verify_greedy(tree, rows) == verify_greedy(tree, logits)
    else:
        probs = torch.softmax(logits, -1).double()
        lazy = LazyRows(len(tree), many=lambda idx: probs[idx], plan=lambda i: likely_next(tree, i), batch=batch)
        u = np.random.default_rng(seed).random(len(tree) + 1)
        assert verify_sampling(tree, lazy, u) == verify_sampling(tree, probs, u)


@settings(max_examples=80, deadline=None)
@given(trees(max_nodes=25, vocab=4), st.integers(0, 99), st.booleans())
def test_greedy_from_the_argmax_alone_gives_the_logits_verdict(tree, seed, ties):
    """walk_tokens + verify_greedy_tokens (the LM head's argmax per node, Shard.greedy_tokens) against the
    logits' walk, ties included (integer logits: the lowest index wins on both sides), on prefixes too."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, 2, (len(tree), 4), generator=g).float() if ties else torch.randn(len(tree), 4,
                                                                                               generator=g)
    calls = []
    picks = walk_tokens(tree, len(tree), lambda idx: calls.append(list(idx)) or logits[idx].argmax(-1))
    assert verify_greedy_tokens(tree, picks) == verify_greedy(tree, logits)
    assert all(len(c) <= 4 for c in calls)
    end = 1 + seed % len(tree)
    assert verify_greedy_tokens(tree, logits[:end].argmax(-1), verified_end=end) == verify_greedy(
        tree, logits[:end], verified_end=end)


def test_a_greedy_walk_asks_the_head_for_tokens_unless_the_rows_are_wanted():
    logits = one_hot_logits([3, 6, 0, 1, 0, 2])
    asked = []
    head = {"logits": lambda idx: asked.append("logits") or logits[idx],
            "tokens": lambda idx: asked.append("tokens") or logits[idx].argmax(-1)}
    greedy, rows = verify_walk(FIG, 6, SamplingParams(), None, **head)
    assert (greedy.accepted, rows, set(asked)) == ([0, 1, 3, 5], None, {"tokens"})
    asked.clear()
    kept, rows = verify_walk(FIG, 6, SamplingParams(), None, **head, keep_rows=True)
    assert (kept, set(asked)) == (greedy, {"logits"})
    assert torch.equal(rows[0], logits[0])
    asked.clear()
    verify_walk(FIG, 3, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0), **head)
    assert set(asked) == {"logits"}


@settings(max_examples=80, deadline=None)
@given(trees(max_nodes=25, vocab=4), st.data())
def test_stepwise_greedy_on_prefixes_equals_verifying_the_whole_tree(tree, data):
    """FlowSpec §4: verify a prefix; if the bonus matches an unverified child, prune to its subtree and verify
    the rest later. The emitted tokens equal one whole-tree verification."""
    logits = torch.randn(len(tree), 4, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 99))))
    whole = verify_greedy(tree, logits).emitted(tree)
    out, t, rows = [], tree, logits
    while True:
        end = data.draw(st.integers(1, len(t)))
        v = verify_greedy(t, rows[:end], verified_end=end)
        out += v.emitted(t)
        if v.next_child is None:
            break
        t, keep = t.prune(v.accepted, v.next_child)
        rows = rows[keep[len(v.accepted) :]]
    assert out == whole


# -- sampling: the emitted tokens follow the target distribution exactly --------------------------------------


def markov_target(seed: int) -> np.ndarray:
    """[V, V] row-stochastic table: p(next | current token). Some zeros, as top-k/top-p truncation leaves."""
    rng = np.random.default_rng(seed)
    m = rng.dirichlet(np.full(V, 0.7), size=V)
    m[rng.random((V, V)) < 0.2] = 0.0
    m[np.arange(V), rng.integers(0, V, V)] += 0.05  # every row keeps some mass
    return m / m.sum(1, keepdims=True)


def draft_tree_for(m: np.ndarray, root: int, widths: list[int], wrong: int) -> DraftTree:
    """A deterministic EAGLE-like tree: at each level, the node's ``widths[d]`` likeliest children under m,
    plus ``wrong`` children the target never or rarely picks; only the likeliest child is expanded further."""
    tokens, parents = [root], [-1]
    frontier = [0]
    for w in widths:
        nxt = []
        for node in frontier:
            order = np.argsort(-m[tokens[node]], kind="stable")
            picks = [*order[:w], *order[::-1][:wrong]]
            seen = set()
            for j, tok in enumerate(picks):
                if int(tok) in seen:
                    continue
                seen.add(int(tok))
                tokens.append(int(tok))
                parents.append(node)
                if j == 0:
                    nxt.append(len(tokens) - 1)
        frontier = nxt
    return DraftTree.from_lists(tokens, parents).reordered("eagle")


def emitted_first3(m, tree, n_draws, seed, verified_end=None):
    """Run verification n_draws times; return [n_draws, 3] first three emitted tokens, filling any token a step
    did not emit by ancestral sampling from m (what the next step would emit: its first token is checked too)."""
    rng = np.random.default_rng(seed)
    probs = m[np.array(tree.token_list)]  # [n, V]: node i's target distribution
    u = rng.random((n_draws, len(tree) + 1))
    u2 = rng.random((n_draws, len(tree) + 1))
    out = np.full((n_draws, 3), -1)
    pruned = {}  # (accepted path, new root) -> (subtree, its rows)
    for d in range(n_draws):
        v = verify_sampling(tree, probs, u[d], verified_end=verified_end)
        toks = v.emitted(tree)
        if v.next_child is not None:  # FlowSpec: the sampled token matched a drafted, unverified child
            key = (*v.accepted, v.next_child)
            if key not in pruned:
                sub, keep = tree.prune(v.accepted, v.next_child)
                pruned[key] = sub, probs[keep[len(v.accepted) :]]
            sub, sub_probs = pruned[key]
            toks += verify_sampling(sub, sub_probs, u2[d]).emitted(sub)
        toks = toks[:3]
        out[d, : len(toks)] = toks
    root = tree.token_list[0]
    for j in range(3):
        prev = np.full(n_draws, root) if j == 0 else out[:, j - 1]
        missing = out[:, j] < 0
        cdf = np.cumsum(m[prev[missing]], axis=1)
        r = rng.random(missing.sum())[:, None]
        out[missing, j] = np.minimum((r * cdf[:, -1:] >= cdf).sum(1), V - 1)
    return out


def chi_square_p(m, root, samples) -> float:
    """Goodness of fit of the [N, 3] samples to the Markov chain's three-token joint; cells with an expected
    count below 5 are pooled."""
    joint = m[root][:, None, None] * m[:, :, None] * m[None, :, :]  # [V, V, V]
    expected = joint.reshape(-1) * samples.shape[0]
    observed = np.bincount(samples @ np.array([V * V, V, 1]), minlength=V**3)
    assert observed[expected == 0].sum() == 0, "emitted a sequence the target gives probability 0"
    small = expected < 5
    e = np.append(expected[~small], expected[small].sum())
    o = np.append(observed[~small], observed[small].sum())
    return float(sps.chisquare(o, e).pvalue)


N_DRAWS = 100_000
P_MIN = 1e-3  # chi-square p-value threshold; seeds are fixed, so the test is deterministic


@pytest.mark.parametrize(
    ("widths", "wrong", "verified_frac"),
    [
        ([3, 2, 1], 1, None),  # several siblings, three levels, whole tree verified
        ([4, 3], 2, None),  # wide: most draws try several siblings before accepting or giving up
        ([3, 2, 2], 1, 0.4),  # a verified prefix only: walks stop at unverified children (FlowSpec)
    ],
)
def test_tree_rejection_sampling_reproduces_the_target_distribution(widths, wrong, verified_frac):
    m = markov_target(seed=len(widths) * 10 + wrong)
    root = 0
    tree = draft_tree_for(m, root, widths, wrong)
    assert len(tree.children[0]) >= 3
    assert int(tree.depth.max()) >= 2
    end = None if verified_frac is None else max(2, int(verified_frac * len(tree)))
    samples = emitted_first3(m, tree, N_DRAWS, seed=1, verified_end=end)
    assert chi_square_p(m, root, samples) > P_MIN
    # the same test detects a 2% distortion of the target at this sample size (it has power)
    biased = 0.98 * m + 0.02 * np.eye(V)[(np.arange(V) + 1) % V]
    assert chi_square_p(biased, root, samples) < P_MIN


def emitted_first3_positional(m, tree, n_draws):
    """As emitted_first3, with verify_positional: draw d uses seed d, one uniform per absolute position (the root at
    position 0); a walk that ends at an unverified child continues on the pruned subtree at its own position."""
    probs = m[np.array(tree.token_list)]
    out = np.full((n_draws, 3), -1)
    pruned = {}
    for d in range(n_draws):
        draws = PositionalDraws(d)
        v = verify_positional(tree, probs, draws, 0, verified_end=max(2, int(0.4 * len(tree))))
        toks = v.emitted(tree)
        if v.next_child is not None:
            key = (*v.accepted, v.next_child)
            if key not in pruned:
                sub, keep = tree.prune(v.accepted, v.next_child)
                pruned[key] = sub, probs[keep[len(v.accepted):]]
            sub, sub_probs = pruned[key]
            toks += verify_positional(sub, sub_probs, draws, len(v.accepted)).emitted(sub)
        while len(toks) < 3:  # what the next walk would emit, from the same (seed, position) draws
            toks.append(inverse_cdf(m[toks[-1] if toks else tree.token_list[0]], draws.uniform(len(toks) + 1)))
        out[d] = toks[:3]
    return out


def test_positional_verification_reproduces_the_target_distribution_and_depends_on_the_seed_only():
    m = markov_target(seed=31)
    tree = draft_tree_for(m, 0, [3, 2, 2], 1)
    samples = emitted_first3_positional(m, tree, 30_000)
    assert chi_square_p(m, 0, samples) > P_MIN
    # the same seed gives the same tokens whatever tree was drafted (here: none but the root)
    bare = DraftTree.from_lists([0], [-1])
    probs = m[np.array(tree.token_list)]
    for seed in range(50):
        v = verify_positional(tree, probs, PositionalDraws(seed), 0)
        first = verify_positional(bare, m[[0]], PositionalDraws(seed), 0).token
        assert v.emitted(tree)[0] == first
