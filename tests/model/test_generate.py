"""Single-device generation: greedy equals transformers' ``generate``; sampling, stopping, streaming text."""

from __future__ import annotations

import pytest
import torch

from flowspec_p2p.errors import ContextOverflow
from flowspec_p2p.ledger import Ledger
from flowspec_p2p.model.generate import ARDecoder, generate_ids, stream_text
from flowspec_p2p.model.sampling import SamplingParams, choose, target_probs
from flowspec_p2p.model.tokenizer import Detokenizer
from flowspec_p2p.model.torch_shard import TorchShard
from flowspec_p2p.model.weights import open_source
from flowspec_p2p.types import LayerRange

from ..conftest import TINY_ARCHS

GREEDY = SamplingParams()


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models gain nothing from a second thread, and lose milliseconds per op when the cores are shared."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _shard(folder, dtype=torch.float64) -> TorchShard:
    src = open_source(folder)
    whole = LayerRange(start=0, end=src.config.num_layers)
    return TorchShard.from_source(src, whole, embed=True, head=True, dtype=dtype).eval()


@pytest.fixture(scope="module")
def decoder(tiny_llama) -> ARDecoder:
    return ARDecoder(_shard(tiny_llama))


def _prompt(n: int = 7, seed: int = 0) -> list[int]:
    return torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_greedy(model, prompt: list[int], n: int, eos: list[int] | None = None) -> list[int]:
    model.generation_config.eos_token_id = eos
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


# ---------------------------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("kind", TINY_ARCHS)
def test_greedy_equals_transformers_generate_in_float64(tiny_checkpoints, kind):
    from transformers import AutoModelForCausalLM

    folder = tiny_checkpoints[kind]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64, attn_implementation="sdpa").eval()
    ours = ARDecoder(_shard(folder))
    for seed in (0, 1):
        prompt = _prompt(5 + 4 * seed, seed)
        with torch.inference_mode():
            ref = _hf_greedy(hf, prompt, 24)
        ids, _ = generate_ids(ours, prompt, GREEDY, 24)
        assert ids == ref


def test_max_tokens_is_exact_and_every_token_is_one_step(decoder):
    ids, stats = generate_ids(decoder, _prompt(), GREEDY, 17)
    assert len(ids) == stats.new_tokens == stats.steps == 17
    assert stats.tau == 1.0
    assert stats.prompt_tokens == 7
    assert generate_ids(decoder, _prompt(), GREEDY, 1)[0] == ids[:1]
    assert generate_ids(decoder, _prompt(), GREEDY, 0)[0] == []


def test_eos_stops_and_is_yielded_and_counted(decoder):
    ids, _ = generate_ids(decoder, _prompt(), GREEDY, 24)
    k = next(i for i, t in enumerate(ids) if i > 0 and t not in ids[:i])  # a token that first appears at i > 0
    stopped, stats = generate_ids(decoder, _prompt(), GREEDY, 24, stop_ids=frozenset({ids[k]}))
    assert stopped == ids[: k + 1]
    assert stats.new_tokens == stats.steps == k + 1


def test_context_limit_clamps_max_tokens_and_rejects_prompts_that_do_not_fit(tiny_llama):
    short = ARDecoder(_shard(tiny_llama), max_context=20)
    ids, _ = generate_ids(short, _prompt(15), GREEDY, 100)
    assert len(ids) == 5
    with pytest.raises(ContextOverflow, match="context limit is 20"):
        generate_ids(short, _prompt(20), GREEDY, 4)
    with pytest.raises(ContextOverflow, match="empty"):
        generate_ids(short, [], GREEDY, 4)
    whole = ARDecoder(short.model)  # the model's own limit (512 positions)
    with pytest.raises(ContextOverflow):
        generate_ids(whole, _prompt(600), GREEDY, 4)


# -------------------------------------------------------------------------------------------- sampling


def test_sampling_is_reproducible_with_a_seed(decoder):
    hot = SamplingParams(temperature=1.5, seed=7)
    a, _ = generate_ids(decoder, _prompt(), hot, 24)
    b, _ = generate_ids(decoder, _prompt(), hot, 24)
    c, _ = generate_ids(decoder, _prompt(), SamplingParams(temperature=1.5, seed=8), 24)
    assert a == b
    assert a != c


def test_top_k_1_and_a_tiny_top_p_equal_greedy(decoder):
    greedy, _ = generate_ids(decoder, _prompt(), GREEDY, 16)
    for params in (SamplingParams(temperature=0.8, top_k=1, seed=1), SamplingParams(temperature=2.0, top_p=1e-6)):
        assert generate_ids(decoder, _prompt(), params, 16)[0] == greedy


