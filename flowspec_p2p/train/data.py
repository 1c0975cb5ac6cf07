"""Self-distillation data: the target answers the prompt pool (batched, KV-cached), its features are stored.

Resumable: the pool is frozen in ``<run>/pool.jsonl`` on first use, and conversations already in the feature
store (``<run>/features``) are skipped, so a restarted job continues where the last one stopped.
"""

from __future__ import annotations

import logging
import signal
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch
from pydantic import Field
from tqdm import tqdm

from ..model import load_model
from ..types import FrozenModel
from .batchgen import BatchGenerator, Request
from .prompts import Prompt, build_pool, load_pool, save_pool
from .store import FeatureStore

log = logging.getLogger(__name__)


class DataConfig(FrozenModel):
    run_dir: Path
    model: str | None = None  # GGUF file or HF folder; None = the packaged default
    prompts: int = Field(20000, ge=1)  # how much of the pool to answer
    max_new_tokens: int = Field(256, ge=1)
    max_prompt_tokens: int = Field(512, ge=8)
    batch: int = Field(16, ge=1)
    sampled_fraction: float = Field(0.2, ge=0.0, le=1.0)  # answers sampled at T=1 instead of greedy
    seed: int = 0
    shard_tokens: int = Field(16384, ge=1)  # flush a shard once this many tokens are pending
    threads: int = Field(1, ge=1)


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
    return 1.0 if zlib.crc32(key.encode()) % 1000 < fraction * 1000 else 0.0


def _requests(pool: list[Prompt], done: set[str], tokenizer, cfg: DataConfig, skipped: list[str]) -> Iterator[Request]:
    for p in pool[: cfg.prompts]:
        if p.key in done:
            continue
        ids = tokenizer.chat([{"role": "user", "content": p.text}])
        if len(ids) > cfg.max_prompt_tokens:
            skipped.append(p.key)
            continue
        yield Request(p.key, ids, _temperature(p.key, cfg.sampled_fraction), zlib.crc32(p.key.encode()) + cfg.seed)


def _sigterm(signum, frame):
    raise KeyboardInterrupt


def generate_data(cfg: DataConfig, progress: bool = True) -> FeatureStore:
    """Answer the first ``cfg.prompts`` pool prompts not yet stored; return the store."""
    torch.set_num_threads(cfg.threads)
    lm = load_model(cfg.model, dtype=torch.float32)
    store = FeatureStore(cfg.run_dir / "features", hidden=lm.shard.cfg.hidden_size,
                         target_fingerprint=lm.fingerprint())
    pool = pool_for(cfg.run_dir, cfg.seed)
    done = store.done_keys()
    todo = sum(1 for p in pool[: cfg.prompts] if p.key not in done)
    log.info("feature store %s: %d conversations, %d tokens; %d prompts to go", store.root, store.conversations,
             store.tokens, todo)
    gen = BatchGenerator(lm.shard, batch=cfg.batch, max_new_tokens=cfg.max_new_tokens,
                         stop_ids=lm.tokenizer.stop_ids, max_prompt=cfg.max_prompt_tokens)
    skipped: list[str] = []
    new_tokens = 0
    t0 = time.perf_counter()
    old = signal.signal(signal.SIGTERM, _sigterm)
    bar = tqdm(total=todo, desc="self-distill", unit="conv", disable=not progress, dynamic_ncols=True)
    try:
        for item in gen.run(_requests(pool, done, lm.tokenizer, cfg, skipped)):
            store.add(item)
            new_tokens += len(item.tokens) - item.prompt_len
            bar.update(1)
            bar.set_postfix(answer_tok=new_tokens, tok_s=f"{new_tokens / (time.perf_counter() - t0):.1f}",
                            refresh=False)
            if store.pending_tokens >= cfg.shard_tokens:
                store.flush()
    except KeyboardInterrupt:
        log.warning("interrupted: saving the finished conversations")
    finally:
        store.flush()
        bar.close()
        signal.signal(signal.SIGTERM, old)
    log.info("feature store: %d conversations, %d tokens (%d prompts over %d tokens skipped)", store.conversations,
             store.tokens, len(skipped), cfg.max_prompt_tokens)
    return store
