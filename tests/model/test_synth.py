"""Synthetic GGUF models (model/synth.py): real shapes, block types and metadata, deterministic random weights that
load, dequantize to finite values of the intended size and run on the engine."""

import hashlib
import logging

import numpy as np
import pytest
import torch

from flowspec_p2p.errors import ConfigError
from flowspec_p2p.model import synth
from flowspec_p2p.model.load import load_shard
from flowspec_p2p.model.weights import open_source
from flowspec_p2p.types import LayerRange

TINY = dict(layers=2, hidden=256, intermediate=512, heads=4, kv_heads=2, head_dim=64, context=512)


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(name="tiny_synth", scope="module")
def tiny_synth_fixture(tmp_path_factory):
    out = tmp_path_factory.mktemp("synth") / "tiny.gguf"
    shape, label = synth.resolve_shape("llama-3.1-8b", None, **TINY)
    synth.write(out, shape, "Q4_K_M", label=label, progress=False)
    return out


def test_a_named_shape_keeps_its_architecture_and_given_dimensions_replace_its_own(tiny_synth):
    src = open_source(tiny_synth)
    c = src.config
    assert (c.arch, c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads) == (
        "llama", 2, 256, 512, 4, 2)
    assert c.rope_theta == 500000.0
    assert not c.tie_embeddings
    assert c.vocab_size == open_source(None).config.vocab_size  # the default model's tokenizer
    assert "rope_freqs.weight" in src.names()  # llama3 rope scaling, as llama.cpp bakes it
    assert synth.is_synthetic(src)
    assert not synth.is_synthetic(open_source(None))
    assert "synthetic" in src.metadata["general.name"]
    assert src.metadata["tokenizer.chat_template"] == open_source(None).metadata["tokenizer.chat_template"]


def test_q4_k_m_is_llama_cpps_mix_of_q4_k_and_q6_k(tiny_synth):
    src = open_source(tiny_synth)
    types = {t.name: t.qtype.name for t in src._tensors.values()}
    assert types["output.weight"] == "Q6_K"
    assert types["token_embd.weight"] == "Q4_K"
    for i in range(2):  # use_more_bits: with 2 layers, layer 1 (i >= 7n/8) gets 6 bits
        want = "Q6_K" if synth.use_more_bits(i, 2) else "Q4_K"
        assert types[f"blk.{i}.attn_v.weight"] == types[f"blk.{i}.ffn_down.weight"] == want
        assert types[f"blk.{i}.attn_q.weight"] == types[f"blk.{i}.ffn_up.weight"] == "Q4_K"
        assert types[f"blk.{i}.attn_norm.weight"] == "F32"
    assert [synth.use_more_bits(i, 32) for i in range(8)] == [True, True, True, True, False, False, True, False]


def test_weights_are_finite_with_the_intended_spread_and_norms_are_one(tiny_synth):
    src = open_source(tiny_synth)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight",
                 "model.embed_tokens.weight", "lm_head.weight"):
        w = src.load(name)
        assert torch.isfinite(w).all(), name
        std = float(w.std())
        assert 0.5 / w.shape[1] ** 0.5 < std < 2.0 / w.shape[1] ** 0.5, (name, std)
    assert torch.equal(src.load("model.layers.0.input_layernorm.weight"), torch.ones(256))


def test_the_same_arguments_give_the_same_bytes_and_another_seed_others(tmp_path, tiny_synth):
    shape, label = synth.resolve_shape("llama-3.1-8b", None, **TINY)
    again = tmp_path / "again.gguf"
    synth.write(again, shape, "Q4_K_M", label=label, progress=False)
    assert _sha(again) == _sha(tiny_synth)
    other = tmp_path / "other.gguf"
    synth.write(other, shape, "Q4_K_M", label=label, seed=1, progress=False)
    assert _sha(other) != _sha(tiny_synth)
    assert not list(tmp_path.glob("*.part"))


def test_it_streams_a_bounded_chunk_at_a_time(tmp_path, monkeypatch):
    monkeypatch.setattr(synth, "CHUNK_BYTES", 64 << 10)
    seen = []
    shape, _ = synth.resolve_shape(None, "qwen2", layers=1, hidden=256, intermediate=512, heads=4, kv_heads=2)
    total = synth.write(tmp_path / "q.gguf", shape, "Q8_0", progress=False, on_bytes=seen.append)
    assert max(seen) <= 64 << 10
    assert sum(seen) < total
    src = open_source(tmp_path / "q.gguf")
    assert src.config.arch == "qwen2"
    assert src.config.attention_bias
    assert torch.isfinite(src.load("model.layers.0.self_attn.q_proj.bias")).all()


def test_the_engine_runs_it_to_finite_logits(tiny_synth):
    src = open_source(tiny_synth)
    shard = load_shard(src, LayerRange(start=0, end=2), embed=True, head=True)
    cache = shard.new_cache(16)
    logits = shard.logits(shard(torch.tensor([[1, 2, 3, 4]]), cache))
    assert logits.shape[-1] == src.config.vocab_size
    assert torch.isfinite(logits).all()
    assert float(logits.std()) > 0.1  # not a constant: greedy decoding has a clear choice


def test_unknown_shapes_types_and_uneven_blocks_are_refused_with_the_reason(tmp_path):
    with pytest.raises(ConfigError, match=r"known: llama-3\.1-8b"):
        synth.resolve_shape("llama-9", None)
    with pytest.raises(ConfigError, match="--layers and --hidden"):
        synth.resolve_shape(None, "llama", layers=2)
    shape, _ = synth.resolve_shape(None, "llama", layers=1, hidden=320, heads=5, kv_heads=5)
    with pytest.raises(ConfigError, match="multiples of 256"):
        synth.write(tmp_path / "x.gguf", shape, "Q4_K_M", progress=False)
    with pytest.raises(ConfigError, match="unknown type"):
        synth.write(tmp_path / "x.gguf", shape, "Q3_K", progress=False)


def test_shapes_by_name_have_the_real_models_sizes():
    s = synth.SHAPES["llama-3.1-8b"]
    size = synth.expected_size(s, "Q4_K_M")
    assert 4.3e9 < size < 4.8e9  # Llama-3.1-8B Q4_K_M is 4.9 GB with its 128k vocabulary; ours has the default's
    assert synth.SHAPES["qwen2.5-7b"].bias
    assert synth.SHAPES["llama-3.2-1b"].tied
    np.testing.assert_allclose(synth.llama3_rope_factors(s)[[0, -1]], [1.0, 8.0])


def test_generate_warns_that_a_synthetic_models_text_is_meaningless(tiny_synth, monkeypatch, caplog):
    from types import SimpleNamespace

    from flowspec_p2p.cli import build_parser
    from flowspec_p2p.model import load

    class Stop(Exception):
        pass

    def chat(messages):
        raise Stop  # the warning came before the prompt: enough

    fake = SimpleNamespace(source=open_source(tiny_synth), tokenizer=SimpleNamespace(chat=chat))
    monkeypatch.setattr(load, "load_model", lambda *a, **kw: fake)
    args = build_parser().parse_args(["generate", "--model", str(tiny_synth), "--mode", "ar", "hi"])
    with caplog.at_level(logging.WARNING), pytest.raises(Stop):
        args.func(args)
    assert "synthetic model" in caplog.text
    assert "meaningless" in caplog.text
