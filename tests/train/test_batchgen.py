"""Batched continuous generation equals unbatched greedy decoding, and records aligned features."""

from __future__ import annotations

import pytest
import torch

from flowspec_p2p.model.generate import ARDecoder, generate_ids
from flowspec_p2p.model.sampling import SamplingParams
from flowspec_p2p.model.torch_shard import TorchShard
from flowspec_p2p.model.weights import open_source
from flowspec_p2p.train.batchgen import BatchGenerator, Request, has_loop
from flowspec_p2p.types import LayerRange


@pytest.fixture(scope="module")
def tiny_shard(tiny_llama) -> TorchShard:
    src = open_source(tiny_llama)
    return TorchShard.from_source(src, LayerRange(start=0, end=src.config.num_layers), embed=True, head=True,
                             dtype=torch.float64).eval()


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 20, (n,), generator=g).tolist()
    return [torch.randint(3, 96, (k,), generator=g).tolist() for k in lengths]


@pytest.mark.parametrize(("batch", "capacity"), [(3, None), (4, 40)])
def test_batched_generation_equals_unbatched_greedy(tiny_shard, batch, capacity):
    prompts = _prompts(9)
    stop = frozenset({5})
    gen = BatchGenerator(tiny_shard, batch=batch, max_new_tokens=12, stop_ids=stop, capacity=capacity,
                         max_prompt=20, stop_loops=False)
    got = {f.key: f for f in gen.run(Request(str(i), p) for i, p in enumerate(prompts))}
    assert len(got) == len(prompts)
    ar = ARDecoder(tiny_shard)
    for i, p in enumerate(prompts):
        want, _ = generate_ids(ar, p, SamplingParams(), 12, stop)
        assert got[str(i)].tokens == p + want, i


def test_recorded_features_are_the_targets_features_of_each_fed_token(tiny_shard):
    prompts = _prompts(5, seed=1)
    gen = BatchGenerator(tiny_shard, batch=2, max_new_tokens=7, stop_ids=frozenset(), max_prompt=20)
    for f in gen.run(Request(str(i), p) for i, p in enumerate(prompts)):
        assert f.features.shape == (len(f.tokens) - 1, tiny_shard.cfg.hidden_size)
        full = tiny_shard(torch.tensor([f.tokens[:-1]]), None)[0]  # [len - 1, hidden]
        torch.testing.assert_close(f.features.to(torch.float64), full, atol=2e-3, rtol=2e-3)
        # feature t predicts token t+1 (greedy answer tokens are the argmax of the previous feature)
        pred = tiny_shard.logits(full[f.prompt_len - 1 :]).argmax(-1).tolist()
        assert pred == f.tokens[f.prompt_len :]


def test_sampled_rows_are_reproducible_by_seed(tiny_shard):
    prompts = _prompts(4, seed=2)
    gen = BatchGenerator(tiny_shard, batch=3, max_new_tokens=8, stop_ids=frozenset(), max_prompt=20)
    reqs = [Request(str(i), p, temperature=1.0, seed=i) for i, p in enumerate(prompts)]
    a = {f.key: f.tokens for f in gen.run(reqs)}
    b = {f.key: f.tokens for f in BatchGenerator(tiny_shard, batch=1, max_new_tokens=8, stop_ids=frozenset(),
                                                 max_prompt=20).run(reqs)}
    assert a == b


def test_loop_detection():
    assert has_loop([1, 2, 3] * 30)
    assert not has_loop(list(range(90)))
