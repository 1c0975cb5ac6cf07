"""``flowspec bench-engine``'s arithmetic and report: medians of the interleaved samples (engine.py), ratios paired
within a repeat, n-row costs relative to one row, peak RSS against the runtime baseline and the file, the issue's
targets, and results.json / results.md. Sizes are MiB (the ``*_mb`` fields count 2**20 bytes)."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from . import write_json_md

LLAMA = "llama.cpp"
# The engine issue's targets (docs/experiments.md): decode >= 1.0x llama.cpp's; an n-row forward <= these multiples
# of one row; flowspec generate's peak RSS <= baseline + this many times the GGUF file.
DECODE_TARGET = 1.0
ROW_TARGETS = {8: 1.3, 16: 1.6}
MEMORY_TARGET = 1.5


def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def decode_summary(samples: Sequence[dict]) -> dict[str, dict]:
    """{threads: {"tokens_per_s": {engine: median}, "tau": {...}, "draft_share": {...}, "vs_llama": {ours: median
    of per-repeat ours / llama.cpp}, "vs_llama_range": {ours: [min, max] of those}, "spec_vs_ar": median of
    per-repeat spec / ar}}"""
    by: dict[int, dict[str, dict[int, dict]]] = defaultdict(lambda: defaultdict(dict))
    for s in samples:
        if s["part"] == "decode":
            by[s["threads"]][s["engine"]][s["repeat"]] = s
    out = {}
    for t, engines in sorted(by.items()):
        def ratios(a: str, b: str, engines=engines) -> list[float]:
            reps = engines.get(a, {}).keys() & engines.get(b, {}).keys()
            return [engines[a][r]["tokens_per_s"] / engines[b][r]["tokens_per_s"] for r in sorted(reps)]

        ours = [e for e in engines if e != LLAMA]
        out[str(t)] = {
            "tokens_per_s": {e: _median([s["tokens_per_s"] for s in v.values()]) for e, v in engines.items()},
            "tau": {e: _median([s["tau"] for s in v.values()]) for e, v in engines.items() if e != LLAMA},
            "draft_share": {e: _median([s["draft_share"] for s in v.values() if "draft_share" in s])
                            for e, v in engines.items() if any("draft_share" in s for s in v.values())},
            "vs_llama": {e: _median(ratios(e, LLAMA)) for e in ours} if LLAMA in engines else {},
            "vs_llama_range": {e: [min(r), max(r)] for e in ours if (r := ratios(e, LLAMA))},
            "spec_vs_ar": _median(ratios("ours-spec", "ours-ar")),
            "repeats": max(len(v) for v in engines.values()),
        }
    return out


def rows_summary(samples: Sequence[dict]) -> dict[str, dict]:
    """{threads: {engine: {n: {"ms": median, "relative": median(n) / median(1)}}}} (relative: None without n = 1)"""
    by: dict[int, dict[str, dict[int, list[float]]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for s in samples:
        if s["part"] == "rows":
            by[s["threads"]][s["engine"]][s["n"]].append(s["seconds"])
    out: dict[str, dict] = {}
    for t, engines in sorted(by.items()):
        out[str(t)] = {}
        for e, per_n in engines.items():
            med = {n: statistics.median(v) for n, v in sorted(per_n.items())}
            one = med.get(1)
            out[str(t)][e] = {str(n): {"ms": m * 1e3, "relative": m / one if one else None} for n, m in med.items()}
    return out


def memory_summary(memory: Sequence[dict], file_mb: float) -> dict:
    """Peak RSS per process with, for ours, what it holds above the runtime baseline in multiples of the file."""
    base = next((m["peak_mb"] for m in memory if m["name"] == "baseline" and m["returncode"] == 0), None)
    rows = []
    for m in memory:
        if m["name"] == "baseline":
            continue
        row = {"name": m["name"], "threads": m["threads"], "peak_mb": m["peak_mb"], "ok": m["returncode"] == 0,
               "x_file": m["peak_mb"] / file_mb}
        if m["name"].startswith("ours-") and base is not None:
            row["over_baseline_mb"] = m["peak_mb"] - base
            row["over_baseline_x_file"] = (m["peak_mb"] - base) / file_mb
        rows.append(row)
    return {"baseline_mb": base, "file_mb": file_mb, "rows": rows}


def decode_loads(res: dict) -> list[float]:
    return [x["load1"] for x in res.get("samples", []) if x["part"] == "decode" and "load1" in x]


def summarize(setup: dict, measured: dict) -> dict:
    return {"setup": setup, "summary": {"decode": decode_summary(measured["samples"]),
                                        "rows": rows_summary(measured["samples"]),
                                        "memory": memory_summary(measured["memory"], setup["file_mb"])},
            **measured}


# ------------------------------------------------------------------------------------------------ markdown


def _f(v, fmt: str = ".1f", suffix: str = "") -> str:
    return "–" if v is None else f"{v:{fmt}}{suffix}"


def _decode_md(dec: dict, has_llama: bool) -> list[str]:
    engines = sorted({e for d in dec.values() for e in d["tokens_per_s"]}, key=lambda e: (e == LLAMA, e))
    head = "| threads | " + " | ".join(f"{e} tok/s" for e in engines) + " |"
    head += "".join(f" {e} ÷ llama.cpp |" for e in engines if e != LLAMA and has_llama)
    head += " spec ÷ ar | τ (spec) | drafting (spec) |"
    cols = head.count("|") - 1
    out = [head, "|" + "---:|" * cols]
    for t, d in dec.items():
        row = f"| {t} | " + " | ".join(_f(d["tokens_per_s"].get(e)) for e in engines) + " |"
        row += "".join(f" **{_f(d['vs_llama'].get(e), '.2f', '×')}** |" for e in engines if e != LLAMA and has_llama)
        share = d.get("draft_share", {}).get("ours-spec")
        row += f" {_f(d['spec_vs_ar'], '.2f', '×')} | {_f(d['tau'].get('ours-spec'), '.2f')} |"
        row += f" {_f(None if share is None else 100 * share, '.0f', '%')} |"
        out.append(row)
    spread = [f"{t} thread(s): {e} {lo:.2f}–{hi:.2f}×" for t, d in dec.items()
              for e, (lo, hi) in d.get("vs_llama_range", {}).items()]
    if spread:
        out += ["", "Per-repeat ratios to llama.cpp, lowest–highest: " + "; ".join(spread) + "."]
    return out


def _rows_md(rows: dict) -> list[str]:
    out = []
    for t, engines in rows.items():
        names = [e for e in ("ours-layers", "ours-head-last", "ours-head-all", LLAMA) if e in engines]
        ns = sorted({int(n) for e in names for n in engines[e]})
        out += [f"{t} thread(s): ms per forward (× one row's)", "",
                "| n | " + " | ".join(names) + " |", "|" + "---:|" * (len(names) + 1)]
        for n in ns:
            cells = [engines[e].get(str(n)) for e in names]
            out.append(f"| {n} | " + " | ".join("–" if c is None else f"{c['ms']:.2f} ({_f(c['relative'], '.2f')}×)"
                                                  for c in cells) + " |")
        out.append("")
    return out


def _memory_md(mem: dict) -> list[str]:
    out = [f"Runtime baseline (python + torch + transformers + flowspec_p2p imported): "
           f"{_f(mem['baseline_mb'], '.0f')} MiB; the GGUF file: {mem['file_mb']:.1f} MiB.", "",
           "| process | threads | peak RSS MiB | × file | above baseline MiB | above baseline × file |",
           "|---|---:|---:|---:|---:|---:|"]
    for r in mem["rows"]:
        flag = "" if r["ok"] else " (failed)"
        out.append(f"| {r['name']}{flag} | {r['threads']} | {r['peak_mb']:.0f} | {r['x_file']:.2f} | "
                   f"{_f(r.get('over_baseline_mb'), '.0f')} | {_f(r.get('over_baseline_x_file'), '.2f')} |")
    return out


def targets(summary: dict) -> list[str]:
    """The engine issue's targets, each with what this run measured."""
    out = []
    for t, d in summary["decode"].items():
        v = d["vs_llama"].get("ours-ar")
        if v is not None:
            out.append(f"- decode, {t} thread(s): ours-ar ÷ llama.cpp {v:.2f}× (target ≥ {DECODE_TARGET:.1f}×): "
                       f"{'met' if v >= DECODE_TARGET else 'not met'}")
    for t, engines in summary["rows"].items():
        for n, limit in ROW_TARGETS.items():
            c = engines.get("ours-head-last", {}).get(str(n))
            if c and c["relative"] is not None:
                out.append(f"- n = {n} rows, {t} thread(s): {c['relative']:.2f}× one row (target ≤ {limit}×): "
                           f"{'met' if c['relative'] <= limit else 'not met'}")
    for r in summary["memory"]["rows"]:
        if (x := r.get("over_baseline_x_file")) is not None:
            out.append(f"- {r['name']} peak RSS, {r['threads']} thread(s): baseline + {x:.2f}× the file (target ≤ "
                       f"{MEMORY_TARGET}×): {'met' if x <= MEMORY_TARGET else 'not met'}")
    return out


