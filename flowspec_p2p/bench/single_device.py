"""Single-device speculative decoding, measured on Spec-Bench prompts against autoregressive decoding
(``flowspec bench-spec``); the tree-size tuner is tune.py."""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm

from ..ledger import Ledger, reply_stats
from ..model.engine import Shard
from ..model.generate import ARDecoder, generate_ids
from ..model.sampling import SamplingParams
from ..model.tokenizer import user_prompt
from ..specbench import Question
from ..speculative.auto import AutoDecoder
from ..speculative.decoder import SpecDecoder, SpecFigures
from ..speculative.drafter import TreeDrafter, TreeShape
from . import write_json_md

log = logging.getLogger(__name__)



def _bar(it, progress: bool, desc: str, total: int | None = None):
    return tqdm(it, desc=desc, total=total, disable=not progress, leave=False, dynamic_ncols=True)


def _elapsed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


# -- tuner: forward curve, draft cost, teacher-forced acceptance ------------------------------------------------


def _per_token(stats: Ledger) -> float | None:
    return stats.decode_s / (stats.new_tokens - 1) if stats.new_tokens > 1 else None


def top2_gap(shard: Shard, ids: Sequence[int]) -> float:
    """Top-2 logit gap of the target after ``ids`` (one plain forward): tiny gaps are float near-ties."""
    with torch.inference_mode():
        top = shard.logits(shard(torch.tensor([list(ids)]), None)[0, -1]).topk(2).values
    return float(top[0] - top[1])


def bench(
    shard: Shard,
    drafter: TreeDrafter,
    shape: TreeShape,
    tokenizer,
    prompts: Sequence[Question],
    temperatures: Sequence[float] = (0.0, 1.0),
    max_new_tokens: int = 128,
    seed: int = 0,
    progress: bool = True,
) -> dict:
    """τ per dataset and temperature; spec vs AR tokens/s side by side (T=0, same prompt back to back); draft
    cost per step; greedy equality of spec vs AR with each divergence's reference top-2 gap."""
    spec = SpecDecoder(shard, drafter, shape)
    ar = ARDecoder(shard)
    auto = AutoDecoder(shard, drafter, shape)
    rows = []
    for temp in temperatures:
        for i, bp in enumerate(_bar(prompts, progress, f"T={temp:g}")):
            ids = user_prompt(tokenizer, bp.text)  # a base model: the raw prompt
            params = SamplingParams(temperature=temp, seed=seed + i)
            row = {"dataset": bp.dataset, "line": bp.line, "temperature": temp}
            if temp == 0.0:
                ref, ar_stats = generate_ids(ar, ids, params, max_new_tokens, tokenizer.stop_ids)
                row["ar"] = {**reply_stats(ar_stats), "per_token_s": _per_token(ar_stats)}
            out, st = generate_ids(spec, ids, params, max_new_tokens, tokenizer.stop_ids)
            row["spec"] = reply_stats(st)
            if temp == 0.0:  # auto (the default mode) right after, same prompt
                auto_out, auto_stats = generate_ids(auto, ids, params, max_new_tokens, tokenizer.stop_ids)
                row["auto"] = reply_stats(auto_stats)
                row["auto_equal"] = auto_out == ref
            if temp == 0.0:
                div = next((j for j, (a, b) in enumerate(zip(out, ref, strict=False)) if a != b), None)
                if div is None and len(out) != len(ref):
                    div = min(len(out), len(ref))
                row["equal"] = div is None
                if div is not None:
                    row["divergence"] = {
                        "position": div,
                        "ar_token": ref[div] if div < len(ref) else None,
                        "spec_token": out[div] if div < len(out) else None,
                        "ref_top2_gap": round(top2_gap(shard, ids + ref[:div]), 6),
                    }
                steps = st.steps - 1
                if steps and row["ar"]["per_token_s"]:
                    draft_s = st.figure(SpecFigures).draft_s
                    row["draft_per_step_vs_forward"] = draft_s / steps / row["ar"]["per_token_s"]
                    row["verify_per_step_vs_forward"] = (st.decode_s - draft_s) / steps / row["ar"]["per_token_s"]
            rows.append(row)
    return {
        "config": {
            "tree": shape.model_dump(),
            "max_new_tokens": max_new_tokens,
            "temperatures": list(temperatures),
            "prompts": len(prompts),
            "torch_threads": torch.get_num_threads(),
            "dtype": str(shard.dtype),
        },
        "summary": summarise(rows),
        "rows": rows,
    }


def _tau(rows: list[dict]) -> float | None:
    steps = sum(r["spec"]["steps"] for r in rows)
    return round(sum(r["spec"]["new_tokens"] for r in rows) / steps, 3) if steps else None


def _rate(rows: list[dict], key: str) -> float | None:
    s = sum(r[key]["decode_s"] for r in rows)
    return round(sum(r[key]["new_tokens"] - 1 for r in rows) / s, 3) if s > 0 else None


