"""The converted tokenizer's cache keeps BPE merges in their compact "a b" form (half the memory to load a large
vocabulary's), which tokenizes exactly as the [a, b] pairs did; merges with a space in a token stay pairs."""

from __future__ import annotations

import json

from flowspec_p2p.model.tokenizer import compact_merges


def _bpe(tmp_path, merges):
    import tokenizers
    from tokenizers import models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(["<unk>", "a", "b", "c", "ab", "abc", " ", "a "])}
    tok = tokenizers.Tokenizer(models.BPE(vocab, merges, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    data = json.loads(path.read_text())
    data["model"]["merges"] = [list(m) for m in merges]  # the pairs form transformers writes
    path.write_text(json.dumps(data))
    return path


def test_compact_merges_tokenize_as_the_pairs_did(tmp_path):
    import tokenizers

    path = _bpe(tmp_path, [("a", "b"), ("ab", "c")])
    before = tokenizers.Tokenizer.from_file(str(path)).encode("abc ab cab").ids
    assert compact_merges(path)
    assert json.loads(path.read_text())["model"]["merges"] == ["a b", "ab c"]
    assert tokenizers.Tokenizer.from_file(str(path)).encode("abc ab cab").ids == before
    assert not compact_merges(path)  # already compact


def test_merges_holding_a_space_stay_pairs(tmp_path):
    path = _bpe(tmp_path, [("a", " "), ("a", "b")])
    assert not compact_merges(path)
    assert json.loads(path.read_text())["model"]["merges"][0] == ["a", " "]
