"""Timing of the few-row matmul backends (model/kernels.py, model/shard.py): ``python -m flowspec_p2p.bench.kernels``.

The matmuls of a quarter of the default model's layer shapes through MKL, oneDNN and the fewrow kernel, one thread,
then a stage's tree forward (7 layers, attention over a 200-token context) through each, interleaved; every figure is
relative to one row on MKL.
"""

from __future__ import annotations

import logging
import os
import statistics
import sys
import time

import torch

from .. import env
from ..model import kernels as fewrow
from ..model.load import load_model
from ..model.shard import FEWROW, ONEDNN, Shard
from ..types import LayerRange


def main() -> None:
    """Time the kernel against MKL and oneDNN on one quarter of the default model's layer shapes, one thread; then a
    stage forward through each backend (_stage)."""
    torch.set_num_threads(1)
    shapes = [(576, 960), (576, 576), (576, 3072), (1536, 576)] * 7  # 7 SmolLM2-135M layers: qkv, o, gate|up, down
    ws = [torch.randn(k, n) * 0.05 for k, n in shapes]
    copies = {b.name: [b.pack(w) for w in ws] for b in (ONEDNN, FEWROW)}

    def through(b):  # the backend's matmul over its copies; x: {k: [m, k]}
        return lambda x: [b.matmul(x[w.shape[0]], c) for w, c in zip(ws, copies[b.name], strict=True)]

    ways = {"mkl": lambda x: [x[w.shape[0]] @ w for w in ws], "onednn": through(ONEDNN), "fewrow": through(FEWROW)}
    times: dict[tuple[int, str], list[float]] = {}
    rows = (1, 2, 4, 6, 8, 16, 32)
    for _ in range(15):
        for m in rows:
            xs = {k: torch.randn(m, k) for k in (576, 1536)}
            for name, fn in ways.items():
                t = time.perf_counter()
                fn(xs)
                times.setdefault((m, name), []).append(time.perf_counter() - t)
    one = statistics.median(times[(1, "mkl")])
    for m in rows:
        cells = [f"{n} {statistics.median(times[(m, n)]) / one:.2f}x" for n in ways]
        sys.stdout.write(f"{m:2d} rows: {'  '.join(cells)} (of one row on MKL)\n")
    _stage()


def _stage() -> None:
    """Time a stage's tree forward (layers 8-14 of the default model, attention over a 200-token context included)
    through each backend of model/shard.py, interleaved, relative to one row on MKL."""
    source = load_model(tokenizer=False).source
    hidden = source.config.hidden_size
    names = {"0": "mkl", "onednn": "onednn", "fewrow": "fewrow"}
    shards = {choice: Shard.from_source(source, LayerRange(start=8, end=15), embed=False, head=False).eval()
              for choice in names}  # one per backend: each keeps its own packed copy
    caches = {choice: sh.new_cache(512) for choice, sh in shards.items()}
    rows = (1, 2, 4, 6, 8, 16)
    times: dict[tuple[int, str], list[float]] = {}

    def forward(choice: str, n: int) -> float:
        os.environ[env.PACKED_WEIGHTS] = choice
        cache, ctx = caches[choice], 200
        mask = torch.ones(1, n, ctx + n, dtype=torch.bool)  # [1, n, ctx + n]: the context, causal among the new
        mask[0, :, ctx:] = torch.ones(n, n, dtype=torch.bool).tril()
        t = time.perf_counter()
        shards[choice](torch.randn(1, n, hidden), cache, positions=torch.arange(ctx, ctx + n)[None],
                    mask=mask if n > 1 else None)
        dt = time.perf_counter() - t
        cache.keep([])  # drop the new rows; the context stays
        return dt

    before = os.environ.get(env.PACKED_WEIGHTS)
    with torch.inference_mode():
        for choice, sh in shards.items():
            os.environ[env.PACKED_WEIGHTS] = choice
            sh(torch.randn(1, 200, hidden), caches[choice])  # the context
            caches[choice].commit(200)
            for n in rows:
                forward(choice, n)  # packs, warms up
        for _ in range(12):
            for n in rows:
                for choice in names:
                    times.setdefault((n, choice), []).append(forward(choice, n))
    if before is None:
        os.environ.pop(env.PACKED_WEIGHTS, None)
    else:
        os.environ[env.PACKED_WEIGHTS] = before
    one = statistics.median(times[(1, "0")])
    sys.stdout.write(f"a stage's forward (7 layers, 200-token context; one row on MKL: {one * 1e3:.1f} ms):\n")
    for n in rows:
        cells = [f"{name} {statistics.median(times[(n, choice)]) / one:.2f}x" for choice, name in names.items()]
        sys.stdout.write(f"{n:2d} rows: {'  '.join(cells)}\n")


if __name__ == "__main__":
    logging.basicConfig(format="%(message)s")
    if fewrow.library() is None:
        raise SystemExit("the few-row kernel is not available here (see the warning above)")
    main()
