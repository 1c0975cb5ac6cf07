"""Our engine on one device against llama.cpp on the same GGUF: ``flowspec bench-engine``.

    decode   greedy decode tokens/s, prefill excluded: our AR (``ARDecoder``) and speculative (``SpecDecoder``, the
             default tree) decoders in this process, and llama-bench's tg-N at a depth of the prompt's length (so
             both decode the same positions); EOS is ignored on both sides, so every run decodes exactly N tokens
    rows     the cost of an n-row forward relative to one row, after the prompt as context: ours is one stage
             forward of every layer with a draft-tree mask (a ``TREE_FANOUT``-ary tree of n nodes), alone and
             followed by the LM head on the last row (what llama-bench's pp-n computes) or on every row (a
             verification that scores every node); llama.cpp's is pp-n at the same depth
    memory   peak RSS of fresh processes: ``flowspec generate`` (ar, spec), llama-bench's tg-N, llama-cli decoding
             the same N tokens, and the runtime baseline (python importing torch, transformers and this package)

Interleaved: every repeat runs each thread count and, within it, each side in an order rotated by the repeat;
figures are medians over the repeats (ratios: medians of the ratios paired within a repeat). Timing rule
(docs/TEAM.md): only ratios of measurements taken side by side in one run, and medians.
"""

from __future__ import annotations

import datetime
import logging
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from ..ledger import Ledger, extra_stats
from ..model.generate import ARDecoder, prefill_features
from ..model.load import LoadedModel, set_threads
from ..model.sampling import SamplingParams
from ..model.tokenizer import is_base
from ..speculative.decoder import SpecDecoder
from ..speculative.drafter import Drafter, TreeShape
from ..speculative.tree import DraftTree
from . import ENGINE_PARTS, core, llamacpp
from .paths import portable_command, portable_path

log = logging.getLogger(__name__)

PARTS = ENGINE_PARTS
TREE_FANOUT = 4  # children per node of the row test's tree (an EAGLE-2 tree's usual width)
ROW_PASSES = 3  # passes over every n per repeat (llama-bench: -r ROW_PASSES); one forward is a few ms
WARMUP_TOKENS = 16
GREEDY = SamplingParams()
BASELINE_CODE = "import torch, transformers, flowspec_p2p"
ROW_ENGINES = ("ours-layers", "ours-head-last", "ours-head-all", "llama.cpp")


@dataclass(frozen=True)
class EngineBenchConfig:
    model: Path  # the GGUF file both sides run
    threads: tuple[int, ...]
    repeats: int
    tokens: int  # decoded tokens per run, the first one after the prefill not counted
    prompt: str  # the user message (chat template applied on our side and llama-cli's)
    prompt_label: str  # where it came from: "--prompt" or "<set>:<line>" of Spec-Bench
    rows: tuple[int, ...]
    parts: tuple[str, ...] = PARTS
    llama_bench: Path | None = None
    draft: str | None = None
    progress: bool = True
    python: str = field(default=sys.executable)

    def __post_init__(self):
        assert min(self.threads, default=0) >= 1, self.threads
        assert min(self.repeats, self.tokens) >= 1, (self.repeats, self.tokens)
        assert min(self.rows, default=0) >= 1, self.rows
        assert set(self.parts) <= set(PARTS), self.parts


@dataclass
class Ours:
    """Our decoders over one loaded model, and the prompt's ids."""

    lm: LoadedModel
    prompt_ids: list[int]  # the chat-templated prompt (raw for a model without a template)
    decoders: dict[str, ARDecoder | SpecDecoder]  # "ours-ar", and "ours-spec" where a draft head was given
    shape: TreeShape | None  # the speculative decoder's tree

    @classmethod
    def build(cls, lm: LoadedModel, prompt: str, drafter: Drafter | None, shape: TreeShape) -> Ours:
        ids = core.prompt_ids(lm.tokenizer, prompt)
        decoders: dict[str, ARDecoder | SpecDecoder] = {"ours-ar": ARDecoder(lm.shard)}
        if drafter is not None:
            decoders["ours-spec"] = SpecDecoder(lm.shard, drafter, shape)
        return cls(lm, ids, decoders, shape if drafter is not None else None)


def decode_sample(decoder, prompt_ids: Sequence[int], tokens: int) -> dict:
    """One greedy run decoding exactly ``tokens`` tokens after the prefill's (no stop ids, like llama-bench)."""
    ledger = Ledger(mode=decoder.mode)
    for _ in decoder(list(prompt_ids), GREEDY, tokens + 1, frozenset(), ledger):
        pass
    decoded = ledger.new_tokens - 1
    out = {"tokens_per_s": decoded / ledger.decode_s, "tau": round(ledger.tau, 4), "decoded": decoded}
    if (share := extra_stats(ledger).get("draft_share")) is not None:
        out["draft_share"] = share  # the part of the decode time spent drafting (spec)
    return out


