"""The model core, measured against transformers: ``flowspec bench-core``.

    speed      decode ms/token at batch 1 and prefill tokens/s: ours (``ARDecoder``) and transformers' ``generate``
               on the same GGUF, same threads, prompts and lengths, run side by side (alternating which goes first),
               medians and their ratio. Each side is timed the same way, by wall clock around a whole call:
               prefill = a 1-token call, decode ms/token = (N-token call - 1-token call) / (N - 1).
    bound      what limits one decode step: the same step's weight matmuls alone (the bytes every token must stream
               from memory) and the memory bandwidth a plain copy reaches, next to the full step.
    agreement  greedy, token for token, against transformers' ``generate`` (float32, same prompt: chat-templated, or raw
               for a base model; EOS stops both); where a prompt diverges, the position and the top-2 logit gap there,
               and for every prompt the max |Δlogits| of a teacher-forced forward over the whole reply.
    memory     peak RSS of a fresh process that loads a layer range in a role, next to one that loads everything.
    load       start-up: opening the GGUF and dequantising the tensors, ours next to gguf-py's reader (the way
               this package did it before), and ``flowspec generate`` end to end.

Timing rule (docs/TEAM.md): only ratios of measurements taken side by side in one run, and medians.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from tqdm import tqdm

from ..model.generate import ARDecoder, generate_ids
from ..model.load import LoadedModel
from ..model.sampling import SamplingParams
from ..model.tokenizer import user_prompt
from ..specbench import Question
from . import write_json_md

log = logging.getLogger(__name__)

GREEDY = SamplingParams()


def _bar(it, desc: str, progress: bool, total: int | None = None):
    return tqdm(it, desc=desc, total=total, disable=not progress, leave=False, dynamic_ncols=True, file=sys.stderr)


def _elapsed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def load_transformers(lm: LoadedModel):
    """transformers' own model for the same checkpoint (its GGUF reader for a GGUF file), float32, eval."""
    from transformers import AutoModelForCausalLM

    p = lm.path
    kw = {"gguf_file": p.name} if p.is_file() else {}
    folder = p.parent if p.is_file() else p
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kw).eval()


prompt_ids = user_prompt  # the chat template's user message, or a base model's raw prompt


def _hf_generate(hf, ids: list[int], n: int, eos: Sequence[int], exact: bool) -> list[int]:
    """Greedy ``generate``; ``exact``: exactly n tokens (EOS suppressed until then), else stop at EOS."""
    kw = {"min_new_tokens": n} if exact else {}
    out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=list(eos),
                      pad_token_id=eos[0], **kw)
    return out[0, len(ids) :].tolist()


# ------------------------------------------------------------------------------------------------- speed


@torch.inference_mode()
def speed(lm: LoadedModel, hf, prompts: list[Question], new_tokens: int, repeats: int, progress: bool) -> dict:
    """Side-by-side decode and prefill timings, ours vs transformers (see module doc)."""
    tok = lm.tokenizer
    ours = ARDecoder(lm.shard)
    eos = sorted(tok.stop_ids)
    sides: dict[str, Callable[[list[int], int], object]] = {
        "ours": lambda ids, n: generate_ids(ours, ids, GREEDY, n),  # no stop ids: exactly n tokens
        "transformers": lambda ids, n: _hf_generate(hf, ids, n, eos, exact=True),
    }
    rows = []
    warm = prompt_ids(tok, prompts[0].text)
    for fn in sides.values():
        fn(warm, 4)
    for k, p in enumerate(_bar(prompts, "speed", progress)):
        ids = prompt_ids(tok, p.text)
        t1: dict[str, list[float]] = {s: [] for s in sides}
        tn: dict[str, list[float]] = {s: [] for s in sides}
        for r in range(repeats):
            order = list(sides) if (k + r) % 2 == 0 else list(sides)[::-1]
            for s in order:
                t1[s].append(_elapsed(lambda s=s, ids=ids: sides[s](ids, 1)))
                tn[s].append(_elapsed(lambda s=s, ids=ids: sides[s](ids, new_tokens)))
        row = {"dataset": p.dataset, "line": p.line, "prompt_tokens": len(ids)}
        for s in sides:
            a, b = statistics.median(t1[s]), statistics.median(tn[s])
            row[f"{s}_prefill_tok_s"] = len(ids) / a
            row[f"{s}_decode_ms"] = 1e3 * (b - a) / (new_tokens - 1)
        rows.append(row)
    med = {key: statistics.median(r[key] for r in rows) for key in rows[0] if key.endswith(("_tok_s", "_ms"))}
    return {
        "new_tokens": new_tokens,
        "repeats": repeats,
        "rows": rows,
        "median": med,
        "decode_speedup": med["transformers_decode_ms"] / med["ours_decode_ms"],
        "prefill_speedup": med["ours_prefill_tok_s"] / med["transformers_prefill_tok_s"],
        "decode_speedup_per_prompt_median": statistics.median(
            r["transformers_decode_ms"] / r["ours_decode_ms"] for r in rows
        ),
    }


