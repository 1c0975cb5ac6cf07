"""Greedy decoding with the LM head's argmax taken inside the engine's call (Shard.greedy_tokens) against the same
decoders taking the argmax of the full logits, in one process on one loaded model: ar and spec decode tokens/s,
alternating, the order rotated per repeat; medians and the median of the paired ratios. Both sides must give the
same tokens (checked).

    python lab/greedy_argmax_ab.py --model gemma3-270m --threads 1 --repeats 9 --tokens 128
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics

import torch

from flowspec_p2p.bench import core
from flowspec_p2p.bench.engine import decode_sample
from flowspec_p2p.model.generate import ARDecoder, generate_ids
from flowspec_p2p.model.load import load_model, set_threads
from flowspec_p2p.model.sampling import SamplingParams
from flowspec_p2p.specbench import load_questions
from flowspec_p2p.speculative.decoder import SpecDecoder, load_drafter, tuned_tree

log = logging.getLogger("greedy_argmax_ab")


class FullLogits:
    """A shard whose greedy_tokens is the argmax of its full logits (the path before fs_matmul_argmax)."""

    def __init__(self, shard):
        self._shard = shard

    def __getattr__(self, name):
        return getattr(self._shard, name)

    def __call__(self, *args, **kwargs):
        return self._shard(*args, **kwargs)

    def greedy_tokens(self, features: torch.Tensor) -> torch.Tensor:
        return self._shard.logits(features).argmax(-1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--question", default="mt_bench:30")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    set_threads(args.threads)
    lm = load_model(args.model)
    name, _, line = args.question.partition(":")
    prompt = core.prompt_ids(lm.tokenizer, load_questions(None, [name], int(line), 1)[0].text)
    fingerprint = lm.fingerprint()
    drafter, _ = load_drafter(lm.shard, fingerprint)
    shape = tuned_tree(fingerprint)
    sides = {}
    for label, shard in (("argmax", lm.shard), ("full", FullLogits(lm.shard))):
        sides[f"ar-{label}"] = ARDecoder(shard)
        sides[f"spec-{label}"] = SpecDecoder(shard, drafter, shape)
    outs = {k: generate_ids(d, prompt, SamplingParams(), args.tokens + 1, frozenset())[0] for k, d in sides.items()}
    assert len({tuple(v) for v in outs.values()}) == 1, "the sides' tokens differ"
    names = list(sides)
    rates: dict[str, list[float]] = {k: [] for k in names}
    loads = []
    for r in range(args.repeats):
        for k in names[r % len(names):] + names[:r % len(names)]:
            rates[k].append(decode_sample(sides[k], prompt, args.tokens)["tokens_per_s"])
        loads.append(os.getloadavg()[0])
    for mode in ("ar", "spec"):
        a, f = rates[f"{mode}-argmax"], rates[f"{mode}-full"]
        log.info("%s: argmax %.1f tok/s, full logits %.1f tok/s (medians of %d), argmax / full %.3f (median of "
                 "paired ratios, lowest %.3f, highest %.3f)", mode, statistics.median(a), statistics.median(f),
                 len(a), statistics.median(x / y for x, y in zip(a, f, strict=True)),
                 min(x / y for x, y in zip(a, f, strict=True)), max(x / y for x, y in zip(a, f, strict=True)))
    log.info("load average (1 min) over the repeats: median %.2f, %.2f-%.2f", statistics.median(loads), min(loads),
             max(loads))


if __name__ == "__main__":
    main()
