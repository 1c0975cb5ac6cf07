"""The engine seam (model/engine.py): an engine is chosen once and by name, and what it says a shard costs is what
its shards hold -- the bytes of each tensor the planner counts, the KV bytes per token -- on both engines."""

import pytest
import torch

from flowspec_p2p import env
from flowspec_p2p.cluster.plans import describe_model
from flowspec_p2p.errors import ConfigError
from flowspec_p2p.model import native_shard
from flowspec_p2p.model.arch import shard_tensor_names
from flowspec_p2p.model.draft_head import DraftHead
from flowspec_p2p.model.load import get_engine, load_shard
from flowspec_p2p.model.weights import open_source
from flowspec_p2p.types import LayerRange

from ..gguf_fixtures import write_random_gguf

needs_native = pytest.mark.skipif(not native_shard.available(), reason="the native engine is unavailable here")
ENGINES = ["torch", pytest.param("native", marks=needs_native)]


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    return open_source(write_random_gguf(tmp_path_factory.mktemp("m") / "m.gguf", "Q4_K", tied=False))


def test_an_engine_is_chosen_by_name_with_the_environment_only_as_a_fill_in(monkeypatch):
    monkeypatch.delenv(env.ENGINE, raising=False)
    assert get_engine("torch").name == "torch"
    assert get_engine("auto", torch.float64).name == "torch"  # the native engine computes in float32 only
    assert get_engine("auto").name == ("native" if native_shard.available() else "torch")
    monkeypatch.setenv(env.ENGINE, "torch")
    assert get_engine().name == "torch"
    assert get_engine("auto").name == ("native" if native_shard.available() else "torch")  # the choice wins
    with pytest.raises(ConfigError, match="float32"):
        get_engine("native", torch.float64)
    with pytest.raises(ConfigError, match="one of auto, native, torch"):
        get_engine("cuda")


@pytest.mark.parametrize("name", ENGINES)
@pytest.mark.parametrize(("start", "end", "embed", "head"), [(0, 2, True, True), (0, 1, True, False),
                                                             (1, 2, False, True)])
def test_the_bytes_an_engine_counts_are_the_bytes_its_shard_holds(gguf, name, start, end, embed, head):
    engine = get_engine(name)
    layers = LayerRange(start=start, end=end)
    shard = engine.load(gguf, layers, embed=embed, head=head)
    assert shard.engine == engine
    names = shard_tensor_names(gguf.config, layers, embed=embed, head=head)
    assert sum(engine.tensor_bytes(gguf, n) for n in names) == shard.nbytes


@pytest.mark.parametrize("name", ENGINES)
def test_the_planner_counts_a_stage_as_its_engine_holds_it(gguf, name):
    engine = get_engine(name)
    sizes = describe_model(gguf, engine, context=64)
    stage = engine.load(gguf, LayerRange(start=0, end=2), embed=False, head=True, lm_head=False)
    assert sum(sizes.layer_bytes) + sizes.norm_bytes == stage.nbytes
    whole = engine.load(gguf, LayerRange(start=0, end=0), embed=True, head=True)
    assert sizes.embed_bytes + sizes.head_bytes == whole.nbytes  # the leader's ends (untied: two tables)
    cache = stage.new_cache(64)
    held = sum(t.numel() * t.element_size() for t in (cache.k, cache.v))  # [layers, batch, kv_heads, 64, head_dim]
    assert sizes.kv_bytes_per_token * 64 * 2 == held


@pytest.mark.parametrize("name", ENGINES)
def test_each_engine_runs_a_draft_head_from_its_state(tiny_llama, name):
    """Engine.draft_net computes what the trainable DraftHead computes (the native engine within its Q8_0
    weights' rounding)."""
    cfg = open_source(tiny_llama).config
    ref = DraftHead(cfg).reset_parameters(seed=3, std=0.05).eval()
    net = get_engine(name).draft_net(cfg, ref.state_dict(), max_position=64)
    g = torch.Generator().manual_seed(1)
    feats, embeds = torch.randn(1, 5, cfg.hidden_size, generator=g), torch.randn(1, 5, cfg.hidden_size, generator=g)
    pos = torch.arange(5)[None]
    with torch.inference_mode():
        want = ref(feats, embeds, pos, ref.new_cache(8))
        got = net(feats, embeds, pos, net.new_cache(8))
    tol = 1e-6 if name == "torch" else 0.05 * want.abs().max().item()
    assert (got - want).abs().max().item() <= tol
    assert net.nbytes > 0


@needs_native
def test_auto_runs_a_model_the_native_engine_cannot_on_the_torch_engine(tiny_llama):
    """A float64 HF checkpoint has no native kernel: ``auto`` falls back (logged), ``native`` refuses."""
    src = open_source(tiny_llama)
    whole = LayerRange(start=0, end=src.config.num_layers)
    assert load_shard(src, whole, embed=True, head=True, engine="auto").engine.name == "torch"
    with pytest.raises(Exception, match="F16, BF16 and F32"):
        load_shard(src, whole, embed=True, head=True, engine="native")