@torch.inference_mode()
def bound(lm: LoadedModel, context: int = 160, repeats: int = 30) -> dict:
    """What one decode step costs, against the weight matmuls it cannot avoid and the machine's copy bandwidth."""
    shard = lm.shard
    cache = shard.new_cache(context + 1)
    shard(torch.randint(0, shard.cfg.vocab_size, (1, context)), cache)
    token = torch.tensor([[7]])
    x, xi = torch.randn(1, 1, shard.cfg.hidden_size), torch.randn(1, 1, shard.cfg.intermediate_size)
    mats = [(x, w) for b in shard.blocks for w in (b.wqkv, b.wo, b.w13)] + [(xi, b.w2) for b in shard.blocks]
    mats.append((x, shard.head_t))
    weight_bytes = sum(w.numel() * w.element_size() for _, w in mats)
    big = torch.empty(weight_bytes // 4 // 2, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(big)

    def step():
        cache.truncate(context)
        shard.logits(shard(token, cache)[0, -1]).argmax()

    def matmuls():
        for a, w in mats:
            a @ w

    samples: dict[str, list[float]] = {"step": [], "matmuls": [], "copy": []}
    for _ in range(3):
        step()
        matmuls()
    for _ in range(repeats):
        samples["step"].append(_elapsed(step))
        samples["matmuls"].append(_elapsed(matmuls))
        samples["copy"].append(_elapsed(lambda: dst.copy_(big)))
    med = {k: statistics.median(v) for k, v in samples.items()}
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    ops = sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))
    return {
        "threads": torch.get_num_threads(),
        "weight_mb_per_token": weight_bytes / 1e6,
        "step_ms": med["step"] * 1e3,
        "matmuls_ms": med["matmuls"] * 1e3,
        "matmul_share": med["matmuls"] / med["step"],
        "matmul_gb_s": weight_bytes / med["matmuls"] / 1e9,
        "copy_gb_s": 2 * big.numel() * 4 / med["copy"] / 1e9,  # read + write
        "floor_ms_at_copy_bandwidth": weight_bytes / (2 * big.numel() * 4 / med["copy"]) * 1e3,
        "aten_ops_per_step": ops,
        "other_ms_per_op_us": (med["step"] - med["matmuls"]) / max(ops, 1) * 1e6,
    }


# --------------------------------------------------------------------------------------------- agreement


