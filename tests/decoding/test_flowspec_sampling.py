"""FlowSpec sampling through a 3-stage ring keeps the target distribution: on a toy vocabulary, the joint law of the
first three reply tokens matches ancestral sampling from the target (chi-square), with one-node segments so that
every sibling group is split across segments and verified step by step."""

import asyncio
import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from flowspec_p2p.decoding.flowspec import FlowSpecConfig, make_flowspec
from flowspec_p2p.decoding.leader import Leader
from flowspec_p2p.decoding.settings import LeaderSettings
from flowspec_p2p.ledger import Ledger
from flowspec_p2p.model.sampling import SamplingParams, target_probs
from flowspec_p2p.model.torch_shard import TorchShard
from flowspec_p2p.model.weights import open_source
from flowspec_p2p.speculative.drafter import HeadDrafter, TreeShape
from flowspec_p2p.speculative.head import DraftHead
from flowspec_p2p.types import LayerRange

from ..conftest import build_tiny_checkpoint
from ..fake_ring import sync_pipeline

F64 = torch.float64
VOCAB = 4
DRAWS = 2500
PROMPT = [1, 3, 0]


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    folder = tmp_path_factory.mktemp("toy")
    build_tiny_checkpoint(folder, "llama", seed=11, vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                          num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, initializer_range=0.6,
                          bos_token_id=None, eos_token_id=None)
    src = open_source(folder)
    cut = lambda a, b, e, h: TorchShard.from_source(src, LayerRange(start=a, end=b), embed=e, head=h, dtype=F64).eval()  # noqa: E731
    return cut(0, 3, True, True), cut(0, 0, True, True), [cut(i, i + 1, i == 0, i == 2) for i in range(3)]


def exact_joint(whole: TorchShard, params: SamplingParams) -> np.ndarray:
    """P(t1, t2, t3 | prompt) by enumeration. -> [VOCAB ** 3]"""
    out = np.zeros(VOCAB**3)
    with torch.inference_mode():
        for i, seq in enumerate(itertools.product(range(VOCAB), repeat=3)):
            ids = torch.tensor([PROMPT + list(seq[:2])])
            probs = target_probs(whole.logits(whole(ids, None)[0]), params)  # [len, vocab]
            n = len(PROMPT)
            out[i] = float(probs[n - 1, seq[0]] * probs[n, seq[1]] * probs[n + 1, seq[2]])
    return out


async def test_flowspec_sampling_matches_the_target_distribution(toy):
    whole, head, stages = toy
    torch.manual_seed(5)
    dh = DraftHead(whole.cfg).to(F64)
    dh.block.reset_parameters(0.5)  # a wrong but deterministic draft: trees of 2-3 siblings per node
    cfg = FlowSpecConfig(init=TreeShape(total_tokens=9, depth=3, top_k=3, order="score"),
                         expand=TreeShape(total_tokens=6, depth=3, top_k=3, order="score"), segment_cap=1)
    leader = Leader(head, None, drafter=HeadDrafter(dh, head), modes=[make_flowspec(cfg)],
                    settings=LeaderSettings(max_context=32, prefill_chunk=8))
    counts = np.zeros(VOCAB**3)
    split_walks = 0
    pipeline, _ = sync_pipeline(stages, leader, F64)
    async with asyncio.TaskGroup() as tg:
        demux = tg.create_task(leader.run())
        await leader.set_pipeline(pipeline)
        for i in range(DRAWS):
            out, stats = [], Ledger(mode="?")
            params = SamplingParams(temperature=1.0, seed=i)  # a fresh, reproducible draw per request
            async for chunk in leader.generate(PROMPT, params=params, max_tokens=3, stop_ids=frozenset(),
                                               mode="flowspec", stats=stats):
                out += chunk
            assert len(out) == 3
            counts[(out[0] * VOCAB + out[1]) * VOCAB + out[2]] += 1
            split_walks += stats.extra["continues"]
        demux.cancel()
    expected = exact_joint(whole, SamplingParams(temperature=1.0)) * DRAWS
    assert split_walks > DRAWS // 4, "the test must exercise walks that continue into unverified segments"
    big = expected >= 5  # pool the rare cells so the chi-square approximation holds
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    _, p = chisquare(obs, exp)
    assert p > 1e-3, f"chi-square p = {p:.2e}: FlowSpec sampling does not follow the target"
    # a sanity check on the test's power: the same counts are far from a different (uniform) law
    uniform = np.append(np.full(big.sum(), DRAWS / VOCAB**3), DRAWS / VOCAB**3 * (~big).sum())
    _, p_wrong = chisquare(obs, uniform)
    assert p_wrong < 1e-6
