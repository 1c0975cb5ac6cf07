"""The newer families (Qwen3, Gemma 3, Phi-3) and Llama 3.x's rope scaling: transformers' own tiny random configs,
read from the HF folder and from a GGUF written as llama.cpp writes it, match transformers in float64 on the torch
reference; sliding windows, LongRoPE's long factors and a draft tree under a window behave as transformers does. On
the native engine: within its activation rounding of that reference, batch invariant, the same bits on every ISA."""

from __future__ import annotations

import pytest
import torch

from flowspec_p2p.model import native_shard
from flowspec_p2p.model.arch import config_from_hf
from flowspec_p2p.model.blocks import rope_inv_freq
from flowspec_p2p.model.engine import BatchRows
from flowspec_p2p.model.native_shard import NativeShard
from flowspec_p2p.model.torch_shard import TorchShard
from flowspec_p2p.model.weights import open_source
from flowspec_p2p.types import LayerRange

from ..conftest import PHI3_ORIGINAL_CONTEXT, build_tiny_checkpoint, tiny_hf_config
from .family_gguf import write_family_gguf

FAMILIES = ("qwen3", "gemma3", "phi3")
# what llama.cpp's GGUF cannot say for Gemma 3 (it assumes every 6th layer global and query_pre_attn_scalar =
# head_dim): the GGUF round trip uses a checkpoint that follows those defaults
GGUF_OVERRIDES = {"gemma3": dict(num_hidden_layers=6, layer_types=None, query_pre_attn_scalar=16)}


def _hf(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64, attn_implementation="sdpa").eval()


def _whole(src, dtype=torch.float64, **kw) -> TorchShard:
    return TorchShard.from_source(src, LayerRange(start=0, end=src.config.num_layers), embed=True, head=True,
                                  dtype=dtype, **kw).eval()


@pytest.fixture(scope="module")
def gguf_families(tmp_path_factory) -> dict[str, tuple]:
    """family -> (HF folder, its float64 GGUF)"""
    root = tmp_path_factory.mktemp("families")
    out = {}
    for i, kind in enumerate(FAMILIES):
        folder = root / kind
        build_tiny_checkpoint(folder, kind, seed=10 + i, **GGUF_OVERRIDES.get(kind, {}))
        out[kind] = (folder, write_family_gguf(root / f"{kind}.gguf", folder, ftype="F64"))
    return out


def test_each_familys_options_are_read_from_its_config():
    qwen3, gemma3, phi3 = (config_from_hf(tiny_hf_config(k).to_dict()) for k in FAMILIES)
    assert (qwen3.qk_norm, qwen3.attention_bias, qwen3.sandwich_norms) == (True, False, False)
    assert (gemma3.qk_norm, gemma3.sandwich_norms, gemma3.norm_offset, gemma3.activation) == (True, True, True,
                                                                                             "gelu_tanh")
    assert (gemma3.sliding_window, gemma3.sliding_layers, gemma3.rope_local_theta) == (8, (0, 1, 3), 10000.0)
    assert gemma3.attn_scale == pytest.approx(24**-0.5)
    assert (gemma3.embed_scale, gemma3.final_softcap) == (8.0, 3.0)
    assert phi3.longrope.original_max_position == PHI3_ORIGINAL_CONTEXT
    assert (phi3.sliding_layers, phi3.tie_embeddings) == ((0, 1, 2, 3), False)


@pytest.mark.parametrize("kind", FAMILIES)
def test_a_familys_gguf_reproduces_transformers_in_float64(gguf_families, kind):
    """The GGUF (names, fused matrices, Gemma's 1 + w norms, LongRoPE factors as tensors) gives the HF folder's
    config and transformers' logits to 1e-9."""
    folder, path = gguf_families[kind]
    src = open_source(path)
    ref_cfg = open_source(folder).config
    assert src.config == ref_cfg.model_copy(update={"rms_eps": src.config.rms_eps})
    ids = torch.randint(0, 96, (1, 30), generator=torch.Generator().manual_seed(3))
    shard = _whole(src)
    with torch.inference_mode():
        cache = shard.new_cache(32)
        ours = shard.logits(torch.cat([shard(ids[:, :20], cache), shard(ids[:, 20:], cache)], dim=1))
        ref = _hf(folder)(ids).logits
    assert (ours - ref).abs().max().item() <= 1e-9