@torch.inference_mode()
def agreement(lm: LoadedModel, hf, prompts: list[Question], new_tokens: int, progress: bool) -> dict:
    """Greedy token-for-token equality with transformers, per prompt; divergences with the top-2 gap there."""
    tok, shard = lm.tokenizer, lm.shard
    ours = ARDecoder(shard)
    rows = []
    for p in _bar(prompts, "agreement", progress):
        ids = prompt_ids(tok, p.text)
        mine, _ = generate_ids(ours, ids, GREEDY, new_tokens, tok.stop_ids)
        theirs = _hf_generate(hf, ids, new_tokens, sorted(tok.stop_ids), exact=False)
        seq = ids + mine
        hf_logits = hf(torch.tensor([seq])).logits[0, len(ids) - 1 :]  # [len(mine) + 1, vocab]
        our_logits = shard.logits(shard(torch.tensor([seq]), None))[0, len(ids) - 1 :]  # one forward
        step_logits = _stepwise_logits(shard, ids, mine)  # the decode path: prefill, then one token at a time
        row = {"dataset": p.dataset, "line": p.line, "prompt_tokens": len(ids), "ours_tokens": len(mine),
               "transformers_tokens": len(theirs), "max_abs_dlogits": (our_logits - hf_logits).abs().max().item(),
               "max_abs_dlogits_decode": (step_logits - hf_logits).abs().max().item()}
        at = next((i for i, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b), None)
        if at is None and len(mine) != len(theirs):
            at = min(len(mine), len(theirs))
        row["diverged_at"] = at
        if at is not None:
            top2 = our_logits[at].topk(2).values
            row["ours_top2_gap"] = (top2[0] - top2[1]).item()
            top2 = hf_logits[at].topk(2).values
            row["transformers_top2_gap"] = (top2[0] - top2[1]).item()
            row["tokens_there"] = [mine[at] if at < len(mine) else None, theirs[at] if at < len(theirs) else None]
        rows.append(row)
    same = sum(r["diverged_at"] is None for r in rows)
    return {"new_tokens": new_tokens, "identical": same, "prompts": len(rows), "rows": rows,
            "max_abs_dlogits": max(r["max_abs_dlogits"] for r in rows),
            "max_abs_dlogits_decode": max(r["max_abs_dlogits_decode"] for r in rows)}


def _stepwise_logits(shard, prompt: list[int], reply: list[int]) -> torch.Tensor:
    """Logits as decoding computes them: the prompt's last position, then each reply token fed alone.
    -> [len(reply) + 1, vocab]"""
    cache = shard.new_cache(len(prompt) + len(reply))
    out = [shard.logits(shard(torch.tensor([prompt]), cache)[0, -1])]
    out += [shard.logits(shard(torch.tensor([[t]]), cache)[0, -1]) for t in reply]
    return torch.stack(out)


# ------------------------------------------------------------------------------------------------ memory


