"""EAGLE-2 drafting on tiny float64 targets: tree shape, masks and positions (each node scored as if its path ran
alone), incremental feeding, reduced vocabularies, FlowSpec expansion. Also the draft builders test_spec uses."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from flowspec_p2p.model.generate import ARDecoder, generate_ids, prefill_features
from flowspec_p2p.model.sampling import SamplingParams
from flowspec_p2p.model.torch_shard import TorchShard
from flowspec_p2p.model.weights import open_source
from flowspec_p2p.speculative.drafter import HeadDrafter, OracleDrafter, TreeShape
from flowspec_p2p.speculative.head import DraftHead
from flowspec_p2p.types import LayerRange

SHAPES = [
    TreeShape(total_tokens=1, depth=3, top_k=2),  # root only: plain decoding through the spec loop
    TreeShape(total_tokens=4, depth=3, top_k=1),  # a chain
    TreeShape(total_tokens=8, depth=4, top_k=2),
    TreeShape(total_tokens=16, depth=5, top_k=4, order="score"),
    TreeShape(total_tokens=40, depth=6, top_k=8),
]


@functools.cache
def tiny_target(folder: Path, dtype: torch.dtype = torch.float64) -> TorchShard:
    src = open_source(folder)
    shard = TorchShard.from_source(
        src, LayerRange(start=0, end=src.config.num_layers), embed=True, head=True, dtype=dtype
    )
    return shard.eval().requires_grad_(False)


def random_head(target: TorchShard, seed: int = 0) -> DraftHead:
    torch.manual_seed(seed)
    head = DraftHead(target.cfg).to(torch.float64)
    head.block.reset_parameters(0.05)
    return head.eval().requires_grad_(False)


@functools.cache
def trained_head(folder: Path, steps: int = 200) -> DraftHead:
    """A partially trained head: a few hundred Adam steps of the EAGLE loss (feature regression + cross-entropy
    through the frozen LM head) on the target's own sampled continuations of random prompts."""
    target = tiny_target(folder)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, target.cfg.vocab_size, (16, 6), generator=g)  # [B, 6] random prompts
    with torch.no_grad():
        cache = target.new_cache(40, batch=16)
        x = ids
        for _ in range(34):  # batched sampling at T=0.8: varied, target-like text
            logits = target.logits(target(x, cache)[:, -1])  # [B, V]
            x = torch.multinomial((logits / 0.8).softmax(-1), 1, generator=g)  # [B, 1]
            ids = torch.cat([ids, x], dim=1)
        feats = target(ids, None)  # [B, L, H] features f_t
        next_emb = target.embed(ids[:, 1:])  # [B, L-1, H] embed(x_t+1)
        soft = target.logits(feats[:, 1:]).softmax(-1)  # [B, L-1, V] target distribution after x_t+1
    b, n = next_emb.shape[:2]
    pos = torch.arange(n).expand(b, n)
    head = random_head(target, seed=1).train().requires_grad_(True)
    opt = torch.optim.Adam(head.parameters(), lr=3e-3)
    for _ in range(steps):
        noisy = feats[:, :-1] + 0.01 * torch.randn_like(feats[:, :-1])
        pred = head(noisy, next_emb, pos)  # [B, L-1, H] predicted f_t+1
        logp = torch.log_softmax(target.logits(pred), -1)
        loss = F.smooth_l1_loss(pred, feats[:, 1:]) - 0.1 * (soft * logp).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head.eval().requires_grad_(False)


def start(drafter, target: TorchShard, prompt: list[int]):
    """Prefill the target on ``prompt`` (committed), feed the drafter; return (first token, target cache)."""
    cache = target.new_cache(256)
    drafter.reset(256)
    with torch.inference_mode():
        feats = prefill_features(target, cache, prompt)
        cache.commit(cache.pending)
        first = int(target.logits(feats[-1]).argmax())
        drafter.feed(prompt, feats, first)
    return first, cache