def test_phi3_decoding_past_the_original_context_uses_the_long_factors_as_transformers(tiny_checkpoints):
    """transformers switches to LongRoPE's long factors once a forward reaches the original context; decoding one
    token at a time past it, each step's logits are ours (the short-factor prefix stays in its cache)."""
    folder = tiny_checkpoints["phi3"]
    hf = _hf(folder)
    shard = _whole(open_source(folder))
    ids = torch.randint(0, 96, (1, PHI3_ORIGINAL_CONTEXT + 8), generator=torch.Generator().manual_seed(4))
    prefill = PHI3_ORIGINAL_CONTEXT - 4
    with torch.inference_mode():
        out = hf(ids[:, :prefill], use_cache=True)
        past, theirs = out.past_key_values, [out.logits[0, -1]]
        for i in range(prefill, ids.shape[1]):
            out = hf(ids[:, i : i + 1], cache=past, use_cache=True)
            past = out.past_key_values
            theirs.append(out.logits[0, -1])
        cache = shard.new_cache(ids.shape[1])
        ours = [shard.logits(shard(ids[:, :prefill], cache))[0, -1]]
        ours += [shard.logits(shard(ids[:, i : i + 1], cache))[0, -1] for i in range(prefill, ids.shape[1])]
    assert (torch.stack(ours) - torch.stack(theirs)).abs().max().item() <= 1e-9


@pytest.mark.parametrize("kind", ["gemma3", "phi3"])
def test_a_tree_under_a_sliding_window_scores_each_branch_as_decoding_it_alone(tiny_checkpoints, kind):
    """The window counts a node's own path (prefix + ancestors), not the slots its siblings take."""
    shard = _whole(open_source(tiny_checkpoints[kind]))
    prefix = torch.randint(0, 96, (1, 14), generator=torch.Generator().manual_seed(5))
    tokens = torch.tensor([[5, 6, 7, 8, 9, 10]])
    parents = [-1, 0, 0, 1, 3, 2]
    depth, vis = [], torch.zeros(6, 6, dtype=torch.bool)
    for i, p in enumerate(parents):
        depth.append(0 if p < 0 else depth[p] + 1)
        vis[i, i] = True
        if p >= 0:
            vis[i] |= vis[p]
    mask = torch.cat([torch.ones(6, 14, dtype=torch.bool), vis], dim=1)[None]  # [1, 6, 20]
    with torch.inference_mode():
        cache = shard.new_cache(32)
        shard(prefix, cache)
        tree = shard(tokens, cache, positions=torch.tensor([[14 + d for d in depth]]), mask=mask)
        for path in ([0, 1, 3, 4], [0, 2, 5]):
            c = shard.new_cache(32)
            shard(prefix, c)
            alone = shard(tokens[:, path], c)
            assert (alone - tree[:, path]).abs().max() <= 1e-12


