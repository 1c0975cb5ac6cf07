"""Public EAGLE heads load as published (eagle_fixtures.py writes them in exactly their formats): an EAGLE-1/2 head
(pytorch_model.bin or model.safetensors, Llama and Qwen2) computes what EAGLE's network computes and drafts on the
engine, in a cluster's leader too; an EAGLE-3 head (with its d2t/t2d draft vocabulary) computes EAGLE-3's network
over the states entering the target's tapped layers, which TappedTarget gives exactly; speculative decoding with
either is lossless; a head for another architecture is refused, an installed one is found by architecture and the
probe, and the cluster refuses an EAGLE-3 head with the reason."""

from __future__ import annotations

import pytest
import torch

from flowspec_p2p.errors import ConfigError, WeightsError
from flowspec_p2p.ledger import Ledger
from flowspec_p2p.model import native_shard
from flowspec_p2p.model.generate import ARDecoder, generate_ids, prefill_features
from flowspec_p2p.model.sampling import SamplingParams
from flowspec_p2p.model.torch_shard import TorchShard
from flowspec_p2p.model.weights import open_source
from flowspec_p2p.speculative import decoder as decoder_mod
from flowspec_p2p.speculative.decoder import SpecDecoder, load_drafter, load_spec
from flowspec_p2p.speculative.drafter import TreeShape
from flowspec_p2p.speculative.eagle import read_checkpoint
from flowspec_p2p.speculative.eagle3 import Eagle3Drafter, TappedTarget
from flowspec_p2p.types import LayerRange

from ..conftest import build_tiny_checkpoint, tiny_hf_config
from .eagle_fixtures import write_eagle1, write_eagle3
from .test_drafter import tiny_target

F64 = torch.float64
SHAPE = TreeShape(total_tokens=8, depth=3, top_k=2, lookup=0)
DRAFT_IDS = torch.tensor(sorted({3, 7, 11, 20, 33, 40, 52, 60, 71, 80, 88, 95} | set(range(0, 96, 5))))


@pytest.fixture(scope="module")
def tiny8(tmp_path_factory):
    """An 8-layer tiny llama: EAGLE-3 taps the states entering layers 2, 4 and 5."""
    folder = tmp_path_factory.mktemp("tiny8") / "llama8"
    build_tiny_checkpoint(folder, "llama", seed=3, num_hidden_layers=8)
    return folder


@pytest.fixture(scope="module")
def tiny8_f32(tmp_path_factory):
    """The same in float32 (the native engine reads 16- and 32-bit checkpoints)."""
    folder = tmp_path_factory.mktemp("tiny8") / "llama8-f32"
    build_tiny_checkpoint(folder, "llama", seed=3, dtype=torch.float32, num_hidden_layers=8)
    return folder


def _spec_equals_ar(target, drafter, prompt, n=20):
    ar, _ = generate_ids(ARDecoder(target), prompt, SamplingParams(), n, frozenset())
    ledger = Ledger(mode="spec")
    spec = [t for chunk in SpecDecoder(target, drafter, SHAPE)(prompt, SamplingParams(), n, frozenset(), ledger)
            for t in chunk]
    assert spec == ar
    return ledger


# ------------------------------------------------------------------------------------------------ EAGLE-1/2


@pytest.mark.parametrize(("kind", "fmt"), [("llama", "bin"), ("qwen2", "safetensors")])
def test_an_eagle1_head_loads_as_published_and_computes_eagles_network(tiny_checkpoints, tmp_path, kind, fmt):
    target = tiny_target(tiny_checkpoints[kind])
    ref = write_eagle1(tmp_path / "eagle", tiny_hf_config(kind), fmt=fmt)
    drafter, meta = load_drafter(target, "fp", tmp_path / "eagle")
    assert (meta["format"], meta["match"]) == ("eagle1", "given")
    net = drafter.base.head
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(1, 9, 64, generator=g, dtype=F64)
    embeds = target.embed(torch.randint(0, 96, (1, 9), generator=g))
    with torch.inference_mode():
        ours = net(feats, embeds, torch.arange(9)[None])
        theirs = ref(feats, embeds)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-10)
    assert read_checkpoint(tmp_path / "eagle").head.attention_bias == (kind == "qwen2")


