"""NativeShard, the TorchShard interface on the native engine, on tiny random GGUF models of every block type: it agrees
with the float64 torch TorchShard on the same file (which dequantizes the same bytes) within the 16-bit activation
rounding, a tree forward scores each node bit for bit as decoding it alone does, the weights stay in their blocks,
a stop flag stops between layers, and a type without a kernel loads as F16 with a warning."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from flowspec_p2p.errors import ForwardStopped
from flowspec_p2p.model import native_pack, native_shard
from flowspec_p2p.model.engine import StopFlag
from flowspec_p2p.model.generate import ARDecoder, generate_ids
from flowspec_p2p.model.native_shard import NativeShard
from flowspec_p2p.model.sampling import SamplingParams
from flowspec_p2p.model.torch_shard import TorchShard
from flowspec_p2p.model.weights import open_source
from flowspec_p2p.types import LayerRange

from ..gguf_fixtures import write_random_gguf

pytestmark = pytest.mark.skipif(not native_shard.available(), reason="the native engine can't be built here")

TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16", "F32"]
ALL = LayerRange(start=0, end=2)


@pytest.fixture(scope="module", params=TYPES)
def model(request, tmp_path_factory):
    path = write_random_gguf(tmp_path_factory.mktemp("gguf") / f"{request.param}.gguf", request.param,
                             seed=TYPES.index(request.param))
    return open_source(path)


def _pair(src, *, embed=True, head=True):
    ours = NativeShard.from_source(src, ALL, embed=embed, head=head)
    ref = TorchShard.from_source(src, ALL, embed=embed, head=head, dtype=torch.float64).eval()
    return ours, ref


def test_logits_match_the_float64_reference_within_the_activation_rounding(model):
    ours, ref = _pair(model)
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        a = ours.logits(ours(ids, ours.new_cache(16)))
        b = ref.logits(ref(ids, ref.new_cache(16)))
    scale = b.abs().max().item()
    assert (a.double() - b).abs().max().item() <= 2e-3 * scale
    assert (a.double() - b).abs().mean().item() <= 2e-4 * scale


def test_greedy_tokens_are_the_logits_argmax_on_both_engines(model):
    """Shard.greedy_tokens (native: the argmax inside the LM-head call) equals logits().argmax(-1) bit for bit,
    for 1 and several rows, and through the logits for a soft-capped head; the native AR decoder's greedy reply
    equals a loop over the full logits' argmax."""
    ours, ref = _pair(model)
    ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        f, fr = ours(ids, ours.new_cache(16))[0], ref(ids, ref.new_cache(16))[0]  # [9, hidden]
        for shard, x in ((ours, f), (ref, fr)):
            assert torch.equal(shard.greedy_tokens(x), shard.logits(x).argmax(-1))
            assert int(shard.greedy_tokens(x[4])) == int(shard.logits(x[4]).argmax())
        capped = NativeShard(model.config.model_copy(update={"final_softcap": 0.05}), ALL, ours.stack,
                             embed=ours.embed_matrix, norm=ours.norm.weight, lm_head=ours.lm_head, rope_freqs=None,
                             max_position=ours.max_position, specs=ours.specs)
        assert torch.equal(capped.greedy_tokens(f), capped.logits(f).argmax(-1))
        cache, out, x = ours.new_cache(20), [], ids
        for _ in range(6):
            out.append(int(ours.logits(ours(x, cache)[0, -1]).argmax()))
            x = torch.tensor([[out[-1]]])
    reply, _ = generate_ids(ARDecoder(ours), ids[0].tolist(), SamplingParams(), 6, frozenset())
    assert reply == out