def test_llama3_rope_scaling_on_a_real_shaped_config_matches_transformers_and_the_gguf_factors():
    """Llama 3.2 1B's rope (theta 5e5, factor 32, original 8192, head_dim 64): our frequencies equal transformers';
    llama.cpp's baked rope_freqs.weight (its converter's formula) gives them to float32 rounding; and a forward at
    positions past 8192 matches transformers' in float64."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    hf = tiny_hf_config("llama", hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                        max_position_embeddings=131072, rope_parameters=rope)
    cfg = config_from_hf(hf.to_dict())
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, torch.device("cpu"))
    assert torch.equal(rope_inv_freq(cfg), theirs.float())
    base = 1.0 / (500000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    factors = []
    for f in base.tolist():  # llama.cpp's convert_hf_to_gguf LlamaModel.generate_extra_tensors
        wavelen = 2 * torch.pi / f
        if wavelen < 8192 / 4.0:
            factors.append(1.0)
        elif wavelen > 8192 / 1.0:
            factors.append(32.0)
        else:
            smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            factors.append(1 / ((1 - smooth) / 32.0 + smooth))
    baked = rope_inv_freq(cfg, torch.tensor(factors, dtype=torch.float32))
    assert torch.allclose(baked, theirs.float(), rtol=1e-6, atol=0)


def test_llama3_rope_forward_past_the_original_context_matches_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    folder = tmp_path / "llama3"
    build_tiny_checkpoint(folder, "llama", seed=7, hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=64, num_hidden_layers=2, max_position_embeddings=131072, rope_parameters=rope)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64, attn_implementation="sdpa").eval()
    shard = _whole(open_source(folder), max_position=20000)
    ids = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(8))
    pos = torch.arange(19000, 19006)[None]
    with torch.inference_mode():
        ours = shard.logits(shard(ids, None, positions=pos))
        ref = hf(ids, position_ids=pos).logits
    assert (ours - ref).abs().max().item() <= 1e-9


# ------------------------------------------------------------------------------------------ native engine


@pytest.fixture(scope="module")
def native_families(gguf_families, tmp_path_factory) -> dict[str, object]:
    """family -> its GGUF with every layer matrix Q8_0 (the engine's integer kernels), the rest F32"""
    if not native_shard.available():
        pytest.skip("the native engine can't be built here")
    import gguf

    root = tmp_path_factory.mktemp("native_families")
    out = {}
    for kind, (folder, _) in gguf_families.items():
        n = open_source(folder).config.num_layers
        q8 = {f"blk.{i}.{m}.weight": gguf.GGMLQuantizationType.Q8_0 for i in range(n)
              for m in ("attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
        out[kind] = open_source(write_family_gguf(root / f"{kind}.gguf", folder, qtypes=q8))
    return out


def _native(src) -> NativeShard:
    return NativeShard.from_source(src, LayerRange(start=0, end=src.config.num_layers), embed=True, head=True)


@pytest.mark.parametrize("kind", FAMILIES)
def test_a_family_on_the_native_engine_stays_within_its_activation_rounding(native_families, kind):
    """Same file, float64 torch reference: logits within the engine's 16-bit activation rounding (as for the Llama
    family: 2e-3 of their scale at most, 2e-4 on average), every argmax equal, through a window and past it."""
    src = native_families[kind]
    ours, ref = _native(src), _whole(src)
    ids = torch.randint(0, 96, (1, 30), generator=torch.Generator().manual_seed(9))
    with torch.inference_mode():
        c1, c2 = ours.new_cache(32), ref.new_cache(32)
        a = ours.logits(torch.cat([ours(ids[:, :18], c1), *(ours(ids[:, i : i + 1], c1) for i in range(18, 30))], 1))
        b = ref.logits(torch.cat([ref(ids[:, :18], c2), *(ref(ids[:, i : i + 1], c2) for i in range(18, 30))], 1))
    scale = b.abs().max().item()
    assert (a.double() - b).abs().max().item() <= 2e-3 * scale
    assert (a.double() - b).abs().mean().item() <= 2e-4 * scale
    assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.parametrize("kind", FAMILIES)
def test_a_familys_rows_are_batch_invariant_on_the_native_engine(native_families, kind):
    """A tree forward (siblings under the window) and two requests in one batched forward give each row, bit for
    bit, what decoding it alone gives: the new ops (QK-norm, output norms, GELU, windows) keep batch invariance."""
    shard = _native(native_families[kind])
    prompt = torch.randint(0, 96, (1, 14), generator=torch.Generator().manual_seed(11))
    nodes = torch.randint(0, 96, (1, 5), generator=torch.Generator().manual_seed(12))
    with torch.inference_mode():
        cache = shard.new_cache(32)
        shard(prompt, cache)
        cache.commit(14)
        mask = torch.zeros(1, 5, 19, dtype=torch.bool)
        mask[0, :, :14] = True
        mask[0, range(5), range(14, 19)] = True
        tree = shard(nodes, cache, positions=torch.full((1, 5), 14), mask=mask)[0]
        cache.keep([])
        for i in range(5):
            one = shard(nodes[:, i : i + 1], cache)[0]
            cache.keep([])
            assert torch.equal(tree[i], one[0]), i
        other = shard.new_cache(32)
        shard(nodes, other)
        both = shard.forward_batch([BatchRows(prompt[:, :3], other), BatchRows(nodes[:, :1], cache)])
        other.truncate(5)
        cache.keep([])
        assert torch.equal(both[1], shard(nodes[:, :1], cache))
        assert torch.equal(both[0], shard(prompt[:, :3], other))


def test_every_isa_path_gives_the_same_bits_on_gemma3(native_families):
    """GELU, QK-norm, the output norms and the window are the same float operations on every ISA path."""
    from flowspec_p2p.model import native

    src = native_families["gemma3"]
    ids = torch.randint(0, 96, (1, 20), generator=torch.Generator().manual_seed(13))
    outs = {}
    try:
        for isa in native.available_isas():
            native.set_isa(isa)
            shard = _native(src)
            with torch.inference_mode():
                outs[isa] = shard(ids, shard.new_cache(24))
    finally:
        native.set_isa(None)
    first = next(iter(outs.values()))
    for isa, out in outs.items():
        assert torch.equal(out, first), isa