def test_speculative_decoding_with_a_public_eagle1_head_is_lossless_also_on_a_leaders_head_shard(tiny_llama,
                                                                                                   tmp_path):
    target = tiny_target(tiny_llama)
    write_eagle1(tmp_path / "eagle", tiny_hf_config("llama"), seed=4)
    drafter, _ = load_drafter(target, "fp", tmp_path / "eagle")
    _spec_equals_ar(target, drafter, [1, 5, 9, 14, 30, 7])
    # a cluster's leader holds only the embedding and the head: the same head drafts from it
    src = open_source(tiny_llama)
    leader_head = TorchShard.from_source(src, LayerRange(start=0, end=0), embed=True, head=True, dtype=F64)
    on_leader, meta = load_drafter(leader_head, "fp", tmp_path / "eagle")
    assert meta["format"] == "eagle1"
    on_leader.reset(64)
    drafter.reset(64)
    prompt = [1, 5, 9, 14]
    feats = prefill_features(target, target.new_cache(8), prompt)
    for d in (drafter, on_leader):
        d.feed(prompt, feats, 22)
    assert drafter.draft(SHAPE).tokens.tolist() == on_leader.draft(SHAPE).tokens.tolist()


def test_a_head_for_another_model_is_refused_and_an_installed_one_is_found_by_architecture_and_probe(
        tiny_llama, tmp_path, monkeypatch):
    target = tiny_target(tiny_llama)
    write_eagle1(tmp_path / "wide", tiny_hf_config("llama", hidden_size=32, num_attention_heads=2))
    with pytest.raises(ConfigError, match="trained for another model: hidden size 32"):
        load_drafter(target, "fp", tmp_path / "wide")
    monkeypatch.setenv("FLOWSPEC_CACHE_DIR", str(tmp_path / "cache"))
    write_eagle1(tmp_path / "cache" / "drafts" / "EAGLE-tiny", tiny_hf_config("llama"))
    probe = list(range(3, 60))
    _, meta = load_drafter(target, "fp", None, probe)
    assert meta["match"] == "none"  # a random head fails the probe
    monkeypatch.setattr(decoder_mod, "MIN_AGREEMENT", 0.0)
    _, meta = load_drafter(target, "fp", None, probe)
    assert (meta["match"], meta["format"]) == ("architecture", "eagle1")
    assert meta["source"].endswith("EAGLE-tiny")


def test_a_pickle_that_is_more_than_tensors_is_refused(tmp_path, tiny_llama):
    write_eagle1(tmp_path / "eagle", tiny_hf_config("llama"))
    torch.save({"fc.weight": torch.zeros(2), "evil": ConfigError("x")}, tmp_path / "eagle" / "pytorch_model.bin")
    with pytest.raises(WeightsError, match="not a plain state dict"):
        read_checkpoint(tmp_path / "eagle")


# ------------------------------------------------------------------------------------------------ EAGLE-3


@pytest.mark.parametrize("fmt", ["bin", "safetensors"])
def test_an_eagle3_head_loads_with_its_draft_vocabulary_and_computes_eagle3s_network(tiny8, tmp_path, fmt):
    from transformers import AutoModelForCausalLM

    target = tiny_target(tiny8)
    ref = write_eagle3(tmp_path / "eagle3", tiny_hf_config("llama", num_hidden_layers=8), DRAFT_IDS, fmt=fmt)
    ckpt = read_checkpoint(tmp_path / "eagle3")
    assert ckpt.kind == "eagle3"
    assert ckpt.taps(8) == (2, 4, 5)
    tapped = TappedTarget.load(target, open_source(tiny8), ckpt.taps(8))
    drafter = Eagle3Drafter.from_checkpoint(ckpt, tapped, dtype=F64)
    assert drafter.table.tolist() == DRAFT_IDS.tolist()
    # the tapped states are transformers' hidden states entering layers 2, 4 and 5
    ids = torch.randint(3, 96, (1, 10), generator=torch.Generator().manual_seed(1))
    hf = AutoModelForCausalLM.from_pretrained(tiny8, dtype=F64).eval()
    with torch.inference_mode():
        wide = tapped(ids, tapped.new_cache(16))[0]  # [10, 4H]
        states = hf(ids, output_hidden_states=True).hidden_states
        torch.testing.assert_close(wide[:, 64:], torch.cat([states[2], states[4], states[5]], -1)[0], rtol=0,
                                   atol=1e-10)
        torch.testing.assert_close(tapped.logits(wide), target.logits(target(ids, target.new_cache(16))[0]), rtol=0,
                                   atol=1e-10)
        # the head's step, teacher-forced and then on its own output, and its logits over the draft vocabulary
        embeds = target.embed(torch.cat([ids[:, 1:], ids[:, :1]], 1))
        h = drafter.net(wide[None, :, 64:], embeds, torch.arange(10)[None], drafter.net.new_cache(16), fuse=True)
        theirs = ref.step(wide[None, :, 64:], embeds, fuse=True)
        torch.testing.assert_close(h, theirs, rtol=0, atol=1e-10)
        torch.testing.assert_close(drafter.net.logits(h), ref.logits(theirs), rtol=0, atol=1e-10)
        again = drafter.net(h, embeds, torch.arange(10)[None], drafter.net.new_cache(16))
        torch.testing.assert_close(again, ref.step(theirs, embeds, fuse=False), rtol=0, atol=1e-10)
    # a draft's root children are the reference's top draft ids, as target ids (id + d2t[id])
    drafter.reset(64)
    drafter.feed(ids[0].tolist(), wide, 9)
    tree = drafter.draft(TreeShape(total_tokens=3, depth=1, top_k=2, lookup=0))
    best = ref.logits(h[:, -1]).topk(2).indices[0]
    assert tree.tokens[1:].tolist() == DRAFT_IDS[best].tolist()


