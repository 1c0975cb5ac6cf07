"""Benchmark: the default model (SmolLM2-135M, Q4_1 layers, Q8_0 tied LM head) through the engine.

    python -m native.bench [--random] [--reps 15] [--context 128] [--threads 1 2]

Times, interleaved over n = 1, 2, 4, 8, 16, 32 rows and repeated (medians), what a decoding step runs: the
30-layer stack forward (fs_layers_forward, over a cache prefix of `context` tokens) followed by the LM head
(fs_final); with --matmuls also the same layers' matmuls alone (fs_matmul per matrix, one ctypes call each).
Weights come from the real GGUF file (the default model: registry.default_model_path) unless --random or it is
missing (random weights of the same types and shapes; the speed is the same). All packed matrices share one huge-page
WeightArena.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from ...errors import ConfigError
from ..registry import default_model_path
from . import LayerSpec, LayerStack, QMatrix, WeightArena, _lib, isa, set_isa, set_threads

log = logging.getLogger(__name__)

ROWS = (1, 2, 4, 8, 16, 32)
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
HIDDEN, Q_HEADS, KV_HEADS, HEAD_DIM, INTER, LAYERS, VOCAB = 576, 9, 3, 64, 1536, 30, 49152
TENSORS = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output", "gate": "ffn_gate", "up": "ffn_up",
           "down": "ffn_down"}


def _gguf_path() -> Path | None:
    try:
        path = default_model_path()
    except ConfigError:
        return None
    return path if path.name == GGUF_NAME else None


def _from_gguf(path: Path) -> tuple[list[LayerSpec], QMatrix]:
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    shape = {n: (t.tensor_type.name, int(t.shape[1]), int(t.shape[0])) for n, t in tensors.items() if len(t.shape) == 2}
    arena = WeightArena.for_matrices(list(shape.values()))

    def matrix(name: str) -> QMatrix:
        return QMatrix.from_gguf_bytes(*shape[name], np.asarray(tensors[name].data), arena=arena)

    def vector(name: str) -> torch.Tensor:
        return torch.from_numpy(np.array(tensors[name].data, dtype=np.float32))

    layers = [LayerSpec(**{k: matrix(f"blk.{i}.{v}.weight") for k, v in TENSORS.items()},
                        attn_norm=vector(f"blk.{i}.attn_norm.weight"), mlp_norm=vector(f"blk.{i}.ffn_norm.weight"))
              for i in range(LAYERS)]
    return layers, matrix("token_embd.weight")


def _random_q(type_name: str, rows: int, cols: int, rng: np.random.Generator, arena: WeightArena) -> QMatrix:
    from .formats import weight_type

    wt = weight_type(type_name)
    blocks = rng.integers(0, 256, (rows * cols // wt.block, wt.block_bytes), dtype=np.uint8)
    blocks[:, 0:2] = np.full((len(blocks), 1), 0.01, np.float16).view(np.uint8)  # d (and m) small, finite
    if type_name == "Q4_1":
        blocks[:, 2:4] = np.full((len(blocks), 1), -0.05, np.float16).view(np.uint8)
    return QMatrix.from_gguf_bytes(type_name, rows, cols, blocks, arena=arena)


def _random_model() -> tuple[list[LayerSpec], QMatrix]:
    rng = np.random.default_rng(0)
    qd, kvd = Q_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    shapes = {"q": (qd, HIDDEN), "k": (kvd, HIDDEN), "v": (kvd, HIDDEN), "o": (HIDDEN, qd), "gate": (INTER, HIDDEN),
              "up": (INTER, HIDDEN), "down": (HIDDEN, INTER)}
    arena = WeightArena.for_matrices([("Q4_1", r, c) for r, c in shapes.values()] * LAYERS + [("Q8_0", VOCAB, HIDDEN)])
    ones = torch.ones(HIDDEN)
    layers = [LayerSpec(**{k: _random_q("Q4_1", r, c, rng, arena) for k, (r, c) in shapes.items()}, attn_norm=ones,
                        mlp_norm=ones) for _ in range(LAYERS)]
    return layers, _random_q("Q8_0", VOCAB, HIDDEN, rng, arena)


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def run(layers: list[LayerSpec], head: QMatrix, threads: int, reps: int, context: int,
        with_matmuls: bool = False) -> dict[str, dict]:
    """-> {"stack" | "head" | "token" [| "matmuls"]: {n: median ms}} at the given thread count, interleaved over n
    ("token": stack then head, back to back, as a decoding step runs them)."""
    set_threads(threads)
    lib = _lib.require()
    stack = LayerStack(layers, hidden=HIDDEN, q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                       intermediate=INTER, eps=1e-5)
    cap = context + max(ROWS)
    k_cache, v_cache = stack.new_cache(cap)
    k_cache.normal_()
    v_cache.normal_()
    inv = 1.0 / 1e5 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM)
    freqs = torch.outer(torch.arange(cap, dtype=torch.float32), inv)
    cos, sin = torch.cat([freqs, freqs], -1).cos().contiguous(), torch.cat([freqs, freqs], -1).sin().contiguous()
    norm = torch.ones(HIDDEN)
    head_struct = head.struct()
    mats = [getattr(spec, k) for spec in layers for k in TENSORS]
    xs = {n: torch.randn(n, max(HIDDEN, INTER)) * 0.1 for n in ROWS}
    out = {n: torch.empty(n, VOCAB) for n in ROWS}

    def stack_fwd(n: int) -> None:
        x = xs[n][:, :HIDDEN].contiguous()
        stack.forward(x, torch.arange(context, context + n), cos, sin, k_cache, v_cache, start=context)

    def head_fwd(n: int) -> None:
        x = xs[n][:, :HIDDEN].contiguous()
        lib.fs_final(x.data_ptr(), norm.data_ptr(), n, ctypes.c_float(1e-5), ctypes.byref(head_struct),
                     out[n].data_ptr())

    def matmuls(n: int) -> None:
        for m in mats:
            x = xs[n][:, :m.cols].contiguous()
            lib.fs_matmul(m.wtype.id, m.rows, m.cols, m.packed.data_ptr(), x.data_ptr(), n, out[n].data_ptr())

    samples: dict[tuple[str, int], list[float]] = {}

    def timed(name: str, fn, n: int, keep: bool) -> float:
        t0 = time.perf_counter()
        fn(n)
        dt = time.perf_counter() - t0
        if keep:
            samples.setdefault((name, n), []).append(dt)
        return dt

    for rep in range(reps + 2):
        for n in ROWS:
            keep = rep >= 2  # two warm-up rounds
            dt = timed("stack", stack_fwd, n, keep) + timed("head", head_fwd, n, keep)
            if keep:
                samples.setdefault(("token", n), []).append(dt)
            if with_matmuls:
                timed("matmuls", matmuls, n, keep)
    names = ("stack", "head", "token") + (("matmuls",) if with_matmuls else ())
    return {name: {n: _median_ms(samples[(name, n)]) for n in ROWS} for name in names}


def report(results: dict[int, dict[str, dict]], context: int) -> str:
    lines = [f"ISA {isa()}; 30-layer stack over a {context}-token cache prefix; medians in ms (ratio to 1 row)"]
    for threads, r in results.items():
        one = r["token"][1]
        lines.append(f"\n{threads} thread(s): one token (stack + head) {one:.2f} ms = {1e3 / one:.0f} tok/s")
        cols = [k for k in ("stack", "head", "token", "matmuls") if k in r]
        lines.append(f"{'n':>4} " + " ".join(f"{k + ' ms':>9} {'ratio':>6}" for k in cols))
        for n in ROWS:
            lines.append(f"{n:>4} " + " ".join(f"{r[k][n]:9.2f} {r[k][n] / r[k][1]:5.2f}x" for k in cols))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--random", action="store_true", help="random weights instead of the GGUF file")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--context", type=int, default=128, help="tokens already in the KV cache")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--matmuls", action="store_true", help="also time the layers' matmuls one call each")
    p.add_argument("--isa", help="force an ISA path (native.available_isas())")
    args = p.parse_args(argv)
    logging.basicConfig(format="%(message)s", level=logging.INFO)
    if _lib.library() is None:
        raise SystemExit("the native engine is unavailable here (see the warning above)")
    if args.isa:
        set_isa(args.isa)
    path = None if args.random else _gguf_path()
    log.info("weights: %s", path or "random (same shapes and types)")
    layers, head = _from_gguf(path) if path else _random_model()
    results = {t: run(layers, head, t, args.reps, args.context, args.matmuls) for t in args.threads}
    sys.stdout.write(report(results, args.context) + "\n")


if __name__ == "__main__":
    main()
