import pytest
import torch

from flowspec_p2p.env import PACKED_WEIGHTS
from flowspec_p2p.model import kernels as fewrow
from flowspec_p2p.model import native_shard
from flowspec_p2p.model import shard as shard_mod
from flowspec_p2p.model.native_shard import NativeShard
from flowspec_p2p.model.shard import Shard
from flowspec_p2p.model.weights import open_source
from flowspec_p2p.types import LayerRange

from ..conftest import TINY_ARCHS


def _hf(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64, attn_implementation="sdpa").eval()


def _whole(folder, dtype=torch.float64):
    src = open_source(folder)
    return Shard.from_source(src, LayerRange(start=0, end=src.config.num_layers), embed=True, head=True, dtype=dtype)


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
    first = Shard.from_source(src, LayerRange(start=0, end=1), embed=True, head=False, dtype=torch.float64)
    mid = Shard.from_source(src, LayerRange(start=1, end=3), embed=False, head=False, dtype=torch.float64)
    last = Shard.from_source(src, LayerRange(start=3, end=4), embed=False, head=True, dtype=torch.float64)
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
    shard = Shard.from_source(default_model.source, LayerRange(start=0, end=30), embed=True, head=True).eval()
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


def _backends() -> list:
    """Each few-row backend this host has, as a pytest param (the others skipped with the reason)."""
    have = {"onednn": shard_mod._onednn_available(), "fewrow": fewrow.library() is not None}
    return [pytest.param(name, marks=() if ok else pytest.mark.skip(reason=f"no {name} backend on this host"))
            for name, ok in have.items()]


@pytest.fixture
def one_thread():
    """The fewrow kernel serves one torch thread only (stages and the leader run one)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("name", _backends())
def test_packed_few_row_matmuls_agree_and_follow_the_weights(tiny_llama, monkeypatch, one_thread, name):
    """Tree-sized forwards in float32 go through the backend's packed copies: same outputs as MKL's (to float32
    rounding), never for one row, float64, or under autograd, and repacked when the weights change."""
    shard = _whole(tiny_llama, dtype=torch.float32)
    block = shard.blocks[0]
    ids = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(3))

    def run(env: str, x=ids):
        monkeypatch.setenv(PACKED_WEIGHTS, env)
        with torch.inference_mode():
            return shard(x, None)

    plain = run("0")
    assert block._packed.key is None
    run(name, ids[:, :1])
    assert block._packed.key is None  # one row: MKL
    packed = run(name)
    assert block._packed.key is not None
    assert block._packed.key[0] == name
    assert (packed - plain).abs().max().item() <= 1e-5
    copy = block._packed.weights[0]
    if name == "onednn":
        assert copy.is_mkldnn  # a separate copy in oneDNN's layout
    else:
        assert copy.panels.data_ptr() != block.wqkv.data_ptr()
    with torch.no_grad():
        block.w13.mul_(0.5)
    assert (run(name) - run("0")).abs().max().item() <= 1e-5
    assert (run(name) - packed).abs().max().item() > 1e-3  # the new weights were used, not the stale copy
    monkeypatch.setenv(PACKED_WEIGHTS, name)
    fresh = _whole(tiny_llama, dtype=torch.float32)
    fresh(ids, None)
    assert fresh.blocks[0]._packed.key is None  # autograd on: training never sees the packed path
    f64 = _whole(tiny_llama)
    with torch.inference_mode():
        f64(ids, None)
    assert f64.blocks[0]._packed.key is None


@pytest.mark.parametrize("name", _backends())
def test_packed_lm_head_agrees_for_a_few_rows_only(tiny_llama, monkeypatch, one_thread, name):
    """The LM head verifies a few rows through its packed copy (same logits to float32 rounding, same argmax);
    one row and long prompt chunks stay on MKL."""
    shard = _whole(tiny_llama, dtype=torch.float32)
    feats = torch.randn(1, 40, shard.cfg.hidden_size, generator=torch.Generator().manual_seed(5))

    def logits(env: str, x):
        monkeypatch.setenv(PACKED_WEIGHTS, env)
        with torch.inference_mode():
            return shard.logits(x)

    assert torch.equal(logits(name, feats[:, :1]), feats[:, :1] @ shard.head_t)
    assert torch.equal(logits(name, feats), feats @ shard.head_t)  # 40 rows: a prompt chunk, MKL
    assert shard._head_packed.key is None
    plain, packed = logits("0", feats[0, :5]), logits(name, feats[0, :5])  # [5, vocab]
    assert shard._head_packed.key[0] == name
    assert (packed - plain).abs().max().item() <= 1e-5
    assert torch.equal(packed.argmax(-1), plain.argmax(-1))


def test_the_best_backend_is_the_kernel_on_one_thread_and_onednn_on_more(monkeypatch, one_thread):
    """FLOWSPEC_PACKED_WEIGHTS=1 picks the fewrow kernel where it runs (one torch thread), else oneDNN; 0 picks
    none; float64 never packs."""
    monkeypatch.setenv(PACKED_WEIGHTS, "1")
    kernel = fewrow.library() is not None
    onednn = shard_mod.ONEDNN if shard_mod._onednn_available() else None
    assert shard_mod.backend() is (shard_mod.FEWROW if kernel else onednn)
    torch.set_num_threads(2)
    assert shard_mod.backend() is onednn
    monkeypatch.setenv(PACKED_WEIGHTS, "0")
    assert shard_mod.backend() is None
    monkeypatch.setenv(PACKED_WEIGHTS, "1")
    assert shard_mod.backend(torch.float64) is None
