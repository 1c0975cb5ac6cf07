"""fs_layers_forward against a float64 torch reference of the same math (F32 weights: tight; quantized weights
with the activations quantized as the engine does: looser), with the causal default and a tree mask, a cache
prefix, GQA, qwen2 biases, no attention norm, the stop flag; and its batch invariance: a row of a tree forward,
or of a prefill, equals that row computed alone, bit for bit, on every ISA path and thread count."""

from __future__ import annotations

import ctypes

import pytest
import torch

from flowspec_p2p.model import native

from .layer_reference import NAMES, TinyModel, reference_forward, rope_tables

CAPACITY = 40
QUANT_TYPES = {"q": "Q8_0", "k": "Q4_1", "v": "Q5_0", "o": "Q4_0", "gate": "Q5_1", "up": "F16", "down": "Q8_0"}


def _inputs(m: TinyModel, n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, m.hidden, generator=torch.Generator().manual_seed(seed))


def _tree_mask(prefix: int, parents: list[int]) -> torch.Tensor:
    """[n, prefix + n]: every node sees the prefix, itself and its ancestors (parents[i] < i, -1 = a root)."""
    n = len(parents)
    mask = torch.zeros(n, prefix + n, dtype=torch.bool)
    mask[:, :prefix] = True
    for i, p in enumerate(parents):
        mask[i, prefix + i] = True
        if p >= 0:
            mask[i, prefix:] |= mask[p, prefix:]
    return mask


def _run(m, stack, x, pos, start, caches, mask=None, stop=None):
    cos, sin = rope_tables(CAPACITY, m.head_dim)
    y = x.clone()
    done = stack.forward(y, pos, cos, sin, *caches, start=start, mask=mask, stop=stop)
    return y, done


def _close(y, ref, rtol):
    scale = ref.abs().max().item()
    err = (y.double() - ref).abs().max().item()
    assert err <= rtol * scale, f"max error {err:.3g} vs scale {scale:.3g}"


@pytest.mark.parametrize("config", [
    dict(),
    dict(bias=True),
    dict(attn_norm=False),
    dict(q_heads=6, kv_heads=1, head_dim=8),
    dict(q_heads=2, kv_heads=2, head_dim=24, hidden=96),
])
def test_prefill_with_causal_default_matches_float64(isa, config):
    m = TinyModel(**config)
    x, pos = _inputs(m, 9), torch.arange(9)
    y, done = _run(m, m.stack(), x, pos, 0, m.stack().new_cache(CAPACITY))
    assert done == m.n_layers
    _close(y, reference_forward(m, x, pos, torch.ones(9, 9).tril().bool()), 2e-5)


def test_quantized_weights_match_the_reference_with_quantized_activations(isa):
    m = TinyModel(types=QUANT_TYPES, bias=True)
    x, pos = _inputs(m, 7), torch.arange(7)
    y, _ = _run(m, m.stack(), x, pos, 0, m.stack().new_cache(CAPACITY))
    _close(y, reference_forward(m, x, pos, torch.ones(7, 7).tril().bool()), 2e-4)


def test_cache_prefix_then_tree_matches_float64(isa):
    m = TinyModel(types=QUANT_TYPES)
    stack, caches = m.stack(), m.stack().new_cache(CAPACITY)
    prefix, parents = 6, [-1, 0, 0, 1, 1, 2, 5]
    x_all = _inputs(m, prefix + len(parents), seed=1)
    _run(m, stack, x_all[:prefix], torch.arange(prefix), 0, caches)
    depth = [0] * len(parents)
    for i, p in enumerate(parents):
        depth[i] = 0 if p < 0 else depth[p] + 1
    pos = torch.tensor([prefix + d for d in depth])
    mask = _tree_mask(prefix, parents)
    y, _ = _run(m, stack, x_all[prefix:], pos, prefix, caches, mask=mask)
    full_mask = torch.zeros(len(x_all), len(x_all), dtype=torch.bool)
    full_mask[:prefix, :prefix] = torch.ones(prefix, prefix).tril().bool()
    full_mask[prefix:] = mask
    ref = reference_forward(m, x_all, torch.cat([torch.arange(prefix), pos]), full_mask)
    _close(y, ref[prefix:], 2e-4)


@pytest.mark.parametrize("threads", [1, 2])
def test_tree_rows_equal_rows_computed_alone_bitwise(isa, threads):
    native.set_threads(threads)
    m = TinyModel(types=QUANT_TYPES, bias=True)
    stack, caches = m.stack(), m.stack().new_cache(CAPACITY)
    prefix, parents = 5, [-1, 0, 0, 1, 2, 2, 3, 6, -1, 8]
    x_all = _inputs(m, prefix + len(parents), seed=2)
    _run(m, stack, x_all[:prefix], torch.arange(prefix), 0, caches)
    mask = _tree_mask(prefix, parents)
    pos = torch.arange(prefix, prefix + len(parents))
    tree, _ = _run(m, stack, x_all[prefix:], pos, prefix, caches, mask=mask)
    for r in range(len(parents)):  # each node alone, at its own slot, ancestors already in the cache
        alone, _ = _run(m, stack, x_all[prefix + r:prefix + r + 1], pos[r:r + 1], prefix + r, caches,
                        mask=mask[r:r + 1, :prefix + r + 1])
        assert torch.equal(alone[0], tree[r]), r


