"""DraftBundle: float16 file, restored dtype, draft vocabulary, lookup by target fingerprint."""

from __future__ import annotations

import json

import pytest
import torch

from flowspec_p2p.model.weights import open_source
from flowspec_p2p.speculative.head import DraftBundle, DraftHead, find_draft


@pytest.fixture(scope="module")
def cfg(tiny_llama):
    return open_source(tiny_llama).config


@pytest.mark.parametrize("vocab", [None, torch.tensor([3, 7, 11, 40])])
def test_bundle_round_trip_in_float16_restores_the_asked_dtype(cfg, tmp_path, vocab):
    head = DraftHead(cfg).reset_parameters(seed=1, std=0.1)
    DraftBundle(head, vocab, {"target_fingerprint": "fp", "steps": 3}).save(tmp_path / "h", dtype=torch.float16)
    assert (tmp_path / "h.safetensors").stat().st_size < 2.2 * sum(p.numel() for p in head.parameters()) + 4096
    back = DraftBundle.load(tmp_path / "h", dtype=torch.float64)
    assert back.head.fc.weight.dtype == torch.float64
    assert back.meta["steps"] == 3
    assert back.meta["weights_dtype"] == "float16"
    if vocab is None:
        assert back.draft_vocab is None
    else:
        assert back.draft_vocab.dtype == torch.int64
        assert torch.equal(back.draft_vocab, vocab)
    for a, b in zip(head.state_dict().values(), back.head.state_dict().values(), strict=True):
        torch.testing.assert_close(b, a.half().double())


def test_find_draft_matches_the_fingerprint_only(cfg, tmp_path):
    DraftBundle(DraftHead(cfg), None, {"target_fingerprint": "aaa"}).save(tmp_path / "one")
    DraftBundle(DraftHead(cfg), None, {"target_fingerprint": "bbb"}).save(tmp_path / "two")
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "orphan.json").write_text(json.dumps({"target_fingerprint": "ccc"}))  # no weights file
    assert find_draft("bbb", [tmp_path]) == tmp_path / "two"
    assert find_draft("aaa", [tmp_path / "missing", tmp_path]) == tmp_path / "one"
    assert find_draft("ccc", [tmp_path]) is None


def test_a_new_head_is_initialised_not_left_uninitialised(cfg):
    a, b = DraftHead(cfg), DraftHead(cfg)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.isfinite(p).all()
        assert torch.equal(p, q)  # deterministic default init
