"""A base model's prompt is raw text: the BOS token first where the model's tokenizer metadata says (GGUF
``tokenizer.ggml.add_bos_token``, HF ``add_bos_token``, else the tokenizer's own post-processor), and ``flowspec
generate`` continues PROMPT as plain text, with a note, when the model has no chat template."""

from __future__ import annotations

import argparse
import types

import pytest
import torch

from flowspec_p2p.commands import generate as generate_cmd
from flowspec_p2p.model import load as load_module
from flowspec_p2p.model.generate import ARDecoder, generate_ids
from flowspec_p2p.model.sampling import SamplingParams
from flowspec_p2p.model.tokenizer import _gguf_add_bos, is_base, user_prompt
from flowspec_p2p.model.torch_shard import TorchShard
from flowspec_p2p.model.weights import open_source
from flowspec_p2p.types import LayerRange

from ..ring_fixtures import word_tokenizer


@pytest.mark.parametrize(("post_bos", "add_bos", "expected"), [
    (True, None, [1, 7, 9]),  # no metadata: what the tokenizer's post-processor does
    (False, None, [7, 9]),
    (False, True, [1, 7, 9]),  # the metadata says
    (True, False, [7, 9]),
])
def test_a_raw_prompt_starts_with_bos_as_the_tokenizer_metadata_says(post_bos, add_bos, expected):
    tok = word_tokenizer(post_bos, add_bos)
    assert tok.encode_raw("w7 w9") == expected
    assert tok.encode_raw("<bos> w7 w9") == [1, 7, 9]  # never twice
    assert tok.encode("w7 w9") == [7, 9]


def test_the_gguf_add_bos_flag_is_read_from_the_file(tmp_path):
    import gguf

    for flag in (True, False, None):
        path = tmp_path / f"{flag}.gguf"
        w = gguf.GGUFWriter(str(path), "llama")
        if flag is not None:
            w.add_add_bos_token(flag)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        assert _gguf_add_bos(path) is flag


def _args(prompt: str, **kw) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    generate_cmd.register(parser.add_subparsers())
    return parser.parse_args(["generate", prompt, "--mode", "ar", "--max-tokens", "6", *kw.get("flags", [])])


@pytest.mark.parametrize("flags", [[], ["--raw"]])
def test_generate_continues_a_template_less_models_prompt_as_plain_text_with_bos(tiny_llama, monkeypatch, capsys,
                                                                                caplog, flags):
    src = open_source(tiny_llama)
    shard = TorchShard.from_source(src, LayerRange(start=0, end=4), embed=True, head=True, dtype=torch.float64)
    tok = word_tokenizer(post_bos=False, add_bos=True)  # a base model: no chat template
    source = types.SimpleNamespace(path=tiny_llama / "model.safetensors")
    monkeypatch.setattr(load_module, "load_model",
                        lambda *a, **k: types.SimpleNamespace(shard=shard, tokenizer=tok, source=source))
    assert generate_cmd.run(_args("w7 w9 w11", flags=flags)) == 0
    out = capsys.readouterr()
    ids, _ = generate_ids(ARDecoder(shard), [1, 7, 9, 11], SamplingParams(), 6, tok.stop_ids)
    assert out.out == tok.decode(ids) + "\n"
    assert ("no chat template" in caplog.text) == (not flags)  # the note, unless --raw asked for it


def test_generate_applies_the_chat_template_when_there_is_one(tiny_llama, monkeypatch, capsys, caplog):
    src = open_source(tiny_llama)
    shard = TorchShard.from_source(src, LayerRange(start=0, end=4), embed=True, head=True, dtype=torch.float64)
    tok = word_tokenizer(post_bos=False, add_bos=True, template="<bos> w5 {{ messages[0]['content'] }} w6")
    source = types.SimpleNamespace(path=tiny_llama / "model.safetensors")
    monkeypatch.setattr(load_module, "load_model",
                        lambda *a, **k: types.SimpleNamespace(shard=shard, tokenizer=tok, source=source))
    assert generate_cmd.run(_args("w7")) == 0
    out = capsys.readouterr()
    ids, _ = generate_ids(ARDecoder(shard), [1, 5, 7, 6], SamplingParams(), 6, tok.stop_ids)
    assert out.out == tok.decode(ids) + "\n"
    assert "no chat template" not in caplog.text


def test_a_user_prompt_is_templated_where_there_is_a_template_and_raw_elsewhere():
    base = word_tokenizer(post_bos=False, add_bos=True)
    chat = word_tokenizer(post_bos=False, add_bos=True, template="w5 {{ messages[0]['content'] }} w6")
    assert (is_base(base), is_base(chat)) == (True, False)
    assert user_prompt(base, "w7") == [1, 7]
    assert user_prompt(chat, "w7") == [5, 7, 6]
