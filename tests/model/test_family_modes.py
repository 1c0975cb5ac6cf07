"""Every decoding mode is lossless on the newer families: on Qwen3, Gemma 3 and Phi-3 (tiny GGUFs written as
llama.cpp writes them, windows and LongRoPE's switch inside the decoded context), the leader's modes over two
native stages (ar, chunk, pipedec, flowspec, auto) and single-device speculation (spec, auto) give exactly the
tokens of autoregressive decoding, with a perfect draft (drafts accepted) and a random head (drafts rejected); and
speculation on the float64 torch reference too."""

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
from flowspec_p2p.model.torch_shard import TorchShard
from flowspec_p2p.model.weights import open_source
from flowspec_p2p.speculative.auto import AutoDecoder
from flowspec_p2p.speculative.decoder import SpecDecoder
from flowspec_p2p.speculative.drafter import HeadDrafter, OracleDrafter, TreeShape
from flowspec_p2p.speculative.head import DraftHead
from flowspec_p2p.types import LayerRange

from ..conftest import build_tiny_checkpoint
from ..fake_ring import sync_pipeline
from .family_gguf import write_family_gguf

pytestmark = pytest.mark.skipif(not native_shard.available(), reason="the native engine can't be built here")

GREEDY = SamplingParams()
PROMPTS = [[5, 17, 33, 8, 61, 9, 12, 40, 3, 77, 21], [1, 50, 51, 52, 9]]
TOKENS = 32  # past Gemma's window (8) and Phi-3's (12) and, from the first prompt, Phi-3's original context (40)
SHAPE = TreeShape(total_tokens=8, depth=4, top_k=3)


@pytest.fixture(scope="module", params=["qwen3", "gemma3", "phi3"])
def family(request, tmp_path_factory):
    """(source, whole native shard, leader head, two stages, AR reference {prompt: tokens})"""
    import gguf

    root = tmp_path_factory.mktemp(request.param)
    build_tiny_checkpoint(root / "hf", request.param, seed=21, num_hidden_layers=2, initializer_range=0.3,
                          **({"layer_types": ["sliding_attention", "full_attention"]}
                             if request.param == "gemma3" else {}))
    q8 = {f"blk.{i}.{m}.weight": gguf.GGMLQuantizationType.Q8_0 for i in range(2)
          for m in ("attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
    src = open_source(write_family_gguf(root / "m.gguf", root / "hf", qtypes=q8))
    whole = NativeShard.from_source(src, LayerRange(start=0, end=2), embed=True, head=True)
    head = NativeShard.from_source(src, LayerRange(start=0, end=0), embed=True, head=True)
    stages = [NativeShard.from_source(src, LayerRange(start=0, end=1), embed=True, head=False),
              NativeShard.from_source(src, LayerRange(start=1, end=2), embed=False, head=True, lm_head=False)]
    reference = {tuple(p): generate_ids(ARDecoder(whole), p, GREEDY, TOKENS)[0] for p in PROMPTS}
    assert len({tuple(r) for r in reference.values()}) == len(PROMPTS)
    return src, whole, head, stages, reference


def _random_head(target) -> DraftHead:
    torch.manual_seed(0)
    head = DraftHead(target.cfg).to(target.dtype)
    head.block.reset_parameters(0.05)
    return head.eval().requires_grad_(False)


def _drafter(draft: str, whole, head):
    return OracleDrafter(whole) if draft == "perfect" else HeadDrafter(_random_head(head), head)


async def _decode(leader: Leader, stages, mode: str) -> dict:
    pipeline, cores = sync_pipeline(stages, leader, torch.float32)
    out = {}
    async with asyncio.TaskGroup() as tg:
        demux = tg.create_task(leader.run())
        await leader.set_pipeline(pipeline)
        for p in PROMPTS:
            got = []
            async for chunk in leader.generate(p, params=GREEDY, max_tokens=TOKENS, stop_ids=frozenset(), mode=mode,
                                               stats=Ledger(mode)):
                got += chunk
            out[tuple(p)] = got
        demux.cancel()
    assert all(c.counters["errors"] == 0 for c in cores)
    return out


@pytest.mark.parametrize("draft", ["perfect", "random"])
async def test_every_leader_mode_equals_autoregressive_decoding(family, draft):
    _, whole, head, stages, reference = family
    leader = Leader(head, None, drafter=_drafter(draft, whole, head), modes=builtin_modes(),
                    settings=LeaderSettings(max_context=200, prefill_chunk=4))
    try:
        for mode in ("ar", "chunk", "pipedec", "flowspec", "auto"):
            assert await _decode(leader, stages, mode) == reference, mode
    finally:
        leader.close()


@pytest.mark.parametrize("draft", ["perfect", "random"])
def test_single_device_spec_and_auto_equal_autoregressive_decoding(family, draft):
    _, whole, _, _, reference = family
    for decoder in (SpecDecoder(whole, _drafter(draft, whole, whole), SHAPE),
                    AutoDecoder(whole, _drafter(draft, whole, whole), SHAPE)):
        for p in PROMPTS:
            out, stats = generate_ids(decoder, p, GREEDY, TOKENS)
            assert out == reference[tuple(p)], decoder.mode
        if draft == "perfect" and decoder.mode == "spec":
            assert stats.tau > 2.0


def test_speculation_on_the_torch_reference_equals_its_autoregressive_decoding(family):
    src = family[0]
    whole = TorchShard.from_source(src, LayerRange(start=0, end=2), embed=True, head=True, dtype=torch.float64)
    spec = SpecDecoder(whole, _drafter("random", whole, whole), SHAPE)
    for p in PROMPTS:
        assert generate_ids(spec, p, GREEDY, TOKENS)[0] == generate_ids(ARDecoder(whole), p, GREEDY, TOKENS)[0]