def summarise(rows: list[dict]) -> dict:
    greedy = [r for r in rows if r["temperature"] == 0.0]
    per_dataset = {}
    for name in dict.fromkeys(r["dataset"] for r in rows):
        mine = [r for r in rows if r["dataset"] == name]
        g = [r for r in mine if r["temperature"] == 0.0]
        per_dataset[name] = {
            **{
                f"tau_T{r:g}": _tau([x for x in mine if x["temperature"] == r])
                for r in dict.fromkeys(x["temperature"] for x in mine)
            },
            "spec_tok_s": _rate(g, "spec"),
            "ar_tok_s": _rate(g, "ar"),
            "auto_tok_s": _rate(g, "auto"),
        }
    ratios = [r["draft_per_step_vs_forward"] for r in greedy if "draft_per_step_vs_forward" in r]
    verify = [r["verify_per_step_vs_forward"] for r in greedy if "verify_per_step_vs_forward" in r]
    spec_rate, ar_rate = _rate(greedy, "spec"), _rate(greedy, "ar")
    return {
        "per_dataset": per_dataset,
        "tau": {
            f"T{t:g}": _tau([r for r in rows if r["temperature"] == t])
            for t in dict.fromkeys(r["temperature"] for r in rows)
        },
        "spec_tok_s": spec_rate,
        "ar_tok_s": ar_rate,
        "speed_ratio": round(spec_rate / ar_rate, 3) if spec_rate and ar_rate else None,
        "auto_tok_s": (auto_rate := _rate(greedy, "auto")),
        "auto_ratio": round(auto_rate / ar_rate, 3) if auto_rate and ar_rate else None,
        "auto_equal": sum(r["auto_equal"] for r in greedy),
        "auto_spec_share": round(sum(r["auto"]["auto"]["spec_tokens"] for r in greedy)
                                 / max(1, sum(r["auto"]["new_tokens"] for r in greedy)), 3) if greedy else None,
        "draft_per_step_vs_forward": round(statistics.median(ratios), 3) if ratios else None,
        "verify_per_step_vs_forward": round(statistics.median(verify), 3) if verify else None,
        "greedy_equal": sum(r["equal"] for r in greedy),
        "greedy_prompts": len(greedy),
        "divergences": [
            {"dataset": r["dataset"], "line": r["line"], **r["divergence"]} for r in greedy if not r["equal"]
        ],
    }


def markdown(result: dict) -> str:
    s, c = result["summary"], result["config"]
    temps = [f"T{t:g}" for t in c["temperatures"]]
    lines = [
        "# Single-device speculative decoding (EAGLE-2 tree) vs autoregressive",
        "",
        f"Tree {c['tree']}, {c['max_new_tokens']} new tokens, {c['prompts']} prompts, {c['dtype']}, "
        f"{c['torch_threads']} torch threads. τ = new tokens / target forwards (prefill and bonus included).",
        "",
        "| dataset | " + " | ".join(f"τ {t}" for t in temps)
        + " | spec tok/s | AR tok/s | spec/AR | auto tok/s | auto/AR |",
        "|---|" + "---|" * len(temps) + "---|---|---|---|---|",
    ]

    def ratio(a, b):
        return round(a / b, 3) if a and b else None

    for name, d in s["per_dataset"].items():
        lines.append(
            f"| {name} | "
            + " | ".join(str(d.get(f"tau_{t}")) for t in temps)
            + f" | {d['spec_tok_s']} | {d['ar_tok_s']} | {ratio(d['spec_tok_s'], d['ar_tok_s'])}"
            + f" | {d['auto_tok_s']} | {ratio(d['auto_tok_s'], d['ar_tok_s'])} |"
        )
    lines.append(
        "| **all** | "
        + " | ".join(f"**{s['tau'].get(t)}**" for t in temps)
        + f" | **{s['spec_tok_s']}** | **{s['ar_tok_s']}** | **{s['speed_ratio']}**"
        + f" | **{s['auto_tok_s']}** | **{s['auto_ratio']}** |"
    )
    lines += [
        "",
        f"- Draft cost per step: **{s['draft_per_step_vs_forward']}×** one target forward (median over prompts); "
        f"the tree verification forward: {s['verify_per_step_vs_forward']}×.",
        f"- Greedy equality (spec vs AR, token for token): **{s['greedy_equal']}/{s['greedy_prompts']}** prompts; "
        f"auto vs AR: **{s['auto_equal']}/{s['greedy_prompts']}**.",
        f"- auto (the default mode: speculative steps while they measure faster, else AR steps) ran "
        f"{s['auto_spec_share']} of its tokens in speculative steps.",
    ]
    for d in s["divergences"]:
        lines.append(
            f"  - {d['dataset']} line {d['line']}: position {d['position']}, AR {d['ar_token']} vs spec "
            f"{d['spec_token']}, reference top-2 logit gap {d['ref_top2_gap']}"
        )
    return "\n".join(lines) + "\n"


def write_outputs(out: Path, stem: str, result: dict, md: str) -> None:
    write_json_md(out, stem, result, md, indent=1, default=_json_default)


def _json_default(x):
    if isinstance(x, TreeShape):
        return x.model_dump()
    if hasattr(x, "__dataclass_fields__"):
        return asdict(x)
    raise TypeError(type(x))
