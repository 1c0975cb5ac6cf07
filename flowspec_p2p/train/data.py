"""Training data for the draft head: the target's features over conversations, in two stores of a run.

    features/   self-distillation: the target answers the prompt pool (batched, KV-cached generation, greedy or
                sampled at T=1) and the features of every position are kept as it goes
    fixed/      teacher-forced ShareGPT (EAGLE-1's "fixed data", arXiv 2401.15077 Table 6: 3.62 vs 3.75 tau for
                target-written data): the pool's ShareGPT prompts with their recorded ChatGPT answers, run through
                the target in one prefill each. A prefilled token costs a fraction of a decoded one on a CPU,
                so this buys several times more (slightly off-distribution) tokens per CPU second.
                Marked with temperature -1; evaluation uses self-distilled greedy conversations only.

Resumable: the pool is frozen in ``<run>/pool.jsonl`` on first use, and conversations already in a store are
skipped, so a restarted job continues where the last one stopped.
"""

from __future__ import annotations

import logging
import signal
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field
from tqdm import tqdm

from ..model.load import load_model
from ..model.tokenizer import is_base, user_prompt
from ..types import Settings
from .batchgen import BatchGenerator, Finished, Request
from .corpus import is_heldout
from .prompts import Prompt, build_pool, load_pool, save_pool, sharegpt_candidates, sharegpt_path
from .store import FeatureStore

log = logging.getLogger(__name__)


class DataConfig(Settings):
    run_dir: Path
    model: str | None = None  # GGUF file or HF folder; None = the packaged default
    prompts: int = Field(20000, ge=1)  # how much of the pool to answer
    skip_prompts: int = Field(0, ge=0)  # start this far into the pool (a second process answers another part)
    max_new_tokens: int = Field(256, ge=1)
    max_prompt_tokens: int = Field(512, ge=8)
    batch: int = Field(16, ge=1)
    sampled_fraction: float = Field(0.2, ge=0.0, le=1.0)  # answers sampled at T=1 instead of greedy
    seed: int = 0
    shard_tokens: int = Field(16384, ge=1)  # flush a shard once this many tokens are pending
    threads: int = Field(1, ge=1)
    source: Literal["generate", "sharegpt"] = "generate"
    # answer only the pool's held-out prompts (corpus.Corpus.split): a held-out set that no head trained on by
    # this pipeline has seen, sooner than the pool's order would reach one
    heldout_only: bool = False
    heldout_first: int = Field(0, ge=0)  # answer this many held-out prompts first, then the part as usual
    max_seconds: float | None = Field(None, gt=0)  # stop (saving what is finished) after this long


def pool_for(run_dir: Path, seed: int) -> list[Prompt]:
    """The run's prompt pool, built and frozen on first use."""
    path = run_dir / "pool.jsonl"
    if path.is_file():
        return load_pool(path)
    log.info("building the prompt pool (ShareGPT + synthetic, Spec-Bench excluded)")
    pool = build_pool(seed=seed)
    save_pool(pool, path)
    log.info("prompt pool: %d prompts -> %s", len(pool), path)
    return pool


def _temperature(key: str, fraction: float) -> float:
    """1.0 for a ``fraction`` of the keys, else 0.0 (greedy). Hashed apart from the held-out split
    (corpus.Corpus.split hashes the bare key): hashing the same string made every held-out conversation a T=1
    one, leaving no greedy conversation to measure chain acceptance on (stores written before this keep theirs)."""
    return 1.0 if zlib.crc32(f"temperature:{key}".encode()) % 1000 < fraction * 1000 else 0.0


def _part(pool: list[Prompt], cfg: DataConfig) -> list[Prompt]:
    """The pool prompts this run answers: ``cfg.prompts`` of them from ``cfg.skip_prompts`` on (of the held-out
    ones only, with ``heldout_only``)."""
    if cfg.heldout_only:
        pool = [p for p in pool if is_heldout(p.key)]
    part = pool[cfg.skip_prompts : cfg.skip_prompts + cfg.prompts]
    if cfg.heldout_first:
        first = [p for p in pool if is_heldout(p.key)][: cfg.heldout_first]
        keys = {p.key for p in first}
        part = first + [p for p in part if p.key not in keys]
    return part


