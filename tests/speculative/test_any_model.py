"""Speculation for a model no head was trained for: prompt lookup alone, and a head trained for another build (another
quantization) of the same model, accepted by architecture and a tolerance test, not by the exact bytes. The real
default model and its shipped head."""

from __future__ import annotations

import pytest
import torch

from flowspec_p2p.model.generate import ARDecoder, generate_ids
from flowspec_p2p.model.load import load_model
from flowspec_p2p.model.sampling import SamplingParams
from flowspec_p2p.speculative import head as head_module
from flowspec_p2p.speculative.decoder import MIN_AGREEMENT, PROBE_TEXT, SpecDecoder, load_drafter
from flowspec_p2p.speculative.drafter import TreeShape
from flowspec_p2p.speculative.head import DraftBundle, DraftHead, find_draft
from flowspec_p2p.speculative.ngram import LookupDrafter

from ..gguf_fixtures import requantized_copy


@pytest.fixture(scope="module")
def default():
    return load_model(None)


@pytest.fixture(scope="module")
def requantized(tmp_path_factory, default):
    return load_model(requantized_copy(default.source.path, tmp_path_factory.mktemp("req") / "q8.gguf"))


def test_a_head_trained_for_another_quantization_is_accepted(default, requantized):
    assert requantized.fingerprint() != default.fingerprint()  # other bytes: no exact match
    assert find_draft(requantized.fingerprint()) is None
    probe = requantized.tokenizer.encode(PROBE_TEXT)
    drafter, meta = load_drafter(requantized.shard, requantized.fingerprint(), None, probe)
    assert meta["match"] == "architecture"
    assert meta["agreement"] >= MIN_AGREEMENT
    assert meta["target_fingerprint"] == default.fingerprint()
    assert isinstance(drafter, LookupDrafter)
    assert drafter.base is not None
    # and it drafts for the requantized model: greedy output equal to AR on it, several tokens per forward
    ids = requantized.tokenizer.chat([{"role": "user", "content": "List the days of the week."}])
    ref, _ = generate_ids(ARDecoder(requantized.shard), ids, SamplingParams(), 48)
    got, stats = generate_ids(SpecDecoder(requantized.shard, drafter, TreeShape(total_tokens=8, depth=4, top_k=4)),
                              ids, SamplingParams(), 48)
    assert got == ref
    assert stats.tau > 1.5


def test_a_head_that_fails_the_tolerance_test_is_not_used(default, requantized, tmp_path, monkeypatch):
    """A head of the right architecture that does not predict this model (random weights): lookup alone."""
    torch.manual_seed(0)
    DraftBundle(DraftHead(default.shard.cfg), None, {"target_fingerprint": "0" * 32}).save(tmp_path / "random",
                                                                                        torch.float16)
    monkeypatch.setattr(head_module, "ASSETS", tmp_path)
    monkeypatch.setenv("FLOWSPEC_CACHE_DIR", str(tmp_path / "cache"))
    probe = requantized.tokenizer.encode(PROBE_TEXT)
    drafter, meta = load_drafter(requantized.shard, requantized.fingerprint(), None, probe)
    assert meta["match"] == "none"
    assert isinstance(drafter, LookupDrafter)
    assert drafter.base is None


def test_speculation_with_no_head_runs_on_prompt_lookup(default):
    """No head at all: the drafter proposes the prompt's continuation; output equals AR, and a reply that copies
    its prompt takes fewer target forwards than tokens."""
    tok = default.tokenizer
    text = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau"
    ids = tok.chat([{"role": "user", "content": f"Repeat exactly, three times: {text}"}])
    ref, _ = generate_ids(ARDecoder(default.shard), ids, SamplingParams(), 64)
    got, stats = generate_ids(SpecDecoder(default.shard, LookupDrafter(None), TreeShape(total_tokens=8, depth=6,
                                                                                        top_k=1)),
                              ids, SamplingParams(), 64)
    assert got == ref
    assert stats.steps < len(got) * 0.8