def test_target_probs_by_hand():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    e = torch.tensor([2.0, 1.0], dtype=torch.float64).exp()
    top2 = torch.cat([e / e.sum(), torch.zeros(2, dtype=torch.float64)])
    # softmax = [0.644, 0.237, 0.087, 0.032]: mass 0.7 needs the first two tokens
    assert torch.allclose(target_probs(logits, SamplingParams(temperature=1.0, top_k=2)), top2, atol=1e-15)
    assert torch.allclose(target_probs(logits, SamplingParams(temperature=1.0, top_p=0.7)), top2, atol=1e-15)
    hot = target_probs(logits, SamplingParams(temperature=2.0))
    assert torch.allclose(hot, (logits.double() / 2).softmax(-1), atol=1e-15)
    assert hot.dtype == torch.float64


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 9, 0.6)]
)
def test_target_probs_equal_transformers_warpers(temperature, top_k, top_p):
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 3  # [4, vocab]
    ref = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        ref = TopKLogitsWarper(top_k)(None, ref)
    if top_p < 1.0:
        ref = TopPLogitsWarper(top_p)(None, ref)
    ours = target_probs(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
    assert torch.allclose(ours, ref.softmax(-1), atol=1e-14, rtol=0)


def test_choose_samples_the_target_distribution():
    from scipy.stats import chisquare

    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -3.0, -4.0])
    params = SamplingParams(temperature=0.9, top_k=4, seed=0)
    gen = params.generator()
    counts = torch.bincount(torch.tensor([choose(logits, params, gen) for _ in range(4000)]), minlength=6)
    probs = target_probs(logits, params)
    assert counts[4:].sum() == 0  # outside the top 4: never
    assert chisquare(counts[:4].double().numpy(), (probs[:4] * 4000).numpy()).pvalue > 1e-3


# ----------------------------------------------------------------------------------------- text layer


class ByteTokenizer:
    """Token id = one byte; decoding replaces incomplete UTF-8 with U+FFFD, as byte-level BPE tokenizers do."""

    def decode(self, ids) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def _bytes(text: str) -> list[list[int]]:
    return [[b] for b in text.encode()]


def _deltas(text: str, stops=()) -> list[str]:
    return [d.text for d in stream_text(iter(_bytes(text)), ByteTokenizer(), stops)]  # type: ignore[arg-type]


def test_stream_text_cuts_at_the_first_stop_string():
    deltas = _deltas("Hello world. END and more", stops=("END", "more"))
    assert "".join(deltas) == "Hello world. "


def test_a_partial_stop_string_is_held_back_until_it_resolves():
    detok = Detokenizer(ByteTokenizer(), ("STOP",))  # type: ignore[arg-type]
    out = [detok.push(ids) for ids in _bytes("ab ST")]
    assert "".join(out) == "ab "  # "ST" could begin "STOP"
    assert detok.push(_bytes("x")[0]) == "STx"  # ... it did not
    assert detok.push(_bytes("S")[0]) == ""
    assert detok.flush() == "S"  # the end came first: release what was held
    assert "".join(_deltas("ab STOP", ("STOP",))) == "ab "


def test_incomplete_utf8_is_never_emitted():
    detok = Detokenizer(ByteTokenizer())  # type: ignore[arg-type]
    chunks = _bytes("né€")  # é is 2 bytes, € is 3
    out = [detok.push(ids) for ids in chunks]
    assert out == ["n", "", "é", "", "", "€"]
    assert "\ufffd" not in "".join(out)


def test_stream_text_closes_the_decoder_at_a_stop_string():
    closed = []

    def chunks():
        try:
            while True:
                yield from _bytes("abc.")
        finally:
            closed.append(True)

    deltas = list(stream_text(chunks(), ByteTokenizer(), ("c.a",)))  # type: ignore[arg-type]
    assert "".join(d.text for d in deltas) == "ab"
    assert closed == [True]


# ------------------------------------------------------------------------------------------ real model


def _hf_twin(lm):
    """transformers' Llama built from the very tensors our loader read (that loader is checked against
    transformers' own GGUF reader by test_shard; here the subject is the decoding loop, and building the
    model this way takes seconds instead of the ~30 s of transformers' GGUF parsing)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c = lm.source.config
    hf_cfg = LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, rms_norm_eps=c.rms_eps, max_position_embeddings=c.max_position,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta}, tie_word_embeddings=c.tie_embeddings,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(hf_cfg)
    state = {n: lm.source.load(n) for n in lm.source.names()}
    model.load_state_dict(state, strict=False, assign=True)
    if c.tie_embeddings:
        model.tie_weights()
    model.model.rotary_emb = type(model.model.rotary_emb)(hf_cfg)  # rebuild the (meta) rotary buffers
    return model.eval()


@pytest.mark.slow
def test_default_model_greedy_equals_transformers_and_stops_on_strings(default_model):
    lm = default_model
    tok = lm.tokenizer
    hf = _hf_twin(lm)
    ours = ARDecoder(lm.shard)
    prompts = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]
    for text in prompts:
        prompt = tok.chat([{"role": "user", "content": text}])
        ids, _ = generate_ids(ours, prompt, GREEDY, 32, tok.stop_ids)
        with torch.inference_mode():
            ref = _hf_greedy(hf, prompt, 32, eos=sorted(tok.stop_ids))
        assert ids == ref, text
    # the text layer on the real tokenizer: a stop string taken from the reply cuts it just before
    reply = tok.decode(ids)
    stop = reply.split()[2]
    stats = Ledger(mode="ar")
    streamed = "".join(d.text for d in stream_text(ours(prompt, GREEDY, 32, tok.stop_ids, stats), tok, [stop]))
    assert streamed == reply[: reply.index(stop)]
    assert stats.new_tokens < len(ids)