def _requests(pool: list[Prompt], done: set[str], tokenizer, cfg: DataConfig, skipped: list[str]) -> Iterator[Request]:
    for p in _part(pool, cfg):
        if p.key in done:
            continue
        ids = user_prompt(tokenizer, p.text)  # a base model (no chat template): the raw prompt
        if len(ids) > cfg.max_prompt_tokens:
            skipped.append(p.key)
            continue
        yield Request(p.key, ids, _temperature(p.key, cfg.sampled_fraction), zlib.crc32(p.key.encode()) + cfg.seed)


def _flush(store: FeatureStore, since: float) -> float:
    """Write the pending conversations; the manifest's ``seconds`` adds the time spent since ``since`` (the last
    flush: what ``draft train --minutes`` counts against each data step's budget across restarts). -> now"""
    now = time.perf_counter()
    store.manifest["seconds"] = round(store.manifest.get("seconds", 0.0) + now - since, 3)
    store.flush()
    return now


def _bar(cfg: DataConfig, conversations: int, desc: str, progress: bool) -> tqdm:
    """A progress bar over the conversations to go, or over the time budget when there is one."""
    if cfg.max_seconds:
        return tqdm(total=round(cfg.max_seconds), desc=desc, unit="s", disable=not progress, dynamic_ncols=True)
    return tqdm(total=conversations, desc=desc, unit="conv", disable=not progress, dynamic_ncols=True)


def _tick(bar: tqdm, cfg: DataConfig, t0: float) -> None:
    """One more conversation done."""
    if cfg.max_seconds:
        bar.update(min(round(time.perf_counter() - t0), bar.total) - bar.n)
    else:
        bar.update(1)


def _sigterm(signum, frame):
    raise KeyboardInterrupt


def generate_data(cfg: DataConfig, progress: bool = True) -> FeatureStore:
    """Answer the first ``cfg.prompts`` pool prompts not yet stored; return the store."""
    torch.set_num_threads(cfg.threads)
    # the torch engine: batched generation needs a many-row KV cache (the native engine runs one request's rows)
    lm = load_model(cfg.model, dtype=torch.float32, engine="torch")
    if cfg.source == "sharegpt":
        return teacher_forced_data(cfg, lm, progress)
    store = FeatureStore(cfg.run_dir / "features", hidden=lm.shard.cfg.hidden_size,
                         target_fingerprint=lm.fingerprint())
    pool = pool_for(cfg.run_dir, cfg.seed)
    done = store.done_keys()
    todo = sum(1 for p in _part(pool, cfg) if p.key not in done)
    log.info("feature store %s: %d conversations, %d tokens; %d prompts to go", store.root, store.conversations,
             store.tokens, todo)
    gen = BatchGenerator(lm.shard, batch=cfg.batch, max_new_tokens=cfg.max_new_tokens,
                         stop_ids=lm.tokenizer.stop_ids, max_prompt=cfg.max_prompt_tokens)
    skipped: list[str] = []
    new_tokens = 0
    t0 = mark = time.perf_counter()
    old = signal.signal(signal.SIGTERM, _sigterm)
    bar = _bar(cfg, todo, "self-distill", progress)
    try:
        for item in gen.run(_requests(pool, done, lm.tokenizer, cfg, skipped)):
            store.add(item)
            new_tokens += len(item.tokens) - item.prompt_len
            _tick(bar, cfg, t0)
            bar.set_postfix(answer_tok=new_tokens, tok_s=f"{new_tokens / (time.perf_counter() - t0):.1f}",
                            refresh=False)
            if store.pending_tokens >= cfg.shard_tokens:
                mark = _flush(store, mark)
            if cfg.max_seconds and time.perf_counter() - t0 >= cfg.max_seconds:
                log.info("time budget (%.0f s) spent: stopping", cfg.max_seconds)
                break
    except KeyboardInterrupt:
        log.warning("interrupted: saving the finished conversations")
    finally:
        _flush(store, mark)
        bar.close()
        signal.signal(signal.SIGTERM, old)
    log.info("feature store: %d conversations, %d tokens (%d prompts over %d tokens skipped)", store.conversations,
             store.tokens, len(skipped), cfg.max_prompt_tokens)
    return store