def test_prefill_equals_token_by_token_decoding_bitwise(isa):
    m = TinyModel(types=QUANT_TYPES)
    stack = m.stack()
    x = _inputs(m, 12, seed=3)
    whole, _ = _run(m, stack, x, torch.arange(12), 0, stack.new_cache(CAPACITY))
    caches = stack.new_cache(CAPACITY)
    for r in range(12):
        one, _ = _run(m, stack, x[r:r + 1], torch.tensor([r]), r, caches)
        assert torch.equal(one[0], whole[r]), r


def test_every_isa_path_gives_the_same_bits(lib):
    m = TinyModel(types=QUANT_TYPES, bias=True)
    x = _inputs(m, 6, seed=4)
    results = {}
    for name in native.available_isas():
        native.set_isa(name)
        results[name], _ = _run(m, m.stack(), x, torch.arange(6), 0, m.stack().new_cache(CAPACITY))
    native.set_isa(None)
    first = next(iter(results.values()))
    assert all(torch.equal(first, y) for y in results.values()), list(results)


@pytest.mark.parametrize("heads", [(4, 2, 32, None), (6, 2, 64, None), (2, 1, 128, None), (4, 4, 24, None),
                                   (6, 1, 16, None), (2, 1, 256, None), (4, 2, 32, 20), (2, 1, 256, 9)])
def test_every_isa_path_gives_the_same_bits_over_a_long_prefix_and_a_tree(lib, heads):
    """...with and without a sliding window (which counts each row's visible keys, holes skipped)."""
    q_heads, kv_heads, head_dim, window = heads
    m = TinyModel(types=QUANT_TYPES, head_dim=head_dim, q_heads=q_heads, kv_heads=kv_heads, hidden=96, n_layers=1,
                  window=window)
    prefix, parents = 37, [-1, 0, 1, 1, 0, 4, -1, 6, 7, 7, 9, 10, 11, 12, 13, 14, 15, 0]
    x_all = _inputs(m, prefix + len(parents), seed=5)
    mask = _tree_mask(prefix, parents)
    mask[3, 5:20] = False  # holes in the prefix too
    results = {}
    for name in native.available_isas():
        native.set_isa(name)
        stack, caches = m.stack(), m.stack().new_cache(64)
        cos, sin = rope_tables(64, m.head_dim)
        stack.forward(x_all[:prefix].clone(), torch.arange(prefix), cos, sin, *caches, start=0)
        y = x_all[prefix:].clone()
        stack.forward(y, torch.arange(prefix, prefix + len(parents)), cos, sin, *caches, start=prefix, mask=mask)
        results[name] = y
    native.set_isa(None)
    first = next(iter(results.values()))
    assert all(torch.equal(first, y) for y in results.values()), list(results)


def test_stop_flag_ends_the_forward_before_the_next_layer(lib):
    m = TinyModel(n_layers=3)
    stack = m.stack()
    x = _inputs(m, 3)
    y, done = _run(m, stack, x, torch.arange(3), 0, stack.new_cache(CAPACITY), stop=ctypes.c_int(1))
    assert done == 0
    assert torch.equal(y, x)
    _, done = _run(m, stack, x, torch.arange(3), 0, stack.new_cache(CAPACITY), stop=ctypes.c_int(0))
    assert done == 3


def test_bad_arguments_are_rejected_before_the_c_call(lib):
    m = TinyModel()
    stack = m.stack()
    cos, sin = rope_tables(CAPACITY, m.head_dim)
    k, v = stack.new_cache(CAPACITY)
    x = _inputs(m, 3)
    with pytest.raises(ValueError, match="exceeds the cache capacity"):
        stack.forward(x, torch.arange(3), cos, sin, k, v, start=CAPACITY - 2)
    with pytest.raises(ValueError, match="positions must lie"):
        stack.forward(x, torch.tensor([0, 1, CAPACITY]), cos, sin, k, v, start=0)  # past the rope tables
    with pytest.raises(ValueError, match="mask: expected"):
        stack.forward(x, torch.arange(3), cos, sin, k, v, start=0, mask=torch.ones(3, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="x: expected"):
        stack.forward(x.double(), torch.arange(3), cos, sin, k, v, start=0)
    with pytest.raises(ValueError, match="bad config"):
        type(stack)([], hidden=64, q_heads=3, kv_heads=2, head_dim=16, intermediate=96, eps=1e-5)
    assert set(NAMES) == {"q", "k", "v", "o", "gate", "up", "down"}
