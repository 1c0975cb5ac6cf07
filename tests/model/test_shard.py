import pytest
import torch

from flowspec_p2p.model import native_shard
from flowspec_p2p.model.native_shard import NativeShard
from flowspec_p2p.model.torch_shard import TorchShard
from flowspec_p2p.model.weights import open_source
from flowspec_p2p.types import LayerRange

from ..conftest import TINY_ARCHS


def _hf(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64, attn_implementation="sdpa").eval()


def _whole(folder, dtype=torch.float64):
    src = open_source(folder)
    whole = LayerRange(start=0, end=src.config.num_layers)
    return TorchShard.from_source(src, whole, embed=True, head=True, dtype=dtype)


@pytest.mark.parametrize("kind", TINY_ARCHS)
def test_forward_matches_transformers_in_float64(tiny_checkpoints, kind):
    folder = tiny_checkpoints[kind]
    ids = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = _hf(folder)(ids).logits  # [1, 40, vocab]
        shard = _whole(folder)
        cache = shard.new_cache(64)
        a = shard(ids[:, :25], cache)  # prefill, then a second chunk against the cache
        b = shard(ids[:, 25:], cache)
        ours = shard.logits(torch.cat([a, b], dim=1))
    assert (ours - ref).abs().max().item() <= 1e-9


@pytest.mark.parametrize("kind", ["llama", "llama-untied"])
def test_tied_embedding_is_one_table_with_the_head(tiny_checkpoints, kind):
    """A tied model's embedding is a view of the LM head (no second table); an untied one keeps its own. Both
    look up exactly the checkpoint's rows."""
    folder = tiny_checkpoints[kind]
    shard = _whole(folder)
    ref = _hf(folder).get_input_embeddings().weight  # [vocab, hidden]
    shares = shard.embed.weight.untyped_storage().data_ptr() == shard.head_t.untyped_storage().data_ptr()
    assert shares == (kind == "llama")
    ids = torch.tensor([[0, 5, 95, 5]])
    with torch.inference_mode():
        assert torch.equal(shard.embed(ids)[0], ref[ids[0]])


def test_qwen2_bias_is_used(tiny_checkpoints):
    shard = _whole(tiny_checkpoints["qwen2"])
    assert shard.blocks[0].bqkv is not None
    assert shard.blocks[0].bqkv.abs().sum() > 0


def test_stages_in_sequence_equal_the_whole_model(tiny_llama):
    src = open_source(tiny_llama)
    ids = torch.randint(0, 96, (1, 12))
    whole = _whole(tiny_llama)
    first = TorchShard.from_source(src, LayerRange(start=0, end=1), embed=True, head=False, dtype=torch.float64)
    mid = TorchShard.from_source(src, LayerRange(start=1, end=3), embed=False, head=False, dtype=torch.float64)
    last = TorchShard.from_source(src, LayerRange(start=3, end=4), embed=False, head=True, dtype=torch.float64)
    with torch.inference_mode():
        ref = whole.logits(whole(ids, None))
        h = last(mid(first(ids, None), None), None)
        assert first.head_t is None
        assert last.embed is None
        assert torch.equal(last.logits(h), ref)


def test_tree_mask_equals_running_each_branch_alone(tiny_llama):
    """A new token that sees only its ancestors gets the same output as the branch run by itself."""
    shard = _whole(tiny_llama)
    prefix = torch.randint(0, 96, (1, 10))
    # tree over new tokens: 0 -> {1, 2}, 1 -> {3}; positions are 10 + depth
    tokens = torch.tensor([[5, 6, 7, 8]])
    parents = [-1, 0, 0, 1]
    depth = [0, 1, 1, 2]
    vis = torch.zeros(4, 4, dtype=torch.bool)
    for i, p in enumerate(parents):
        vis[i, i] = True
        while p != -1:
            vis[i, p] = True
            p = parents[p]
    mask = torch.cat([torch.ones(4, 10, dtype=torch.bool), vis], dim=1)[None]  # [1, 4, 14]
    with torch.inference_mode():
        cache = shard.new_cache(32)
        shard(prefix, cache)
        tree = shard(tokens, cache, positions=torch.tensor([[10 + d for d in depth]]), mask=mask)
        for leaf_path in ([0, 1, 3], [0, 2]):
            c = shard.new_cache(32)
            shard(prefix, c)
            alone = shard(tokens[:, leaf_path], c)
            assert (alone - tree[:, leaf_path]).abs().max() <= 1e-12


@pytest.fixture(scope="module")
def hf_default(default_model):
    from transformers import AutoModelForCausalLM

    path = default_model.path
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def _logits(shard, ids):
    with torch.inference_mode():
        cache = shard.new_cache(64)
        return shard.logits(torch.cat([shard(ids[:, :40], cache), shard(ids[:, 40:], cache)], dim=1))


@pytest.mark.slow
def test_default_model_matches_transformers_in_float32_on_the_torch_engine(default_model, hf_default):
    ids = torch.randint(0, 49152, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ref = hf_default(ids).logits
    shard = TorchShard.from_source(default_model.source, LayerRange(start=0, end=30), embed=True, head=True).eval()
    assert (_logits(shard, ids) - ref).abs().max().item() <= 1e-3


@pytest.mark.slow
def test_default_model_on_the_native_engine_stays_within_its_activation_rounding(default_model, hf_default):
    """The native engine rounds activations to 16 bits per 32-element block inside its integer matmuls: logits stay
    within ~1e-4 of their size (a wrong kernel would be off by whole units), and every argmax agrees."""
    if not native_shard.available():
        pytest.skip("the native engine is unavailable here (no C compiler?)")
    assert isinstance(default_model.shard, NativeShard)
    tok = default_model.tokenizer
    prompt = tok.chat([{"role": "user", "content": "Explain how rainbows form, in detail, for a child."}])
    ids = torch.tensor([prompt[:48]])
    with torch.inference_mode():
        ref = hf_default(ids).logits
    ours = _logits(default_model.shard, ids)
    err = (ours - ref).abs()
    assert err.max().item() <= 3e-2
    assert err.mean().item() <= 3e-3
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