PROMPT = [5, 17, 33, 8, 41, 12, 9]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run ~100x slower on 2 threads when other jobs share the 2 cores (OpenMP oversubscription)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s.total_tokens}-{s.depth}-{s.top_k}-{s.order}")
def test_trees_keep_the_budget_depth_width_and_invariants(tiny_llama, shape):
    target = tiny_target(tiny_llama)
    drafter = HeadDrafter(random_head(target), target)
    root, _ = start(drafter, target, PROMPT)
    tree = drafter.draft(shape)
    tree.check()
    assert tree.token_list[0] == root
    assert len(tree) == shape.total_tokens
    assert int(tree.depth.max()) <= shape.depth
    assert max(len(c) for c in tree.children) <= shape.top_k
    order = tree.order(shape.order)
    assert order == list(range(len(tree)))  # already in the requested order


def test_score_and_eagle_orders_select_the_same_nodes(tiny_llama):
    target = tiny_target(tiny_llama)
    drafter = HeadDrafter(random_head(target), target)
    start(drafter, target, PROMPT)
    a = drafter.draft(TreeShape(total_tokens=20, depth=5, top_k=4, order="eagle"))
    b = drafter.draft(TreeShape(total_tokens=20, depth=5, top_k=4, order="score"))
    assert a.reordered("score").token_list == b.token_list
    assert a.reordered("score").parent_list == b.parent_list


def test_oracle_drafts_the_targets_greedy_continuation(tiny_llama):
    target = tiny_target(tiny_llama)
    ref, _ = generate_ids(ARDecoder(target), PROMPT, SamplingParams(), 6)
    drafter = OracleDrafter(target)
    root, _ = start(drafter, target, PROMPT)
    tree = drafter.draft(TreeShape(total_tokens=30, depth=5, top_k=3))
    node, chain = 0, []
    while tree.children[node]:
        node = tree.children[node][0]  # the top-1 child
        chain.append(tree.token_list[node])
    assert [root, *chain] == ref[: 1 + len(chain)]
    assert len(chain) >= 3


def test_each_node_is_scored_as_if_its_path_ran_alone(tiny_llama):
    """Tree masks and positions in the head's KV: a node's cumulative score equals running the head down its
    path one pair at a time, with nothing else in its cache."""
    target = tiny_target(tiny_llama)
    head = random_head(target, seed=3)
    drafter = HeadDrafter(head, target)
    _root, _ = start(drafter, target, PROMPT)
    tree = drafter.draft(TreeShape(total_tokens=25, depth=4, top_k=4))
    with torch.inference_mode():
        for leaf_path in tree.paths():
            alone = HeadDrafter(head, target)
            start(alone, target, PROMPT)
            f, score = alone.last_feature, 0.0
            for node in leaf_path[1:]:
                tok = tree.token_list[node]
                score += float(torch.log_softmax(alone.lm_head.matmul(f), -1)[tok])
                assert abs(score - float(tree.scores[node])) < 1e-9
                pos = torch.tensor([[alone.cache.length]])
                f = head(f[None, None], target.embed(torch.tensor([[tok]])), pos, alone.cache)[0, 0]


def test_feeding_in_pieces_equals_feeding_at_once(tiny_llama):
    """FlowSpec feeds committed tokens as segments are verified: the drafter's context must not depend on it."""
    target = tiny_target(tiny_llama)
    head = random_head(target)
    once = HeadDrafter(head, target)
    root, _ = start(once, target, PROMPT)
    pieces = HeadDrafter(head, target)
    pieces.reset(64)
    with torch.inference_mode():
        feats = prefill_features(target, target.new_cache(64), PROMPT)
        pieces.feed(PROMPT[:3], feats[:3], PROMPT[3])
        pieces.draft(TreeShape(total_tokens=10, depth=3, top_k=3))  # a draft in between leaves no trace
        pieces.feed(PROMPT[3:], feats[3:], root)
    shape = TreeShape(total_tokens=12, depth=4, top_k=3)
    a, b = once.draft(shape), pieces.draft(shape)
    assert a.token_list == b.token_list
    assert torch.allclose(a.scores, b.scores, atol=1e-10)