FIXED_TEMPERATURE = -1.0  # marks teacher-forced conversations in a store


def _answers(keys: set[str]) -> dict[str, str]:
    """ShareGPT's first assistant answers for pool keys ``sharegpt:<id>``."""
    out = {}
    for cid, _, answer in sharegpt_candidates(sharegpt_path()):
        if answer and f"sharegpt:{cid}" in keys:
            out[f"sharegpt:{cid}"] = answer.strip()
    return out


def teacher_forced_data(cfg: DataConfig, lm, progress: bool = True) -> FeatureStore:
    """Prefill the pool's ShareGPT prompts with their recorded answers; store the features in ``<run>/fixed``."""
    store = FeatureStore(cfg.run_dir / "fixed", hidden=lm.shard.cfg.hidden_size, target_fingerprint=lm.fingerprint())
    pool = [p for p in _part(pool_for(cfg.run_dir, cfg.seed), cfg) if p.key.startswith("sharegpt:")]
    done = store.done_keys()
    todo = [p for p in pool if p.key not in done]
    answers = _answers({p.key for p in todo})
    log.info("teacher-forced store %s: %d conversations; %d to go", store.root, store.conversations, len(answers))
    tok = lm.tokenizer
    old = signal.signal(signal.SIGTERM, _sigterm)
    bar = _bar(cfg, len(answers), "teacher-force", progress)
    n_tokens, t0 = 0, time.perf_counter()
    mark = t0
    try:
        with torch.inference_mode():
            for p in todo:
                if p.key not in answers:
                    continue
                _tick(bar, cfg, t0)
                prompt = user_prompt(tok, p.text)
                if is_base(tok):  # a base model: the answer continues the raw prompt
                    ids = prompt + tok.encode("\n\n" + answers[p.key])
                else:
                    text = tok.render([{"role": "user", "content": p.text},
                                       {"role": "assistant", "content": answers[p.key]}], add_generation_prompt=False)
                    ids = tok.encode(text)
                if len(prompt) > cfg.max_prompt_tokens or ids[: len(prompt)] != prompt:
                    continue
                ends = [i for i in range(len(prompt), len(ids)) if ids[i] in tok.stop_ids]
                ids = ids[: min(ends[0] + 1 if ends else len(ids), len(prompt) + cfg.max_new_tokens)]  # ...<|im_end|>
                feats = lm.shard(torch.tensor([ids[:-1]]), None)[0]  # [T - 1, hidden]
                store.add(Finished(p.key, len(prompt), ids, feats.to(torch.float16), FIXED_TEMPERATURE, "fixed"))
                n_tokens += len(ids) - len(prompt)
                bar.set_postfix(answer_tok=n_tokens, tok_s=f"{n_tokens / (time.perf_counter() - t0):.1f}",
                                refresh=False)
                if store.pending_tokens >= cfg.shard_tokens:
                    mark = _flush(store, mark)
                if cfg.max_seconds and time.perf_counter() - t0 >= cfg.max_seconds:
                    log.info("time budget (%.0f s) spent: stopping", cfg.max_seconds)
                    break
    except KeyboardInterrupt:
        log.warning("interrupted: saving the finished conversations")
    finally:
        _flush(store, mark)
        bar.close()
        signal.signal(signal.SIGTERM, old)
    log.info("teacher-forced store: %d conversations, %d tokens", store.conversations, store.tokens)
    return store
