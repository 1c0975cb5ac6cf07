"""NativeDraftHead, the EAGLE head on the native engine: it computes what the torch DraftHead computes with the
same (16-bit) weights within the engine's activation rounding, causal and tree-masked, with and without the
qkv bias; a node drafted inside a tree gets bit for bit what drafting its path alone gives; load_drafter puts
the head on the engine exactly when the target is a NativeShard."""

from __future__ import annotations

import pytest
import torch

from flowspec_p2p.model import native_shard
from flowspec_p2p.model.native_draft import NativeDraftHead
from flowspec_p2p.model.native_shard import NativeShard
from flowspec_p2p.model.weights import open_source
from flowspec_p2p.speculative.decoder import load_drafter
from flowspec_p2p.speculative.drafter import HeadDrafter
from flowspec_p2p.speculative.head import DraftBundle, DraftHead
from flowspec_p2p.speculative.ngram import LookupDrafter
from flowspec_p2p.types import LayerRange

from ..gguf_fixtures import write_random_gguf
from .test_drafter import tiny_target

pytestmark = pytest.mark.skipif(not native_shard.available(), reason="the native engine can't be built here")


def _heads(folder, seed=0):
    """A random head (std 0.05, biases random) -> (float64 torch reference with f16-rounded weights, native)."""
    cfg = open_source(folder).config
    head = DraftHead(cfg).reset_parameters(seed=seed, std=0.05)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in (head.fc.bias, head.block.bqkv, head.block.mlp_norm.weight):
            if p is not None:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    state = {k: v.half() for k, v in head.state_dict().items()}
    ref = DraftHead(cfg)
    ref.load_state_dict({k: v.double() for k, v in state.items()})
    return cfg, ref.double().eval(), NativeDraftHead(cfg, state, weights="F16")


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = 2e-3) -> None:
    scale = b.abs().max().item()
    err = (a.double() - b.double()).abs()
    assert err.max().item() <= tol * scale, (err.max().item(), scale)
    assert err.mean().item() <= tol / 10 * scale


def test_the_default_q8_0_head_stays_close_to_its_16_bit_weights(tiny_llama):
    """The head's matrices are kept in Q8_0 by default (a draft needs no exact weights): within the 8-bit weight
    rounding of the F16 head, and never equal to it (the quantization is really applied)."""
    cfg = open_source(tiny_llama).config
    state = {k: v.half() for k, v in DraftHead(cfg).reset_parameters(seed=2, std=0.05).state_dict().items()}
    q8 = NativeDraftHead(cfg, state)
    f16 = NativeDraftHead(cfg, state, weights="F16")
    g = torch.Generator().manual_seed(6)
    feats, embeds = torch.randn(1, 5, cfg.hidden_size, generator=g), torch.randn(1, 5, cfg.hidden_size, generator=g)
    pos = torch.arange(5)[None]
    with torch.inference_mode():
        a, b = q8(feats, embeds, pos, q8.new_cache(8)), f16(feats, embeds, pos, f16.new_cache(8))
    _close(a, b, tol=3e-2)
    assert not torch.equal(a, b)
    with pytest.raises(ValueError, match="Q8_0 or F16"):
        NativeDraftHead(cfg, state, weights="Q4_0")


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # qwen2: the block has a qkv bias
def test_the_native_head_matches_the_torch_head_causal_then_incremental(tiny_checkpoints, kind):
    cfg, ref, ours = _heads(tiny_checkpoints[kind])
    g = torch.Generator().manual_seed(3)
    feats = torch.randn(1, 10, cfg.hidden_size, generator=g)
    embeds = torch.randn(1, 10, cfg.hidden_size, generator=g)
    pos = torch.arange(10)[None]
    c_ref, c_ours = ref.new_cache(16), ours.new_cache(16)
    with torch.inference_mode():
        for rows in (slice(0, 7), slice(7, 10)):  # a prefill of 7, then 3 more rows on the cache
            a = ours(feats[:, rows], embeds[:, rows], pos[:, rows], c_ours)
            b = ref(feats[:, rows].double(), embeds[:, rows].double(), pos[:, rows], c_ref)
            assert a.dtype == torch.float32
            assert a.shape == b.shape
            _close(a, b)
    assert c_ours.length == c_ref.length == 10


