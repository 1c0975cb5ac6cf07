"""``auto`` on one device: lossless whatever mix of speculative and AR steps it runs (greedy token for token, the
sampling law exactly), and it runs the kind of step that measures cheaper on this request."""

from __future__ import annotations

import time

import pytest
import torch

from flowspec_p2p.model.generate import ARDecoder, generate_ids
from flowspec_p2p.model.sampling import SamplingParams
from flowspec_p2p.spec.auto import AutoConfig, AutoDecoder
from flowspec_p2p.spec.drafter import HeadDrafter, OracleDrafter, TreeShape

from .test_decoder import PROMPTS, one_thread, toy  # noqa: F401 (fixtures)
from .test_drafter import random_head, tiny_target

SHAPE = TreeShape(total_tokens=8, depth=4, top_k=3)
FLIPPY = AutoConfig(probe_ar=1, probe_spec=1, recheck=2, max_recheck=4)  # switches kinds every few steps


class Slowed:
    """A whole-model shard whose one-token forwards (``ar``) or tree forwards (``tree``) take ``delay`` s more."""

    def __init__(self, shard, slow: str, delay: float = 0.01):
        self.shard, self.slow, self.delay = shard, slow, delay

    def __call__(self, ids, cache, positions=None, mask=None):
        tree = mask is not None
        if (tree and self.slow == "tree") or (not tree and self.slow == "ar" and ids.shape[1] == 1):
            time.sleep(self.delay)
        return self.shard(ids, cache, positions=positions, mask=mask)

    def __getattr__(self, name):
        return getattr(self.shard, name)


@pytest.mark.parametrize("kind", ["oracle", "random"])
def test_greedy_auto_equals_autoregressive_decoding_across_switches(tiny_llama, kind):
    target = tiny_target(tiny_llama)
    drafter = OracleDrafter(target) if kind == "oracle" else HeadDrafter(random_head(target), target)
    auto = AutoDecoder(target, drafter, SHAPE, cfg=FLIPPY)
    for prompt in PROMPTS:
        ref, _ = generate_ids(ARDecoder(target), prompt, SamplingParams(), 40)
        out, stats = generate_ids(auto, prompt, SamplingParams(), 40)
        assert out == ref
        a = stats.extra["auto"]
        assert a["ar_steps"] > 0
        assert a["spec_steps"] > 0
        assert a["switches"] >= 2


@pytest.mark.parametrize(("slow", "expect"), [("ar", "spec"), ("tree", "ar")])
def test_auto_runs_the_kind_of_step_that_measures_cheaper(tiny_llama, slow, expect):
    target = tiny_target(tiny_llama)
    model = Slowed(target, slow)
    auto = AutoDecoder(model, OracleDrafter(target), SHAPE)
    ref, _ = generate_ids(ARDecoder(target), PROMPTS[0], SamplingParams(), 96)
    out, stats = generate_ids(auto, PROMPTS[0], SamplingParams(), 96)
    assert out == ref
    a = stats.extra["auto"]
    assert a["chose"] == expect
    cheap, dear = ("spec_steps", "ar_steps") if expect == "spec" else ("ar_steps", "spec_steps")
    assert a[cheap] > a[dear]  # the other kinds only in their probes
    measured = [k for k, v in a["ms_per_token"].items() if v is not None]
    assert {"ar", "spec 8/4/3", "spec 4/3/1"} <= set(measured)  # AR, the given tree and the smaller one
    if expect == "ar":
        assert "spec 16/5/3" not in measured  # the larger tree only where speculation pays


def test_sampled_auto_follows_the_target_distribution(toy):  # noqa: F811 (the fixture)
    """The joint law of the first three reply tokens with AR and speculative steps interleaved (temperature 1.2,
    top-k 4) matches the target's, computed exactly; chi-square over 2000 replies."""
    import itertools

    import numpy as np
    from scipy.stats import chisquare

    from flowspec_p2p.model.sampling import target_probs

    prompt, vocab, draws = [1, 3, 0], 5, 2000
    params = SamplingParams(temperature=1.2, top_k=4)
    exact = np.zeros(vocab**3)
    with torch.inference_mode():
        for i, seq in enumerate(itertools.product(range(vocab), repeat=3)):
            probs = target_probs(toy.logits(toy(torch.tensor([prompt + list(seq[:2])]), None)[0]), params)
            n = len(prompt)
            exact[i] = float(probs[n - 1, seq[0]] * probs[n, seq[1]] * probs[n + 1, seq[2]])
    # first token from the prefill, the second from an AR step, the rest from a speculative one
    auto = AutoDecoder(toy, OracleDrafter(toy), TreeShape(total_tokens=8, depth=3, top_k=3),
                       cfg=AutoConfig(probe_ar=1, probe_spec=1))
    counts = np.zeros(vocab**3)
    for i in range(draws):
        out, _ = generate_ids(auto, prompt, params.model_copy(update={"seed": i}), 3)
        counts[(out[0] * vocab + out[1]) * vocab + out[2]] += 1
    expected = exact * draws
    assert counts[expected == 0].sum() == 0
    big, rare = expected >= 5, (expected > 0) & (expected < 5)
    obs, exp = counts[big], expected[big]
    if rare.any():
        obs, exp = np.append(obs, counts[rare].sum()), np.append(exp, expected[rare].sum())
    assert chisquare(obs, exp).pvalue > 1e-3


def test_seeded_sampled_auto_gives_ar_s_text_across_switches(tiny_llama):
    """Sampled tokens come from (seed, position) alone, so a seeded reply is the same text whatever mix of AR and
    speculative steps produced it."""
    target = tiny_target(tiny_llama)
    auto = AutoDecoder(target, HeadDrafter(random_head(target), target), SHAPE, cfg=FLIPPY)
    for i, prompt in enumerate(PROMPTS):
        params = SamplingParams(temperature=1.0, seed=100 + i)
        ref, _ = generate_ids(ARDecoder(target), prompt, params, 40)
        out, stats = generate_ids(auto, prompt, params, 40)
        assert out == ref
        assert stats.extra["auto"]["switches"] >= 2