def test_a_tree_forward_scores_every_node_exactly_as_decoding_it_alone(model):
    """Batch invariance: the rows of one forward of a 5-node chain (causal mask) and of a tree (siblings) equal,
    bit for bit, the same nodes run one per forward."""
    ours, _ = _pair(model)
    prompt = torch.randint(0, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(1))
    nodes = torch.randint(0, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        cache = ours.new_cache(32)
        ours(prompt, cache)
        cache.commit(6)
        batched = ours(nodes, cache)[0]  # [5, hidden]: a chain after the prompt
        cache.keep([])
        alone = torch.cat([ours(nodes[:, i : i + 1], cache)[0] for i in range(5)])
        assert torch.equal(batched, alone)
        cache.keep([])
        # siblings of the prompt's end: each sees the prompt and itself only
        mask = torch.zeros(1, 5, 11, dtype=torch.bool)
        mask[0, :, :6] = True
        mask[0, range(5), range(6, 11)] = True
        tree = ours(nodes, cache, positions=torch.full((1, 5), 6), mask=mask)[0]
        cache.keep([])
        for i in range(5):
            one = ours(nodes[:, i : i + 1], cache, positions=torch.tensor([[6]]))[0]
            cache.keep([])
            assert torch.equal(tree[i], one[0]), i


def test_weights_stay_in_their_blocks(model):
    ours, _ = _pair(model, embed=False, head=False)
    stored = sum(len(model.raw_bytes(f"model.layers.{i}.{n}")) for i in ALL.indices()
                 for n in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                           "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                           "mlp.down_proj.weight"))
    vectors = sum(v.numel() * 4 for sp in ours.specs for v in (sp.attn_norm, sp.mlp_norm) if v is not None)
    assert stored <= ours.nbytes - vectors <= 1.03 * stored  # the matrices: their blocks, re-laid out


def test_a_stop_flag_stops_the_forward_between_layers(tmp_path):
    src = open_source(write_random_gguf(tmp_path / "m.gguf", "Q4_1"))
    ours = NativeShard.from_source(src, ALL, embed=True, head=True)
    stop = StopFlag()
    stop.set()
    cache = ours.new_cache(8)
    with pytest.raises(ForwardStopped):
        ours(torch.tensor([[3, 4]]), cache, stop=stop)
    assert cache.length == 2  # the rows' slots stay reserved: the caller's prune drops them
    cache.keep([])
    assert ours(torch.tensor([[3, 4]]), cache, stop=StopFlag()).shape == (1, 2, 256)


def test_a_type_without_a_kernel_loads_as_f16_with_one_warning(tmp_path, caplog):
    """Q2_K has no kernel: its tensors are dequantized and kept as F16 (the file's values, rounded to 16 bits)."""
    src = open_source(write_random_gguf(tmp_path / "m.gguf", "Q2_K"))
    native_pack._WARNED.discard("Q2_K")
    with caplog.at_level(logging.WARNING, logger="flowspec_p2p.model.native_pack"):
        ours = NativeShard.from_source(src, ALL, embed=True, head=True)
    assert [r.getMessage() for r in caplog.records].count(
        "the native engine has no kernel for Q2_K: those tensors are dequantized to F16") == 1
    assert {s.q.type_name for s in ours.specs} == {"F16"}
    ref = TorchShard.from_source(src, ALL, embed=True, head=True, dtype=torch.float64).eval()
    ids = torch.tensor([[5, 6, 7]])
    with torch.inference_mode():
        a, b = ours.logits(ours(ids, None)), ref.logits(ref(ids, None))
    assert np.allclose(a.numpy(), b.numpy(), rtol=0, atol=1e-2 * b.abs().max().item())


@pytest.mark.parametrize("tied", [True, False])
def test_a_donor_shares_its_layers_embedding_and_lm_head(tmp_path, tied):
    """A leader's head shard (embedding + LM head, no layers) donates them to its first stage, and a stage donates
    its layers to the next plan's: the same packed matrices, and the same logits bit for bit."""
    src = open_source(write_random_gguf(tmp_path / "m.gguf", "Q4_0", tied=tied))
    head = NativeShard.from_source(src, LayerRange(start=0, end=0), embed=True, head=True)
    alone = NativeShard.from_source(src, ALL, embed=True, head=True)
    shared = NativeShard.from_source(src, ALL, embed=True, head=True, donors=[head])
    assert shared.embed_matrix is head.embed_matrix
    assert shared.lm_head is head.lm_head
    assert shared.head_source == head.head_source
    later = NativeShard.from_source(src, LayerRange(start=1, end=2), embed=False, head=True, donors=[shared])
    assert later.specs[0] is shared.specs[1]
    assert later.lm_head is head.lm_head
    ids = torch.randint(0, src.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        a = alone.logits(alone(ids, alone.new_cache(8)))
        b = shared.logits(shared(ids, shared.new_cache(8)))
    assert torch.equal(a, b)


@pytest.mark.parametrize("order", ["increasing", "any"])
def test_head_rows_are_the_lm_heads_rows(tmp_path, monkeypatch, order):
    """A draft vocabulary's LM-head rows, gathered from the file one window of source rows at a time (increasing
    ids) or at once (any order), score exactly as the whole LM head's."""
    monkeypatch.setattr(native_shard, "CHUNK_ROWS", 32)  # several windows and chunks on the tiny vocabulary
    src = open_source(write_random_gguf(tmp_path / "q8.gguf", "Q4_1", embed_type="Q8_0", seed=3))
    shard = NativeShard.from_source(src, LayerRange(start=0, end=0), embed=True, head=True)
    g = torch.Generator().manual_seed(0)
    ids = torch.randperm(160, generator=g)[:75]
    ids = torch.sort(ids).values if order == "increasing" else ids
    x = torch.randn(3, shard.cfg.hidden_size, generator=g)
    rows = shard.head_rows(ids)
    assert rows.rows == 75
    assert torch.equal(rows.matmul(x), shard.lm_head.matmul(x)[:, ids])


def test_rotary_tables_start_small_and_grow_to_the_same_rows(tmp_path):
    """The tables start at ROTARY_CHUNK positions and double (or jump to what a forward needs): the rows they hold
    never depend on their size, so a grown table gives what a full-size one would."""
    from flowspec_p2p.model.blocks import Rotary

    src = open_source(write_random_gguf(tmp_path / "m.gguf", "Q8_0", max_position=4096))
    ours = NativeShard.from_source(src, ALL, embed=True, head=True)
    chunk = native_shard.ROTARY_CHUNK
    assert ours.rotary.cos.shape[0] == chunk
    sizes = [ours._rotary_upto(n).cos.shape[0] for n in (chunk, chunk + 1, 3 * chunk + 5, 4 * chunk, 4096)]
    assert sizes == [chunk, 2 * chunk, 4 * chunk, 4 * chunk, 4096]
    full = Rotary(src.config, 4096, torch.float32)
    assert torch.equal(ours.rotary.cos, full.cos)
    assert torch.equal(ours.rotary.sin, full.sin)
