"""Feature store: round trip, resume after a restart, and a half-written shard never counts."""

from __future__ import annotations

import torch

from flowspec_p2p.train.batchgen import Finished
from flowspec_p2p.train.store import FeatureStore


def _item(key: str, p: int, a: int, hidden: int = 8) -> Finished:
    tokens = torch.randint(0, 50, (p + a,)).tolist()
    feats = torch.randn(p + a - 1, hidden).to(torch.float16)
    return Finished(key, p, tokens, feats, 0.0 if a % 2 else 1.0, "stop")


def test_store_round_trip(tmp_path):
    store = FeatureStore(tmp_path, hidden=8, target_fingerprint="fp")
    items = [_item(f"k{i}", 3 + i, 2 + i) for i in range(5)]
    for it in items[:3]:
        store.add(it)
    store.flush()
    for it in items[3:]:
        store.add(it)
    store.flush()
    again = FeatureStore(tmp_path, hidden=8, target_fingerprint="fp")
    got = list(again.iter_conversations())
    assert [c.key for c in got] == [it.key for it in items]
    for c, it in zip(got, items, strict=True):
        assert c.tokens.tolist() == it.tokens
        assert c.prompt_len == it.prompt_len
        assert c.temperature == it.temperature
        assert torch.equal(c.features, it.features)
    assert again.conversations == 5
    assert again.tokens == sum(len(it.tokens) for it in items)


def test_restart_skips_stored_keys_and_ignores_unlisted_shards(tmp_path):
    store = FeatureStore(tmp_path, hidden=8, target_fingerprint="fp")
    store.add(_item("a", 4, 3))
    store.flush()
    store.add(_item("b", 4, 3))  # pending when the job is killed: lost, never listed
    (tmp_path / "shard-00001.safetensors").write_bytes(b"half-written")
    again = FeatureStore(tmp_path, hidden=8, target_fingerprint="fp")
    assert again.done_keys() == {"a"}
    again.add(_item("b", 5, 2))
    again.flush()  # overwrites the unlisted file
    assert [c.key for c in FeatureStore(tmp_path).iter_conversations()] == ["a", "b"]


def test_store_refuses_features_of_another_target(tmp_path):
    import pytest

    from flowspec_p2p.errors import ConfigError

    store = FeatureStore(tmp_path, hidden=8, target_fingerprint="fp")
    store.add(_item("a", 2, 2))
    store.flush()
    with pytest.raises(ConfigError):
        FeatureStore(tmp_path, hidden=8, target_fingerprint="other")
