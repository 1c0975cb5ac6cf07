"""``auto`` on one device: lossless whatever mix of speculative and AR steps it runs (greedy token for token, the
sampling law exactly), and it runs the kind of step that measures cheaper on this request."""

from __future__ import annotations

import time

import pytest

from flowspec_p2p.model.generate import ARDecoder, generate_ids
from flowspec_p2p.model.sampling import SamplingParams
from flowspec_p2p.speculative.auto import AutoConfig, AutoDecoder
from flowspec_p2p.speculative.drafter import HeadDrafter, OracleDrafter, TreeShape

from .test_decoder import PROMPTS, assert_follows_the_target, one_thread, toy  # noqa: F401 (fixtures)
from .test_drafter import random_head, tiny_target

SHAPE = TreeShape(total_tokens=8, depth=4, top_k=3)
FLIPPY = AutoConfig(probe_ar=1, probe_spec=1, recheck=2, max_recheck=4)  # switches kinds every few steps


class Slowed:
    """A whole-model shard whose one-token forwards (``ar``) or tree forwards (``tree``) take ``delay`` s more."""

    def __init__(self, shard, slow: str, delay: float = 0.1):  # >> a tiny model's forward, preempted or not
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
    assert {"ar", "spec 8/4/3"} <= set(measured)  # AR and the given tree, always
    if expect == "spec":
        assert "spec 4/3/1" in measured  # the smaller tree where the given one nearly pays
    else:
        assert "spec 16/5/3" not in measured  # the larger tree only where speculation pays


def test_sampled_auto_follows_the_target_distribution(toy):  # noqa: F811 (the fixture)
    """The joint law of the first three reply tokens with AR and speculative steps interleaved (temperature 1.2,
    top-k 4) matches the target's, computed exactly; chi-square over 2000 replies."""
    # first token from the prefill, the second from an AR step, the rest from a speculative one
    auto = AutoDecoder(toy, OracleDrafter(toy), TreeShape(total_tokens=8, depth=3, top_k=3),
                       cfg=AutoConfig(probe_ar=1, probe_spec=1))
    assert_follows_the_target(toy, auto, [1, 3, 0], SamplingParams(temperature=1.2, top_k=4))


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


class _Whole:
    """Enough of a whole-model shard to build a decoder."""

    has_embed = has_head = True
    max_position = 64


def test_the_smallest_tree_has_no_smaller_variant_and_the_larger_keeps_its_role():
    from flowspec_p2p.speculative.auto import tree_variants

    tiny = TreeShape(total_tokens=2, depth=1, top_k=1)
    assert list(tree_variants(tiny)) == ["given", "larger"]
    auto = AutoDecoder(_Whole(), None, tiny)
    assert (auto.smaller, auto.larger) == (None, 2)  # kind 2 is the larger tree, never probed as the smaller


def test_the_larger_variant_of_a_chain_branches():
    from flowspec_p2p.speculative.auto import tree_variants

    large = tree_variants(TreeShape(total_tokens=2, depth=1, top_k=1, lookup=4))["larger"]
    assert (large.total_tokens, large.depth, large.top_k, large.lookup) == (4, 2, 2, 4)