def tree_inputs(n: int, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions [1, n] and mask [1, n, context + n] of an n-node ``TREE_FANOUT``-ary draft tree after
    ``context`` committed tokens."""
    tree = DraftTree.from_lists([0] * n, [-1] + [(i - 1) // TREE_FANOUT for i in range(1, n)])
    return tree.positions(context)[None], tree.attention_mask(context)[None]


@torch.inference_mode()
def row_samples(ours: Ours, rows: Sequence[int], passes: int = ROW_PASSES) -> dict[str, dict[int, float]]:
    """Median seconds per n over ``passes`` interleaved passes: {"ours-layers" | "ours-head-last" |
    "ours-head-all": {n: s}}, each n a fresh tree over the same prompt context."""
    shard = ours.lm.shard
    context = len(ours.prompt_ids)
    cache = shard.new_cache(context + max(rows))
    prefill_features(shard, cache, ours.prompt_ids)
    cache.commit(cache.pending)
    inputs = {n: tree_inputs(n, context) for n in rows}
    ids = torch.tensor([ours.prompt_ids[-1:] * max(rows)])  # [1, max n]: the token ids don't change the cost
    got: dict[str, dict[int, list[float]]] = {k: {n: [] for n in rows} for k in ROW_ENGINES[:-1]}
    for _ in range(passes):
        for n in rows:
            pos, mask = inputs[n]
            t0 = time.perf_counter()
            feats = shard(ids[:, :n], cache, positions=pos, mask=mask)[0]  # [n, hidden]
            t1 = time.perf_counter()
            shard.logits(feats[-1:])
            t2 = time.perf_counter()
            shard.logits(feats)
            t3 = time.perf_counter()
            cache.keep([])
            got["ours-layers"][n].append(t1 - t0)
            got["ours-head-last"][n].append(t2 - t0)
            got["ours-head-all"][n].append(t1 - t0 + t3 - t2)
    return {k: {n: statistics.median(v) for n, v in per.items()} for k, per in got.items()}


# ------------------------------------------------------------------------------------------------ the run


def _rotated(items: Sequence, r: int) -> list:
    k = r % len(items)
    return list(items[k:]) + list(items[:k])


def measure(cfg: EngineBenchConfig, ours: Ours) -> dict:
    """Every part of ``cfg.parts``, interleaved (module doc) -> {"samples": [...], "memory": [...], "load": the
    host's 1-minute load average at the start and the end (other work on the host shows here)}"""
    load_start = os.getloadavg()[0]
    exe = cfg.llama_bench
    depth = len(ours.prompt_ids)
    sides = [*ours.decoders, *(["llama.cpp"] if exe else [])]
    per_repeat = len(cfg.threads) * (len(sides) * ("decode" in cfg.parts) + (1 + bool(exe)) * ("rows" in cfg.parts))
    jobs = memory_jobs(cfg, ours) if "memory" in cfg.parts else []
    samples: list[dict] = []
    bar = tqdm(total=cfg.repeats * per_repeat + len(cfg.threads) + len(jobs), desc="bench-engine", file=sys.stderr,
               disable=not cfg.progress, dynamic_ncols=True, leave=False)
    with bar:
        for t in cfg.threads:  # warm-up: pages, scratch buffers, the thread pool
            bar.set_postfix_str(f"warm-up, {t} thread(s)")
            set_threads(t)
            for dec in ours.decoders.values():
                decode_sample(dec, ours.prompt_ids, WARMUP_TOKENS)
            bar.update()
        for r in range(cfg.repeats):
            for t in _rotated(cfg.threads, r):
                set_threads(t)
                if "decode" in cfg.parts:
                    for side in _rotated(sides, r):
                        bar.set_postfix_str(f"repeat {r + 1}/{cfg.repeats}: decode, {side}, {t} thread(s)")
                        if side == "llama.cpp":
                            tests, _ = llamacpp.run_bench(exe, cfg.model, threads=t, gen=cfg.tokens, depth=depth)
                            s = {"tokens_per_s": llamacpp.decode_tokens_per_s(tests), "decoded": cfg.tokens}
                        else:
                            s = decode_sample(ours.decoders[side], ours.prompt_ids, cfg.tokens)
                        samples.append({"part": "decode", "engine": side, "threads": t, "repeat": r, **s,
                                        "load1": os.getloadavg()[0]})
                        bar.update()
                if "rows" in cfg.parts:
                    for side in _rotated(["ours", "llama.cpp"] if exe else ["ours"], r):
                        bar.set_postfix_str(f"repeat {r + 1}/{cfg.repeats}: n-row forwards, {side}, {t} thread(s)")
                        if side == "ours":
                            costs = row_samples(ours, cfg.rows)
                        else:
                            tests, _ = llamacpp.run_bench(exe, cfg.model, threads=t, prompt=cfg.rows, depth=depth,
                                                          repeats=ROW_PASSES)
                            costs = {"llama.cpp": llamacpp.batch_seconds(tests)}
                        samples += [{"part": "rows", "engine": e, "threads": t, "repeat": r, "n": n, "seconds": s}
                                    for e, per in costs.items() for n, s in per.items()]
                        bar.update()
        memory = []
        for job in jobs:
            bar.set_postfix_str(f"peak RSS: {job.name}, {job.threads} thread(s)")
            memory.append(job.run())
            bar.update()
    return {"samples": samples, "memory": memory, "load": {"start": load_start, "end": os.getloadavg()[0]}}


# ------------------------------------------------------------------------------------------------- memory


@dataclass(frozen=True)
class MemoryJob:
    name: str  # "baseline", "ours-ar", "ours-spec", "llama-bench", "llama-cli"
    threads: int | None
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()

    def run(self) -> dict:
        done = llamacpp.run_peak(self.argv, {**os.environ, **dict(self.env)})
        rec = {"name": self.name, "threads": self.threads, "peak_mb": round(done.peak_mb, 1),
               "returncode": done.returncode}
        if done.returncode != 0:
            log.warning("%s exited %d: %s", self.name, done.returncode, done.stderr.strip()[-400:])
            rec["error"] = done.stderr.strip()[-400:]
        return rec


def memory_jobs(cfg: EngineBenchConfig, ours: Ours) -> list[MemoryJob]:
    """The processes whose peak RSS is measured: the baseline once, then per thread count each side's decode."""
    py = cfg.python
    jobs = [MemoryJob("baseline", None, (py, "-c", BASELINE_CODE))]
    shape = ours.shape
    cli = llamacpp.find_llama_cli(cfg.llama_bench)
    depth = len(ours.prompt_ids)
    for t in cfg.threads:
        env = (("OMP_NUM_THREADS", str(t)),)
        for mode in [m.removeprefix("ours-") for m in ours.decoders]:
            argv = [py, "-m", "flowspec_p2p", "-q", "generate", cfg.prompt, "--mode", mode, "--max-tokens",
                    str(cfg.tokens + 1), "--threads", str(t), "--model", str(cfg.model)]
            if mode == "spec":
                assert shape is not None
                argv += ["--tree-tokens", str(shape.total_tokens), "--tree-depth", str(shape.depth),
                         "--tree-topk", str(shape.top_k), "--tree-lookup", str(shape.lookup_depth)] + (
                            ["--draft", cfg.draft] if cfg.draft else [])
            jobs.append(MemoryJob(f"ours-{mode}", t, tuple(argv), env))
        if cfg.llama_bench is not None:
            argv = llamacpp.bench_argv(cfg.llama_bench, cfg.model, threads=t, gen=cfg.tokens, depth=depth)
            jobs.append(MemoryJob("llama-bench", t, tuple(argv)))
        if cli is not None:
            argv = llamacpp.cli_argv(cli, cfg.model, prompt=cfg.prompt, tokens=cfg.tokens, threads=t,
                                     context=depth + cfg.tokens + 64)
            jobs.append(MemoryJob("llama-cli", t, tuple(argv)))
    return jobs


def setup_record(cfg: EngineBenchConfig, ours: Ours, command: str) -> dict:
    """What was run, on what: results.json's "setup" (paths relative to the repository: bench/paths.py)."""
    shard = ours.lm.shard
    exe = cfg.llama_bench
    return {
        "command": portable_command(command), "model": portable_path(cfg.model), "model_name": cfg.model.name,
        "file_mb": cfg.model.stat().st_size / 2**20, "num_layers": ours.lm.source.config.num_layers,
        "engine": shard.engine.describe(),
        "threads": list(cfg.threads), "repeats": cfg.repeats, "tokens": cfg.tokens, "rows": list(cfg.rows),
        "parts": list(cfg.parts), "prompt_label": cfg.prompt_label, "prompt": cfg.prompt,
        "prompt_tokens": len(ours.prompt_ids),
        "prompt_form": "raw: no chat template" if is_base(getattr(ours.lm, "tokenizer", None)) else "chat template",
        "tree": None if ours.shape is None else ours.shape.model_dump(),
        "tree_fanout": TREE_FANOUT, "row_passes": ROW_PASSES,
        "llama_bench": None if exe is None else portable_path(exe),
        "llama_build": None if exe is None else llamacpp.version(exe),
        "llama_cli": portable_path(cli) if (cli := llamacpp.find_llama_cli(exe)) else None,
        "python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine(),
        "cpus": os.cpu_count(), "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