def test_the_native_head_matches_the_torch_head_under_a_tree_mask(tiny_llama):
    cfg, ref, ours = _heads(tiny_llama, seed=4)
    g = torch.Generator().manual_seed(5)
    ctx = 6
    feats = torch.randn(1, ctx + 4, cfg.hidden_size, generator=g)
    embeds = torch.randn(1, ctx + 4, cfg.hidden_size, generator=g)
    # four tree rows after the context: two siblings at depth 1, a child of each at depth 2
    pos = torch.tensor([[*range(ctx), ctx, ctx, ctx + 1, ctx + 1]])
    mask = torch.zeros(1, 4, ctx + 4, dtype=torch.bool)
    mask[..., :ctx] = True
    for r, anc in enumerate([[0], [1], [0, 2], [1, 3]]):
        mask[0, r, [ctx + a for a in anc]] = True
    c_ref, c_ours = ref.new_cache(16), ours.new_cache(16)
    with torch.inference_mode():
        ours(feats[:, :ctx], embeds[:, :ctx], pos[:, :ctx], c_ours)
        ref(feats[:, :ctx].double(), embeds[:, :ctx].double(), pos[:, :ctx], c_ref)
        a = ours(feats[:, ctx:], embeds[:, ctx:], pos[:, ctx:], c_ours, mask)
        b = ref(feats[:, ctx:].double(), embeds[:, ctx:].double(), pos[:, ctx:], c_ref, mask.double() > 0)
    _close(a, b)


@pytest.fixture(scope="module")
def native_target(tmp_path_factory):
    src = open_source(write_random_gguf(tmp_path_factory.mktemp("gguf") / "q8.gguf", "Q8_0"))
    return NativeShard.from_source(src, LayerRange(start=0, end=src.config.num_layers), embed=True, head=True)


def _bundle(cfg, tmp_path, vocab=None):
    head = DraftHead(cfg).reset_parameters(seed=7, std=0.05)
    DraftBundle(head, vocab, {"target_fingerprint": "fp"}).save(tmp_path / "h", dtype=torch.float16)
    return tmp_path / "h"


def test_a_tree_node_is_drafted_exactly_as_its_path_alone(native_target, tmp_path):
    """The engine's batch invariance reaches the head: each tree node's predicted feature equals, bit for bit,
    the one a fresh drafter computes feeding the node's path as a chain."""
    stem = _bundle(native_target.cfg, tmp_path)
    drafter, _ = load_drafter(native_target, "fp", stem)
    assert isinstance(drafter, LookupDrafter)
    head_drafter = drafter.base
    assert isinstance(head_drafter, HeadDrafter)
    assert isinstance(head_drafter.head, NativeDraftHead)
    prompt = [5, 9, 17, 33, 2, 40]
    feats = torch.randn(len(prompt), native_target.cfg.hidden_size, generator=torch.Generator().manual_seed(8))
    nodes = [11, 12, 13]  # a root and its two children, the children expanded in one call
    head = head_drafter.head

    def chain(tokens):  # the features of running tokens[i] after feats' context, one row per call
        cache = head.new_cache(32)
        nxt = torch.tensor([[*prompt[1:], tokens[0]]])
        out = [head(feats[None], native_target.embed(nxt), torch.arange(len(prompt))[None], cache)[0, -1]]
        for d, t in enumerate(tokens[1:]):
            e = native_target.embed(torch.tensor([[t]]))
            out.append(head(out[-1][None, None], e, torch.tensor([[len(prompt) + d]]), cache)[0, 0])
        return out

    with torch.inference_mode():
        root = chain([nodes[0]])[0]
        cache = head.new_cache(32)
        nxt = torch.tensor([[*prompt[1:], nodes[0]]])
        head(feats[None], native_target.embed(nxt), torch.arange(len(prompt))[None], cache)
        cache.commit(cache.pending)
        # both children of the root in one forward: each sees the context and itself only
        kids = torch.tensor([[nodes[1], nodes[2]]])
        mask = torch.zeros(1, 2, cache.length + 2, dtype=torch.bool)
        mask[..., : cache.length] = True
        mask[0, 0, cache.length], mask[0, 1, cache.length + 1] = True, True
        both = head(root.expand(1, 2, -1).contiguous(), native_target.embed(kids),
                    torch.tensor([[len(prompt)] * 2]), cache, mask)[0]
        for r, t in enumerate(nodes[1:]):
            alone = chain([nodes[0], t])[1]
            assert torch.equal(both[r], alone)


def test_load_drafter_keeps_the_torch_head_for_a_torch_target(tiny_llama, tmp_path):
    target = tiny_target(tiny_llama)
    drafter, meta = load_drafter(target, "fp", _bundle(target.cfg, tmp_path))
    head_drafter = drafter.base
    assert isinstance(head_drafter.head, DraftHead)
    assert head_drafter.head.dtype == torch.float64
    assert meta["target_fingerprint"] == "fp"
