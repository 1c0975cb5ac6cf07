"""Batched forwards over several requests (Shard.forward_batch): one engine call whose every row equals, bit for
bit, the same request's forward alone -- whatever the other requests are, how long their caches, whether their
rows are a prompt chunk, a decode step or a draft tree under a mask."""

import pytest
import torch

from flowspec_p2p.model import native_shard
from flowspec_p2p.model.engine import BatchRows
from flowspec_p2p.model.load import get_engine
from flowspec_p2p.model.weights import open_source
from flowspec_p2p.types import LayerRange

from ..gguf_fixtures import write_random_gguf

needs_native = pytest.mark.skipif(not native_shard.available(), reason="the native engine is unavailable here")


def _tree_mask(committed: int, parents: list[int]) -> torch.Tensor:
    """[1, m, committed + m]: the committed prefix, each node's ancestors, itself."""
    m = len(parents)
    mask = torch.zeros(1, m, committed + m, dtype=torch.bool)
    mask[0, :, :committed] = True
    for i in range(m):
        j = i
        while j != -1:
            mask[0, i, committed + j] = True
            j = parents[j]
    return mask


def _requests(shard, seed: int):
    """Three requests at different points: a fresh prompt, one decode step after 9 tokens, a 4-node tree after 5."""
    g = torch.Generator().manual_seed(seed)
    vocab = shard.cfg.vocab_size

    def ids(n):
        return torch.randint(0, vocab, (1, n), generator=g)

    out = []
    for context, new, parents in ((0, 6, None), (9, 1, None), (5, 4, [-1, 0, 0, 1])):
        cache = shard.new_cache(32)
        if context:
            shard(ids(context), cache)
            cache.commit(context)
        x = ids(new)
        if parents is None:
            out.append((cache, BatchRows(x, cache)))
        else:
            depth = [0] * len(parents)
            for i, p in enumerate(parents):
                depth[i] = 0 if p < 0 else depth[p] + 1
            out.append((cache, BatchRows(x, cache, torch.tensor([[context + d for d in depth]]),
                                         _tree_mask(context, parents))))
    return out


def _clone(cache):
    c = type(cache).__new__(type(cache))
    c.__dict__.update({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in vars(cache).items()})
    return c


@pytest.mark.parametrize("engine", [pytest.param("native", marks=needs_native), "torch"])
@pytest.mark.parametrize("qtype", ["Q4_K", "Q8_0"])
def test_a_batched_forward_equals_each_request_alone_bit_for_bit(tmp_path, engine, qtype):
    src = open_source(write_random_gguf(tmp_path / "m.gguf", qtype))
    shard = get_engine(engine).load(src, LayerRange(start=0, end=2), embed=True, head=True)
    reqs = _requests(shard, seed=1)
    alone_caches = [_clone(c) for c, _ in reqs]
    with torch.inference_mode():
        alone = [shard(it.x, cache, positions=it.positions, mask=it.mask)
                 for cache, (_, it) in zip(alone_caches, reqs, strict=True)]
        together = shard.forward_batch([it for _, it in reqs])
    for a, b in zip(alone, together, strict=True):
        assert torch.equal(a, b)
    for (cache, _), ref in zip(reqs, alone_caches, strict=True):  # the caches got the same K/V in the same slots
        assert cache.length == ref.length
        assert torch.equal(cache.k[..., : cache.length, :], ref.k[..., : ref.length, :])
        assert torch.equal(cache.v[..., : cache.length, :], ref.v[..., : ref.length, :])


@needs_native
def test_a_middle_stage_batches_hidden_rows_and_checks_its_inputs(tmp_path):
    src = open_source(write_random_gguf(tmp_path / "m.gguf", "Q4_K"))
    shard = get_engine("native").load(src, LayerRange(start=1, end=2), embed=False, head=False)
    g = torch.Generator().manual_seed(2)
    items = [BatchRows(torch.randn(1, n, shard.cfg.hidden_size, generator=g), shard.new_cache(16)) for n in (3, 1)]
    alone = [shard(it.x, shard.new_cache(16)) for it in items]
    together = shard.forward_batch(items)
    assert all(torch.equal(a, b) for a, b in zip(alone, together, strict=True))
    assert all(it.x.abs().sum() > 0 for it in items)  # the inputs were not overwritten in place
    with pytest.raises(Exception, match="position"):
        shard.forward_batch([BatchRows(torch.randn(1, 1, shard.cfg.hidden_size), shard.new_cache(300),
                                       torch.tensor([[shard.max_position]]))])


@pytest.mark.slow
@needs_native
def test_the_default_model_scores_four_requests_decode_steps_as_each_alone(default_model):
    shard, tok = default_model.shard, default_model.tokenizer
    prompts = [tok.chat([{"role": "user", "content": q}]) for q in
               ("Why is the sky blue?", "Name three rivers.", "What is 7 times 8?", "Write a haiku about rain.")]
    caches = []
    with torch.inference_mode():
        for p in prompts:
            cache = shard.new_cache(len(p) + 4)
            shard(torch.tensor([p]), cache)
            cache.commit(len(p))
            caches.append(cache)
        steps = [BatchRows(torch.tensor([[p[-1]]]), c) for p, c in zip(prompts, caches, strict=True)]
        alone = [shard(it.x, _clone(it.cache)) for it in steps]
        together = shard.forward_batch(steps)
    assert all(torch.equal(a, b) for a, b in zip(alone, together, strict=True))