def test_speculative_decoding_with_a_public_eagle3_head_is_lossless(tiny8, tmp_path):
    target = tiny_target(tiny8)
    write_eagle3(tmp_path / "eagle3", tiny_hf_config("llama", num_hidden_layers=8), DRAFT_IDS, seed=5)
    tapped, drafter, meta = load_spec(target, open_source(tiny8), "fp", tmp_path / "eagle3")
    assert isinstance(tapped, TappedTarget)
    assert meta["format"] == "eagle3"
    ledger = _spec_equals_ar(tapped, drafter, [1, 5, 9, 14, 30, 7])
    assert ledger.draft_tokens > 0  # the head really drafted
    ar_whole, _ = generate_ids(ARDecoder(target), [1, 5, 9, 14, 30, 7], SamplingParams(), 20, frozenset())
    ar_tapped, _ = generate_ids(ARDecoder(tapped), [1, 5, 9, 14, 30, 7], SamplingParams(), 20, frozenset())
    assert ar_tapped == ar_whole  # the chain of pieces is the whole model


def test_eagle3_maps_that_disagree_are_refused_and_the_cluster_refuses_an_eagle3_head(tiny8, tmp_path):
    target = tiny_target(tiny8)
    ref = write_eagle3(tmp_path / "eagle3", tiny_hf_config("llama", num_hidden_layers=8), DRAFT_IDS)
    with pytest.raises(ConfigError, match=r"EAGLE-3 head.*one device"):
        load_drafter(target, "fp", tmp_path / "eagle3")
    bad = ref.published_state()
    bad["t2d"] = bad["t2d"].clone()
    bad["t2d"][int(DRAFT_IDS[0])] = False
    torch.save(bad, tmp_path / "eagle3" / "pytorch_model.bin")
    with pytest.raises(WeightsError, match="t2d and d2t disagree"):
        load_spec(target, open_source(tiny8), "fp", tmp_path / "eagle3")


def test_an_installed_eagle3_head_is_found_when_no_other_is(tiny8, tmp_path, monkeypatch):
    target = tiny_target(tiny8)
    monkeypatch.setenv("FLOWSPEC_CACHE_DIR", str(tmp_path / "cache"))
    write_eagle3(tmp_path / "cache" / "drafts" / "EAGLE3-tiny", tiny_hf_config("llama", num_hidden_layers=8),
                 DRAFT_IDS)
    probe = list(range(3, 60))
    model, _, meta = load_spec(target, open_source(tiny8), "fp", None, probe)
    assert (model, meta["match"]) == (target, "none"), meta  # a random head fails the probe
    monkeypatch.setattr(decoder_mod, "MIN_AGREEMENT", 0.0)
    model, _, meta = load_spec(target, open_source(tiny8), "fp", None, probe)
    assert isinstance(model, TappedTarget)
    assert (meta["match"], meta["format"]) == ("architecture", "eagle3")


@pytest.mark.skipif(not native_shard.available(), reason="the native engine can't be built here")
def test_eagle3_on_the_native_engine_taps_its_pieces_and_stays_lossless(tiny8_f32, tmp_path):
    from flowspec_p2p.model.native_shard import NativeShard

    src = open_source(tiny8_f32)
    target = NativeShard.from_source(src, LayerRange(start=0, end=8), embed=True, head=True)
    write_eagle3(tmp_path / "eagle3", tiny_hf_config("llama", num_hidden_layers=8), DRAFT_IDS, seed=5,
                 dtype=torch.float32)
    tapped, drafter, _ = load_spec(target, src, "fp", tmp_path / "eagle3")
    ids = torch.randint(3, 96, (1, 7), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        assert torch.equal(tapped(ids, tapped.new_cache(8))[0, :, :64], target(ids, target.new_cache(8))[0])
    _spec_equals_ar(tapped, drafter, [1, 5, 9, 14, 30, 7])