def markdown(res: dict) -> str:
    s, summ = res["setup"], res["summary"]
    has_llama = s.get("llama_bench") is not None
    out = ["# bench-engine", "", f"`{s['command']}`", "",
           f"Model {s['model_name']} ({s['file_mb']:.1f} MiB), our engine: {s['engine']}; prompt {s['prompt_label']} "
           f"({s['prompt_tokens']} tokens, {s.get('prompt_form', 'chat template')}), {s['tokens']} decoded tokens "
           "per run, greedy, EOS ignored; "
           f"tree {s['tree']}; {s['repeats']} interleaved repeats, medians.",
           "llama.cpp: " + (f"`{s['llama_bench']}` (build {s.get('llama_build', '?')}), tg-{s['tokens']} and pp-n at "
                            f"depth {s['prompt_tokens']} (the prompt's length)." if has_llama else
                            "no llama-bench binary was given or found on PATH: ours alone."), ""]
    if load := res.get("load"):
        during = _f(_median(decode_loads(res)), ".1f")
        out[-1:-1] = [f"Host load (1-minute average, {s.get('cpus', '?')} CPUs, other work included): "
                      f"{load['start']:.1f} at the start, {load['end']:.1f} at the end, {during} median over the "
                      "decode runs."]
    if summ["decode"]:
        out += ["## Decode tokens/s (prefill excluded)", "", *_decode_md(summ["decode"], has_llama), "",
                "Ratios are medians of the ratios within each repeat.", ""]
    if summ["rows"]:
        out += ["## An n-row forward against one row", "",
                f"Ours: all {s['num_layers']} layers over an n-node draft tree ({s['tree_fanout']}-ary, tree mask) "
                "after the prompt; `head-last`: then the LM head on the last row (what llama-bench's pp-n computes); "
                "`head-all`: on every row. llama.cpp: pp-n (causal) at the same depth.", "", *_rows_md(summ["rows"])]
    if summ["memory"]["rows"]:
        out += ["## Peak RSS (fresh processes)", "", *_memory_md(summ["memory"]), ""]
    if t := targets(summ):
        out += ["## The engine issue's targets", "", *t, ""]
    return "\n".join(out)


def write_outputs(out: Path, res: dict) -> tuple[Path, Path]:
    return write_json_md(out, "results", res, markdown(res) + "\n")
