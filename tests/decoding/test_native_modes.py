"""Every decoding mode on the native engine equals autoregressive decoding on it, token for token: a tiny random
Q4_1 GGUF cut into two native stages and a native leader head, with a perfect draft (the target itself) and a weak
one (a random EAGLE head); and single-device speculative decoding. The engine scores a draft-tree node exactly as
decoding it alone (its results do not depend on the rows beside it or the cache slots its ancestors sit in), so
equality is bitwise, not within a tolerance."""

from __future__ import annotations

import asyncio

import pytest
import torch

from flowspec_p2p.decoding.leader import Leader
from flowspec_p2p.decoding.registry import builtin_modes
from flowspec_p2p.decoding.settings import LeaderSettings
from flowspec_p2p.ledger import Ledger
from flowspec_p2p.model import native_shard
from flowspec_p2p.model.generate import ARDecoder, generate_ids
from flowspec_p2p.model.native_shard import NativeShard
from flowspec_p2p.model.sampling import SamplingParams
from flowspec_p2p.model.weights import open_source
from flowspec_p2p.speculative.decoder import SpecDecoder
from flowspec_p2p.speculative.drafter import HeadDrafter, OracleDrafter, TreeShape
from flowspec_p2p.speculative.head import DraftHead
from flowspec_p2p.speculative.ngram import LookupDrafter
from flowspec_p2p.types import LayerRange

from ..fake_ring import sync_pipeline
from ..gguf_fixtures import write_random_gguf

pytestmark = pytest.mark.skipif(not native_shard.available(), reason="the native engine can't be built here")

GREEDY = SamplingParams()
PROMPTS = [[5, 17, 33, 8, 61, 9, 12, 40, 3, 77, 21], [1, 50, 51, 52, 9], [1, 88, 4, 4, 4, 4, 30, 31, 90]]
TOKENS = 24


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    src = open_source(write_random_gguf(tmp_path_factory.mktemp("gguf") / "q4_1.gguf", "Q4_1", seed=7, scale=0.2))
    whole = NativeShard.from_source(src, LayerRange(start=0, end=2), embed=True, head=True)
    head = NativeShard.from_source(src, LayerRange(start=0, end=0), embed=True, head=True)
    stages = [NativeShard.from_source(src, LayerRange(start=0, end=1), embed=True, head=False),
              NativeShard.from_source(src, LayerRange(start=1, end=2), embed=False, head=True, lm_head=False)]
    reference = {tuple(p): generate_ids(ARDecoder(whole), p, GREEDY, TOKENS)[0] for p in PROMPTS}
    return whole, head, stages, reference


def _random_head(target: NativeShard) -> DraftHead:
    torch.manual_seed(0)
    head = DraftHead(target.cfg).to(torch.float32)
    head.block.reset_parameters(0.05)
    return head.eval().requires_grad_(False)


async def _decode(leader: Leader, stages, mode: str) -> tuple[dict, int]:
    """-> ({prompt: tokens}, target verifications (steps) over all prompts)"""
    pipeline, cores = sync_pipeline(stages, leader, torch.float32)
    out, steps = {}, 0
    async with asyncio.TaskGroup() as tg:
        demux = tg.create_task(leader.run())
        await leader.set_pipeline(pipeline)
        for p in PROMPTS:
            got, stats = [], Ledger(mode)
            async for chunk in leader.generate(p, params=GREEDY, max_tokens=TOKENS, stop_ids=frozenset(), mode=mode,
                                               stats=stats):
                got += chunk
            out[tuple(p)] = got
            steps += stats.steps
        demux.cancel()
    assert all(c.counters["errors"] == 0 for c in cores)
    return out, steps


def _drafter(draft: str, whole: NativeShard, head: NativeShard):
    """perfect: the target itself; random: a random EAGLE head; lookup: prompt lookup alone (no head)."""
    if draft == "perfect":
        return OracleDrafter(whole)
    if draft == "random":
        return HeadDrafter(_random_head(head), head)
    return LookupDrafter(None)


@pytest.mark.parametrize("draft", ["perfect", "random", "lookup"])
@pytest.mark.parametrize("mode", ["ar", "chunk", "pipedec", "flowspec"])
async def test_every_mode_on_the_native_engine_equals_autoregressive_decoding(model, mode, draft):
    whole, head, stages, reference = model
    drafter = _drafter(draft, whole, head)
    leader = Leader(head, None, drafter=drafter, modes=builtin_modes(),
                    settings=LeaderSettings(max_context=200, prefill_chunk=4))
    out, steps = await _decode(leader, stages, mode)
    assert out == reference
    if draft == "perfect" and mode == "chunk":  # drafts accepted: fewer verifications than tokens
        assert steps < len(PROMPTS) * TOKENS * 0.6
    leader.close()


@pytest.mark.parametrize("draft", ["perfect", "random", "lookup"])
def test_single_device_speculation_on_the_native_engine_equals_autoregressive_decoding(model, draft):
    whole, _, _, reference = model
    drafter = _drafter(draft, whole, whole)
    spec = SpecDecoder(whole, drafter, TreeShape(total_tokens=8, depth=4, top_k=3))
    for p in PROMPTS:
        out, stats = generate_ids(spec, p, GREEDY, TOKENS)
        assert out == reference[tuple(p)]
        if draft == "perfect":
            assert stats.tau > 2.0  # the tree holds the target's choices: several tokens per forward
