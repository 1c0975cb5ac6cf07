"""Teacher-forced ShareGPT data: the recorded answer goes through the target once; features and cut are right."""

from __future__ import annotations

import json
import zlib
from types import SimpleNamespace

import torch

from flowspec_p2p.model.torch_shard import TorchShard
from flowspec_p2p.model.weights import open_source
from flowspec_p2p.train import data as data_mod
from flowspec_p2p.train.data import FIXED_TEMPERATURE, DataConfig, teacher_forced_data
from flowspec_p2p.train.prompts import Prompt, save_pool
from flowspec_p2p.types import LayerRange

STOP = 2


class ByteChat:
    """A toy chat tokenizer: bytes + 3, turns wrapped in [5] ... [STOP, 10] (10 = newline after the stop)."""

    stop_ids = frozenset({STOP})

    def encode(self, text: str) -> list[int]:
        return [int(b) % 90 + 3 for b in text.encode()]

    def chat(self, messages) -> list[int]:
        return self.encode(self.render(messages))

    def render(self, messages, add_generation_prompt: bool = True) -> str:
        out = "".join(f"<{m['role']}>{m['content']}|" for m in messages)
        return out + ("<assistant>" if add_generation_prompt else "")


def test_teacher_forced_conversations_hold_the_targets_features_and_stop_at_the_answers_end(tiny_llama, tmp_path,
                                                                                             monkeypatch):
    src = open_source(tiny_llama)
    shard = TorchShard.from_source(src, LayerRange(start=0, end=src.config.num_layers), embed=True, head=True,
                              dtype=torch.float64).eval()
    tok = ByteChat()
    tok.encode = lambda text, enc=tok.encode: [STOP if t == ord("|") % 90 + 3 else t for t in enc(text)]
    convs = [{"id": "a", "conversations": [{"from": "human", "value": "hi there"}, {"from": "gpt", "value": "yo"}]},
             {"id": "b", "conversations": [{"from": "human", "value": "why?"}, {"from": "gpt", "value": "x" * 40}]}]
    sg = tmp_path / "sg.json"
    sg.write_text(json.dumps(convs))
    monkeypatch.setattr(data_mod, "sharegpt_path", lambda: sg)
    run = tmp_path / "run"
    save_pool([Prompt("sharegpt:a", "qa", "hi there"), Prompt("math:0", "math", "1+1?"),
               Prompt("sharegpt:b", "qa", "why?")], run / "pool.jsonl")
    lm = SimpleNamespace(shard=shard, tokenizer=tok, fingerprint=lambda: "fp")
    store = teacher_forced_data(DataConfig(run_dir=run, max_new_tokens=10), lm, progress=False)
    got = {c.key: c for c in store.iter_conversations()}
    assert set(got) == {"sharegpt:a", "sharegpt:b"}
    a = got["sharegpt:a"]
    prompt = tok.chat([{"role": "user", "content": "hi there"}])
    assert a.prompt_len == len(prompt)
    assert a.tokens.tolist()[: len(prompt)] == prompt
    assert a.tokens.tolist()[len(prompt) :] == [*tok.encode("yo"), STOP]  # cut after the stop id
    assert a.temperature == FIXED_TEMPERATURE
    assert store.manifest["seconds"] > 0  # the time spent, which draft train --minutes counts on resume
    full = shard(a.tokens[None, :-1], None)[0]  # [T - 1, hidden]
    torch.testing.assert_close(a.features.double(), full, atol=2e-3, rtol=2e-3)
    assert len(got["sharegpt:b"].tokens) == len(tok.chat([{"role": "user", "content": "why?"}])) + 10
    again = teacher_forced_data(DataConfig(run_dir=run, max_new_tokens=10), lm, progress=False)  # resumes: no-op
    assert again.conversations == 2
    # --skip-prompts: a second process (another run folder, the same pool) answers another part of the pool
    (tmp_path / "part").mkdir()
    (tmp_path / "part" / "pool.jsonl").symlink_to(run / "pool.jsonl")
    part = teacher_forced_data(DataConfig(run_dir=tmp_path / "part", max_new_tokens=10, skip_prompts=1), lm,
                               progress=False)
    assert [c.key for c in part.iter_conversations()] == ["sharegpt:b"]
    # --max-minutes: a spent budget stops after the conversation in hand, keeping it
    (tmp_path / "timed").mkdir()
    (tmp_path / "timed" / "pool.jsonl").symlink_to(run / "pool.jsonl")
    timed = teacher_forced_data(DataConfig(run_dir=tmp_path / "timed", max_new_tokens=10, max_seconds=1e-6), lm,
                                progress=False)
    assert timed.conversations == 1


def test_held_out_conversations_include_greedy_ones():
    """The T=1 share of self-distillation is hashed apart from the held-out split: held-out conversations come
    at both temperatures (chain acceptance is measured on the greedy ones), each near its share."""
    from flowspec_p2p.train.corpus import HELDOUT_PER_MILLE

    keys = [f"sharegpt:{i}" for i in range(20000)]
    held = [k for k in keys if zlib.crc32(k.encode()) % 1000 < HELDOUT_PER_MILLE]
    sampled = [data_mod._temperature(k, 0.2) for k in held]
    assert 0.15 < sum(sampled) / len(held) < 0.25
    assert 0.15 < sum(data_mod._temperature(k, 0.2) for k in keys) / len(keys) < 0.25