def _peak_rss_mb() -> float:
    """This process's peak resident set (VmHWM; unlike ru_maxrss it does not inherit the parent's peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # not Linux: best effort


def rss_child(path: str | None, start: int, end: int, embed: bool, head: bool, context: int) -> None:
    """Run in a fresh process: load one range in one role on the engine ``load_shard`` picks, allocate its KV
    cache for ``context`` positions, print as JSON the peak RSS (MB) before and after and what the range stores
    in the file (its layers' bytes, plus the embedding and the LM head where it holds them)."""
    from ..model.load import load_shard
    from ..model.weights import EMBED, HEAD, layer_tensor_names, open_source
    from ..types import LayerRange

    src = open_source(path)
    cfg = src.config
    names = [n for i in range(start, end) for n in layer_tensor_names(cfg, i)]
    names += [EMBED] if embed else []
    names += [EMBED if cfg.tie_embeddings else HEAD] if head and not (embed and cfg.tie_embeddings) else []
    stored = sum(len(src.raw_bytes(n)) for n in names)
    base = _peak_rss_mb()
    shard = load_shard(src, LayerRange(start=start, end=end), embed=embed, head=head)
    cache = shard.new_cache(context)
    tensors = shard.nbytes
    kv = cache.k.numel() * cache.k.element_size() + cache.v.numel() * cache.v.element_size()
    peak = _peak_rss_mb()
    sys.stdout.write(json.dumps({"engine": type(shard).__name__, "baseline_mb": base, "peak_mb": peak,
                                 "tensors_mb": tensors / 2**20, "stored_mb": stored / 2**20,
                                 "kv_mb": kv / 2**20}) + "\n")


def memory(path: str | None, num_layers: int, context: int = 2048) -> dict:
    """Peak RSS per role (a member stage's range, the leader's ends, everything), each in a fresh process, next to
    the target: RSS before loading + 1.3 x the range's stored bytes + its KV cache at ``context`` positions."""
    q = num_layers // 4
    cases = [
        ("first quarter + embedding", 0, q, True, False),
        ("middle quarter", q, 2 * q, False, False),
        ("last quarter + norm/head", num_layers - q, num_layers, False, True),
        ("all layers + embedding + head", 0, num_layers, True, True),
    ]
    rows = []
    for name, a, b, embed, head in cases:
        code = (f"from flowspec_p2p.bench.core import rss_child; "
                f"rss_child({path!r}, {a}, {b}, {embed}, {head}, {context})")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        row = {"case": name, "layers": f"[{a}, {b})", **json.loads(out.stdout.strip().splitlines()[-1])}
        row["target_mb"] = row["baseline_mb"] + 1.3 * row["stored_mb"] + row["kv_mb"]
        row["within_target"] = row["peak_mb"] <= row["target_mb"]
        rows.append(row)
    return {"context": context, "rows": rows}


# -------------------------------------------------------------------------------------------------- load


def load_child(path: str | None, way: str, threads: int) -> None:
    """Run in a fresh process: open + dequantise every tensor, ``way`` = ours | gguf-py; print seconds as JSON."""
    import gguf  # imported before timing: both ways need it

    from ..model.weights import default_model_path, open_source

    torch.set_num_threads(threads)

    p = str(path or default_model_path())
    t0 = time.perf_counter()
    if way == "ours":
        src = open_source(p)
        t1 = time.perf_counter()
        for n in src.names():
            src.load(n)
    else:
        reader = gguf.GGUFReader(p, "r")
        t1 = time.perf_counter()
        for t in reader.tensors:
            gguf.quants.dequantize(t.data, t.tensor_type)
    t2 = time.perf_counter()
    sys.stdout.write(json.dumps({"open_s": t1 - t0, "dequantise_s": t2 - t1, "total_s": t2 - t0}) + "\n")


def load_times(path: str | None, repeats: int, progress: bool) -> dict:
    """Open + dequantise, ours vs gguf-py, alternating in fresh processes; then ``flowspec generate`` end to end."""
    threads = torch.get_num_threads()
    if path is not None and not str(path).endswith(".gguf"):
        return {"skipped": "not a GGUF file"}
    samples: dict[str, list[dict]] = {"ours": [], "gguf-py": []}
    for r in _bar(range(repeats), "load", progress):
        for way in ("ours", "gguf-py") if r % 2 == 0 else ("gguf-py", "ours"):
            code = f"from flowspec_p2p.bench.core import load_child; load_child({path!r}, {way!r}, {threads})"
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
            samples[way].append(json.loads(out.stdout.strip().splitlines()[-1]))
    med = {way: {k: statistics.median(s[k] for s in v) for k in v[0]} for way, v in samples.items()}
    cmd = [sys.executable, "-m", "flowspec_p2p", "-q", "generate", "Hi", "--max-tokens", "8"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    if path is not None:
        cmd += ["--model", str(path)]
    e2e = statistics.median(_elapsed(lambda: subprocess.run(cmd, capture_output=True, check=True, env=env))
                            for _ in range(max(1, repeats // 2)))
    return {"median": med, "speedup": med["gguf-py"]["total_s"] / med["ours"]["total_s"], "generate_e2e_s": e2e}


# ------------------------------------------------------------------------------------------------ report


def environment() -> dict:
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "threads": torch.get_num_threads(), "machine": platform.machine(), "processor": platform.processor()}


def markdown(result: dict) -> str:
    """A human-readable summary of whichever parts ``result`` holds."""
    out = ["# bench-core", "", f"`{json.dumps(result.get('environment', {}))}`", ""]
    if s := result.get("speed"):
        m = s["median"]
        out += [f"## Speed ({s['new_tokens']} new tokens, {len(s['rows'])} prompts x {s['repeats']}, medians)", "",
                "| | ours | transformers | ratio |", "|---|---|---|---|",
                f"| decode ms/token | {m['ours_decode_ms']:.1f} | {m['transformers_decode_ms']:.1f} | "
                f"{s['decode_speedup']:.2f}x |",
                f"| prefill tokens/s | {m['ours_prefill_tok_s']:.0f} | {m['transformers_prefill_tok_s']:.0f} | "
                f"{s['prefill_speedup']:.2f}x |", ""]
    if b := result.get("bound"):
        out += ["## What bounds decode", "",
                f"one step {b['step_ms']:.1f} ms; its weight matmuls alone {b['matmuls_ms']:.1f} ms "
                f"({100 * b['matmul_share']:.0f}%), streaming {b['weight_mb_per_token']:.0f} MB at "
                f"{b['matmul_gb_s']:.1f} GB/s (a plain copy reaches {b['copy_gb_s']:.1f} GB/s: floor "
                f"{b['floor_ms_at_copy_bandwidth']:.1f} ms); the other {b['aten_ops_per_step']} aten ops cost "
                f"{b['other_ms_per_op_us']:.1f} us each on average.", ""]
    if a := result.get("agreement"):
        out += [f"## Greedy agreement: {a['identical']}/{a['prompts']} identical ({a['new_tokens']} new tokens)", "",
                f"max |dlogits| vs transformers over prompt + reply: {a['max_abs_dlogits']:.2e} (one forward), "
                f"{a['max_abs_dlogits_decode']:.2e} (decode path: prefill, then one token at a time)", "",
                "| set | line | prompt | ours | transformers | diverged at | top-2 gap (ours / theirs) | max dlogits "
                "(forward / decode) |", "|---|---|---|---|---|---|---|---|"]
        for r in a["rows"]:
            gap = f"{r['ours_top2_gap']:.2e} / {r['transformers_top2_gap']:.2e}" if r["diverged_at"] is not None else ""
            out.append(f"| {r['dataset']} | {r['line']} | {r['prompt_tokens']} | {r['ours_tokens']} | "
                       f"{r['transformers_tokens']} | {r['diverged_at'] if r['diverged_at'] is not None else '-'} | "
                       f"{gap} | {r['max_abs_dlogits']:.2e} / {r['max_abs_dlogits_decode']:.2e} |")
        out.append("")
    if mem := result.get("memory"):
        out += [f"## Peak RSS by range (fresh process each, KV cache for {mem['context']} positions)", "",
                "target: RSS before loading + 1.3 x the range's stored bytes + its KV", "",
                "| case | layers | engine | stored MB | in memory MB | KV MB | RSS before MB | peak RSS MB | "
                "target MB |", "|---|---|---|---|---|---|---|---|---|"]
        out += [f"| {r['case']} | {r['layers']} | {r['engine']} | {r['stored_mb']:.1f} | {r['tensors_mb']:.1f} | "
                f"{r['kv_mb']:.1f} | {r['baseline_mb']:.0f} | {r['peak_mb']:.0f} | {r['target_mb']:.0f}"
                f"{'' if r['within_target'] else ' (over)'} |" for r in mem["rows"]]
        out.append("")
    if (ld := result.get("load")) and "median" in ld:
        o, g = ld["median"]["ours"], ld["median"]["gguf-py"]
        out += ["## Load (open + dequantise every tensor, fresh process, medians)", "",
                "| | open s | dequantise s | total s |", "|---|---|---|---|",
                f"| ours | {o['open_s']:.2f} | {o['dequantise_s']:.2f} | {o['total_s']:.2f} |",
                f"| gguf-py reader + quants (before) | {g['open_s']:.2f} | {g['dequantise_s']:.2f} | "
                f"{g['total_s']:.2f} |", "",
                f"{ld['speedup']:.1f}x faster; `flowspec generate \"Hi\" --max-tokens 8` end to end: "
                f"{ld['generate_e2e_s']:.1f} s", ""]
    return "\n".join(out)


def write_outputs(result: dict, out: Path) -> tuple[Path, Path]:
    return write_json_md(out, "bench_core", result, markdown(result) + "\n")
