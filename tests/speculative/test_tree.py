import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flowspec_p2p.speculative.tree import DraftTree, segment_bounds, split_lengths


@st.composite
def trees(draw, max_nodes: int = 40, vocab: int = 12):
    """Random parents-first trees with distinct sibling tokens and non-increasing path scores."""
    n = draw(st.integers(1, max_nodes))
    tokens, parents, scores = [draw(st.integers(0, vocab - 1))], [-1], [0.0]
    used: dict[int, set[int]] = {0: set()}
    for i in range(1, n):
        p = draw(st.integers(0, i - 1))
        free = [t for t in range(vocab) if t not in used[p]]
        if not free:
            break
        t = draw(st.sampled_from(free))
        used[p].add(t)
        used[i] = set()
        tokens.append(t)
        parents.append(p)
        scores.append(scores[p] - draw(st.sampled_from([0.0, 0.25, 0.5, 1.0, 2.0])))  # ties included
    return DraftTree.from_lists(tokens, parents, scores)


def token_paths(tree: DraftTree) -> set[tuple[int, ...]]:
    return {tuple(tree.token_list[j] for j in tree.path_to(i)) for i in range(len(tree))}


def naive_ancestors(tree: DraftTree, i: int) -> set[int]:
    out, p = {i}, tree.parent_list[i]
    while p >= 0:
        out.add(p)
        p = tree.parent_list[p]
    return out


@settings(max_examples=60, deadline=None)
@given(trees(), st.integers(0, 50))
def test_masks_and_positions_follow_the_parents(tree, committed):
    tree.check()
    anc = tree.ancestor_mask()
    for i in range(len(tree)):
        assert set(anc[i].nonzero().flatten().tolist()) == naive_ancestors(tree, i)
    assert torch.equal(tree.positions(committed), committed + tree.depth)
    full = tree.attention_mask(committed)
    assert full.shape == (len(tree), committed + len(tree))
    assert bool(full[:, :committed].all())
    assert torch.equal(full[:, committed:], anc)
    # a segment's mask is the matching block of the full mask: rows [a, b), columns up to b
    a, b = len(tree) // 3, (2 * len(tree)) // 3 + 1
    assert torch.equal(tree.attention_mask(committed, a, b), full[a:b, : committed + b])


@settings(max_examples=60, deadline=None)
@given(trees())
def test_orderings_keep_parents_first_and_the_same_paths(tree):
    for order in ("eagle", "score"):
        t = tree.reordered(order)
        t.check()
        assert token_paths(t) == token_paths(tree)
    by_score = tree.reordered("score").scores[1:]
    assert bool((by_score[1:] <= by_score[:-1]).all())
    assert bool((tree.reordered("eagle").depth.diff() >= 0).all())


@settings(max_examples=60, deadline=None)
@given(trees(), st.data())
def test_prune_keeps_the_accepted_path_and_the_new_roots_subtree(tree, data):
    node = data.draw(st.integers(0, len(tree) - 1))
    accepted = tree.path_to(node)
    kids = tree.children[node]
    new_root = data.draw(st.sampled_from([None, *kids]))
    sub, keep = tree.prune(accepted, new_root)
    assert keep == sorted(keep)
    assert len(set(keep)) == len(keep)
    assert keep[: len(accepted)] == accepted
    if new_root is None:
        assert sub is None
        assert keep == accepted
        return
    sub.check()
    assert len(sub) == len(keep) - len(accepted)
    assert sub.token_list[0] == tree.token_list[new_root]
    prefix = tuple(tree.token_list[i] for i in accepted)
    assert {prefix + p for p in token_paths(sub)} == {
        p for p in token_paths(tree) if p[: len(prefix) + 1] == (*prefix, tree.token_list[new_root])
    }
    # positions stay absolute: committed grows by len(accepted) while depths shrink by the same amount
    c = 7
    assert torch.equal(sub.positions(c + len(accepted)), tree.positions(c)[keep[len(accepted) :]])


@settings(max_examples=60, deadline=None)
@given(trees(), trees())
def test_merge_appends_new_paths_and_never_moves_existing_nodes(old, new):
    new = DraftTree(torch.cat([old.tokens[:1], new.tokens[1:]]), new.parents, new.depth, new.scores)  # same root
    merged, where = old.merge(new)
    merged.check()
    n = len(old)
    assert torch.equal(merged.tokens[:n], old.tokens)
    assert torch.equal(merged.parents[:n], old.parents)
    assert token_paths(merged) == token_paths(old) | token_paths(new)
    assert len(merged) == len(token_paths(merged))  # de-duplicated: one node per path
    for j in range(len(new)):  # each new node maps to the merged node with the same token path
        assert [merged.token_list[i] for i in merged.path_to(where[j])] == [new.token_list[i] for i in new.path_to(j)]
    appended = [w for w in where if w >= n]
    assert appended == sorted(appended)  # in the new tree's order
    again, _ = merged.merge(new)
    assert len(again) == len(merged)


def test_merge_example_from_the_flowspec_figure():
    # 0 -> {1, 3}, 1 -> {2, 4}: merging 0 -> 1 -> 5 and 0 -> 9 appends two nodes after the old ones
    old = DraftTree.from_lists([10, 11, 12, 13, 14], [-1, 0, 1, 0, 1])
    new = DraftTree.from_lists([10, 11, 19, 15], [-1, 0, 0, 1])
    merged, where = old.merge(new)
    assert merged.token_list == [10, 11, 12, 13, 14, 19, 15]
    assert merged.parent_list == [-1, 0, 1, 0, 1, 0, 1]
    assert where == [0, 1, 5, 6]


def test_select_rejects_a_set_that_is_not_parent_closed():
    tree = DraftTree.from_lists([1, 2, 3], [-1, 0, 1])
    with pytest.raises(KeyError):
        tree.select([0, 2])


def test_limit_depth_drops_deeper_nodes_only():
    tree = DraftTree.from_lists([1, 2, 3, 4, 5], [-1, 0, 1, 0, 2])
    cut = tree.limit_depth(1)
    assert cut.token_list == [1, 2, 4]
    assert cut.parent_list == [-1, 0, 0]
    assert tree.paths() == [[0, 3], [0, 1, 2, 4]]


@given(st.integers(0, 200), st.integers(1, 8), st.one_of(st.none(), st.integers(1, 40)))
def test_segments_are_contiguous_and_cover_the_tree(n, parts, cap):
    sizes = split_lengths(n, parts, cap)
    assert sum(sizes) == n
    assert sizes == sorted(sizes)
    if cap is not None:
        assert max(sizes, default=0) <= cap
    elif n:
        assert len(sizes) <= parts
    bounds = segment_bounds(sizes)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    assert (bounds[0][0] if bounds else 0) == 0
    assert (bounds[-1][1] if bounds else 0) == n
