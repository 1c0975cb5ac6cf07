"""Prompt-lookup candidates: the index finds what a brute-force search finds, the chain lands in the tree, and
speculative decoding (single device and FlowSpec) stays equal to autoregressive decoding with it."""

import asyncio
import random

import pytest
import torch

from flowspec_p2p.decoding.flowspec import FlowSpecConfig, make_flowspec
from flowspec_p2p.decoding.leader import Leader
from flowspec_p2p.decoding.settings import LeaderSettings
from flowspec_p2p.ledger import Ledger
from flowspec_p2p.model.generate import ARDecoder, generate_ids
from flowspec_p2p.model.sampling import SamplingParams
from flowspec_p2p.speculative.decoder import SpecDecoder
from flowspec_p2p.speculative.drafter import HeadDrafter, TreeShape
from flowspec_p2p.speculative.ngram import LookupConfig, LookupDrafter, PromptLookup

from ..fake_ring import sync_pipeline
from ..ring_fixtures import F64, tiny_parts
from .test_drafter import random_head, tiny_target

REPETITIVE = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 9, 10, 5, 6]


def brute_force(ctx, root, cfg: LookupConfig, length):
    seq = [*ctx, root]
    for n in range(min(cfg.max_ngram, len(seq)), cfg.min_ngram - 1, -1):
        suffix = seq[-n:]
        for start in range(len(seq) - n - 1, -1, -1):  # latest earlier occurrence
            if seq[start : start + n] == suffix:
                return seq[start + n : start + n + length]
    return []


def test_the_index_proposes_what_a_brute_force_search_finds():
    rng = random.Random(0)
    for cfg in (LookupConfig(), LookupConfig(max_ngram=2, min_ngram=2, length=3)):
        for _ in range(200):
            ctx = [rng.randrange(5) for _ in range(rng.randrange(0, 30))]
            root = rng.randrange(5)
            lookup = PromptLookup(cfg)
            cut = rng.randrange(0, len(ctx) + 1)  # tokens arrive in two feeds
            lookup.extend(ctx[:cut])
            lookup.extend(ctx[cut:])
            assert lookup.propose(root, cfg.length) == brute_force(ctx, root, cfg, cfg.length), (ctx, root)


def fed_on_repetitive(tiny_llama) -> LookupDrafter:
    """A lookup drafter over a random head, fed REPETITIVE (its last token the root)."""
    target = tiny_target(tiny_llama)
    drafter = LookupDrafter(HeadDrafter(random_head(target), target))
    drafter.reset(64)
    with torch.inference_mode():
        feats = target(torch.tensor([REPETITIVE[:-1]]), None)[0]
        drafter.feed(REPETITIVE[:-1], feats, REPETITIVE[-1])
    return drafter


def test_the_chain_is_merged_below_the_root(tiny_llama):
    drafter = fed_on_repetitive(tiny_llama)
    tree = drafter.draft(TreeShape(total_tokens=4, depth=4, top_k=2))
    tree.check()
    node = 0
    for tok in (7, 9, 10, 5):  # the latest earlier "5 6" (positions 8-9) was followed by "7 9 10 5"
        node = tree.child_with_token(node, tok)
        assert node is not None, tree.token_list


@pytest.mark.parametrize(("context", "chained"), [(REPETITIVE, True), ([1, 2, 3, 4, 11, 12, 13, 14], False)])
def test_levels_end_with_the_chained_tree_and_yield_no_tree_twice(tiny_llama, context, chained):
    target = tiny_target(tiny_llama)
    shape = TreeShape(total_tokens=6, depth=3, top_k=2)
    base, drafter = HeadDrafter(random_head(target), target), LookupDrafter(HeadDrafter(random_head(target), target))
    with torch.inference_mode():
        feats = target(torch.tensor([context[:-1]]), None)[0]
        for d in (base, drafter):
            d.reset(64)
            d.feed(context[:-1], feats, context[-1])
        base_levels = [t.token_list for t in base.draft_levels(shape)]
        levels = [t.token_list for t in drafter.draft_levels(shape)]
    assert levels[: len(base_levels)] == base_levels  # the base's levels, as they come
    assert len(levels) == len(base_levels) + chained  # then the chained tree, only when the chain adds nodes
    assert levels[-1] != base_levels[-1] if chained else levels[-1] == base_levels[-1]
    with torch.inference_mode():
        drafter.reset(64)
        drafter.feed(context[:-1], feats, context[-1])
        assert drafter.draft(shape).token_list == levels[-1]


def test_the_lookup_chain_goes_as_deep_as_the_shape_says(tiny_llama):
    drafter = fed_on_repetitive(tiny_llama)
    with torch.inference_mode():
        chain = TreeShape(total_tokens=2, depth=1, top_k=1)
        deepest = {lk: int(drafter.draft(chain.model_copy(update={"lookup": lk})).depth.max())
                   for lk in (None, 0, 3, 5)}
    # REPETITIVE ends ... 5, 6: the lookup proposes 7, 9, 10, 5, 6 (the continuation of the latest "5, 6")
    assert deepest == {None: 1, 0: 1, 3: 3, 5: 5}  # None: the tree's depth; the head's node is at depth 1


def test_a_capped_shape_caps_its_lookup_chain():
    shape = TreeShape(total_tokens=2, depth=1, top_k=1, lookup=4)
    assert shape.capped(9) is shape
    assert (shape.capped(2).depth, shape.capped(2).lookup) == (1, 2)
    assert (shape.capped(0).depth, shape.capped(0).lookup_depth) == (0, 0)
    assert TreeShape(total_tokens=6, depth=4, top_k=2).capped(3).lookup_depth == 3


@pytest.mark.parametrize("shape", [TreeShape(total_tokens=6, depth=4, top_k=2), TreeShape(total_tokens=2, depth=1,
                                                                                          top_k=1),
                                   TreeShape(total_tokens=2, depth=1, top_k=1, lookup=6)])
def test_speculation_with_lookup_equals_autoregressive_decoding(tiny_llama, shape):
    target = tiny_target(tiny_llama)
    ref, _ = generate_ids(ARDecoder(target), REPETITIVE, SamplingParams(), 40)
    spec = SpecDecoder(target, LookupDrafter(HeadDrafter(random_head(target), target)), shape)
    out, stats = generate_ids(spec, REPETITIVE, SamplingParams(), 40)
    assert out == ref
    assert stats.steps < 40, "a repetitive reply should let the lookup chain land some tokens"


async def test_flowspec_with_lookup_equals_single_device(tiny_llama):
    parts = tiny_parts(tiny_llama)
    drafter = LookupDrafter(HeadDrafter(random_head(parts.whole), parts.head))
    leader = Leader(parts.head, None, drafter=drafter, modes=[make_flowspec(FlowSpecConfig(segment_cap=3))],
                    settings=LeaderSettings(max_context=200, prefill_chunk=8))
    pipeline, _ = sync_pipeline(parts.stages, leader, F64)
    async with asyncio.TaskGroup() as tg:
        demux = tg.create_task(leader.run())
        await leader.set_pipeline(pipeline)
        out, stats = [], Ledger(mode="?")
        async for chunk in leader.generate(REPETITIVE, params=SamplingParams(), max_tokens=40, stop_ids=frozenset(),
                                           mode="flowspec", stats=stats):
            out += chunk
        demux.cancel()
    assert out == parts.reference(REPETITIVE, 40)