def test_a_reduced_draft_vocabulary_drafts_only_its_tokens(tiny_llama):
    target = tiny_target(tiny_llama)
    vocab = torch.arange(0, target.cfg.vocab_size, 2)  # the even token ids
    drafter = HeadDrafter(random_head(target), target, draft_vocab=vocab)
    start(drafter, target, PROMPT)
    tree = drafter.draft(TreeShape(total_tokens=20, depth=4, top_k=4))
    assert all(t % 2 == 0 for t in tree.token_list[1:])
    tree.check()
    # the planner counts the head's network and the reduced LM-head copy [hidden, V/2]; the full vocabulary
    # reuses the target's LM head, so only the network is extra
    copy = target.cfg.hidden_size * len(vocab) * 8  # float64
    net = sum(p.numel() for p in drafter.head.parameters()) * 8
    assert drafter.nbytes == net + copy
    full = HeadDrafter(random_head(target), target)
    assert full.nbytes == net



def test_expansion_from_a_new_root_appends_to_the_pruned_tree(tiny_llama):
    """FlowSpec §6.1: accept a path, continue from a drafted child (x_new), feed the committed tokens, draft
    from the new root one level at a time and merge each level: old indices stay, new nodes follow, invariants
    hold."""
    target = tiny_target(tiny_llama)
    drafter = HeadDrafter(trained_head(tiny_llama), target)
    _root, cache = start(drafter, target, PROMPT)
    shape = TreeShape(total_tokens=16, depth=4, top_k=3, order="score")
    tree = drafter.draft(shape)
    accepted = [0, tree.children[0][0]]
    new_root = tree.children[accepted[-1]][0]
    pruned, _keep = tree.prune(accepted, new_root)
    with torch.inference_mode():
        c = cache.committed
        f = target(tree.tokens[None], cache, positions=tree.positions(c)[None], mask=tree.attention_mask(c)[None])
        drafter.feed(tree.tokens[accepted].tolist(), f[0, accepted], tree.token_list[new_root])
    merged, sizes = pruned, []
    with torch.inference_mode():
        for level in drafter.draft_levels(shape):  # as FlowSpecGrowth._draft: merge every level as it comes
            grown, _ = merged.merge(level)
            grown.check()
            assert torch.equal(grown.tokens[: len(merged)], merged.tokens)  # old indices stay, new nodes follow
            merged = grown
            sizes.append(len(merged))
    assert sizes[-1] > len(pruned)
    assert sizes == sorted(sizes)
    assert merged.token_list[0] == tree.token_list[new_root]


@pytest.mark.parametrize("shape", SHAPES[2:], ids=lambda s: f"{s.total_tokens}-{s.depth}-{s.top_k}-{s.order}")
def test_skipping_hopeless_frontier_nodes_leaves_the_tree_unchanged(tiny_llama, shape, monkeypatch):
    """Frontier nodes whose descendants cannot make the rerank are not run; the EAGLE-2 tree stays the same."""
    import flowspec_p2p.speculative.drafter as drafter_mod

    target = tiny_target(tiny_llama)
    trees = []
    for prune in (True, False):
        if not prune:
            monkeypatch.setattr(drafter_mod, "_worth_expanding", lambda f, s, *_: (f, s))
        for seed in range(3):
            drafter = HeadDrafter(random_head(target, seed), target)
            start(drafter, target, PROMPT)
            trees.append(drafter.draft(shape))
    for a, b in zip(trees[:3], trees[3:], strict=True):
        assert a.token_list == b.token_list
        assert a.parent_list == b.parent_list
