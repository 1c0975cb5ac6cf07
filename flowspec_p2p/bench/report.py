"""``flowspec bench``'s arithmetic and reports: pure functions from per-request records to results.json and
results.md (no I/O but ``write_reports``, no cluster, no torch).

Glossary (flowspec-algorithm.md §8.1):

    record        one finished request: (dataset, line, turn, mode, temperature) with the leader's stats, the decode
                  window and each stage's busy seconds within it (``edge.py`` writes one JSON line per record); a
                  later turn of a conversation is a request of its own, after the mode's earlier replies
    decode window [decode_started_at, decode_finished_at] in time.time(): from the first token (prefill done) to
                  the last, as the leader's mode measures ``decode_s``
    ξ             ``tokens_per_s`` = Σ new tokens / Σ decode_s (prefill excluded), the paper's throughput
    e2e           ``e2e_tokens_per_s`` = Σ new tokens / Σ (prefill_s + decode_s)
    tau           Σ new tokens / Σ steps, each mode's own step count (ar: one token per step; chunk: per tree round;
                  flowspec: per returned segment), prefill counted as a step; so tau is *not* comparable across
                  modes. ``tokens_per_round`` = Σ (new tokens - 1) / Σ verification rounds (chunk: tree rounds;
                  flowspec: walks, one per decided token) is the paper's "accepted length per round" + 1
    utilization   per stage: busy seconds inside the decode window / the window; a mode's utilization is the mean
                  over stages, time-weighted over requests: Σ busy / (stages x Σ window). Busy includes the emulated
                  slowdown wait (the stage is a device that is still computing)
    forward ms    ``stage_forward_ms``: a stage's mean compute per forward (the emulated wait excluded). Modes that
                  keep several stages busy at once pay more per forward when the host's cores are contended: compare
                  it across modes to see whether the emulation held (it should barely depend on the mode)
    paired        only requests (prompt and turn) that every mode finished (at that temperature) count, so modes
                  are compared on the same requests; ``prompts`` counts them
    speedup       ξ(mode) / ξ(baseline), per temperature, overall and per dataset
    walk costs    ``walk_costs_ms`` (pipelined tree modes): mean time from a walk to the next by the first walk's
                  outcome (flowstate.WalkClock), and a live segment's mean trip round the ring

Greedy equality: at T=0 every lossless mode's token ids must equal ``ar``'s; the report counts matching prompts per
mode (each turn counted) and shows the first divergence.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path

from . import write_json_md

BASELINES = ("chunk", "ar")  # speedups are reported against these
MODE_ORDER = ("ar", "chunk", "pipedec", "flowspec")  # table order; unknown modes follow, by name
# mode-specific stats extras summed over requests (diagnostics: where the work went)
EXTRA_SUMS = ("draft_s", "verify_s", "segments", "nodes_sent", "nodes_returned", "nodes_dead", "walks", "continues",
              "continues_unsent", "restarts", "trip_s", "trips", "continue_gap_s", "continue_gaps",
              "continue_unsent_gap_s", "continue_unsent_gaps", "restart_gap_s", "restart_gaps")
# means over those sums, shown instead of them: what a walk outcome costs (time to the next walk, flowstate.WalkClock)
# and a live segment's trip round the ring
EXTRA_MEANS = {"ms after continue": ("continue_gap_s", "continue_gaps"),
               "ms after unsent continue": ("continue_unsent_gap_s", "continue_unsent_gaps"),
               "ms after restart": ("restart_gap_s", "restart_gaps"),
               "live trip ms": ("trip_s", "trips")}
DATASET_NAMES = {"mt_bench": "MT-bench", "humaneval": "HumanEval", "gsm8k": "GSM8K", "alpaca": "Alpaca",
                 "sum": "CNN/DM", "qa": "Nat. Q."}


def temp_key(t: float) -> str:
    """0.0 -> "0", 1.0 -> "1", 0.7 -> "0.7" (the keys of ``by_temperature``)."""
    return f"{float(t):g}"


def order_modes(names: Iterable[str]) -> list[str]:
    names = list(dict.fromkeys(names))
    known = [m for m in MODE_ORDER if m in names]
    return known + sorted(m for m in names if m not in MODE_ORDER)


# ------------------------------------------------------------------------------------------ per request


def busy_within(intervals: Iterable[Sequence[float]], start: float, end: float) -> float:
    """Seconds of ``intervals`` ([a, b] pairs, may overlap the window's edges) inside [start, end]."""
    return sum(max(0.0, min(b, end) - max(a, start)) for a, b in intervals)


def clip(intervals: Iterable[Sequence[float]], start: float, end: float) -> list[list[float]]:
    """The parts of ``intervals`` inside [start, end], relative to ``start`` (for timeline charts)."""
    out = []
    for a, b in intervals:
        a, b = max(a, start), min(b, end)
        if b > a:
            out.append([round(a - start, 6), round(b - start, 6)])
    return out


def stage_utilization(stage_intervals: Sequence[Iterable[Sequence[float]]], start: float, end: float
                      ) -> tuple[float, list[float]]:
    """-> (mean busy fraction over stages, busy seconds per stage) within the window [start, end]."""
    window = end - start
    busy = [busy_within(iv, start, end) for iv in stage_intervals]
    if window <= 0 or not busy:
        return 0.0, busy
    return sum(busy) / (len(busy) * window), busy


def seed_for(dataset: str, line: int) -> int:
    """A fixed sampling seed per prompt (the same for every mode and temperature), stable across runs."""
    import zlib

    return zlib.crc32(f"{dataset}:{line}".encode()) & 0x7FFFFFFF


def record_key(r: dict) -> tuple[str, str, int, str, int]:
    return temp_key(r["temperature"]), r["dataset"], int(r["line"]), r["mode"], int(r.get("turn", 0))


def prompt_key(r: dict) -> tuple[str, int, int]:
    """Which request of a temperature's run this is, across modes: (dataset, line, turn)."""
    return r["dataset"], int(r["line"]), int(r.get("turn", 0))


# ------------------------------------------------------------------------------------------- aggregates


def _div(a: float, b: float) -> float | None:
    return round(a / b, 4) if b > 0 else None


def _rounds(r: dict) -> int:
    """Verification rounds of a request (see ``tokens_per_round`` in the module docstring)."""
    extra = r.get("stats") or {}
    if "walks" in extra:
        return int(extra["walks"])
    return max(0, int(r["steps"]) - 1)


def metrics(records: Sequence[dict]) -> dict:
    """The aggregate metrics of some records of one mode (see the module docstring)."""
    tokens = sum(r["new_tokens"] for r in records)
    decode = sum(r["decode_s"] for r in records)
    prefill = sum(r["prefill_s"] for r in records)
    steps = sum(r["steps"] for r in records)
    rounds = sum(_rounds(r) for r in records)
    window = sum(r["window_s"] for r in records)
    n_stages = max((len(r["stage_busy_s"]) for r in records), default=0)
    per_stage = [sum(r["stage_busy_s"][s] for r in records if s < len(r["stage_busy_s"])) for s in range(n_stages)]
    leader = sum(r.get("leader_busy_s") or 0.0 for r in records)
    forwards = sum(sum(r.get("stage_forwards") or ()) for r in records)
    compute = sum(sum(r.get("stage_compute_s") or ()) for r in records if r.get("stage_forwards"))
    extras = {k: round(sum((r.get("stats") or {}).get(k, 0) for r in records), 4) for k in EXTRA_SUMS
              if any(k in (r.get("stats") or {}) for r in records)}
    return {
        "tokens_per_s": _div(tokens, decode),
        "e2e_tokens_per_s": _div(tokens, prefill + decode),
        "tau": _div(tokens, steps),
        "tokens_per_round": _div(tokens - len(records), rounds),
        "utilization": _div(sum(per_stage), n_stages * window) if n_stages else None,
        "stage_utilization": [_div(b, window) for b in per_stage],
        "leader_utilization": _div(leader, window),
        "prompts": len(records),
        "new_tokens": tokens,
        "decode_s": round(decode, 4),
        "prefill_s": round(prefill, 4),
        "stage_forward_ms": round(1e3 * compute / forwards, 2) if forwards else None,
        "extras": extras,
        "walk_costs_ms": {name: round(1e3 * extras[s] / extras[n], 1) for name, (s, n) in EXTRA_MEANS.items()
                          if extras.get(n)},
    }


def paired(records: Sequence[dict], modes: Sequence[str]) -> list[dict]:
    """The successful records of prompts that every one of ``modes`` finished (one temperature's records)."""
    by_prompt: dict[tuple, dict[str, dict]] = {}
    for r in records:
        if r.get("ok", True):
            by_prompt.setdefault(prompt_key(r), {})[r["mode"]] = r
    return [rs[m] for rs in by_prompt.values() if all(m in rs for m in modes) for m in modes]


def add_speedups(table: dict[str, dict]) -> None:
    """Add ``speedup_vs_<baseline>`` (ξ ratio) to each mode's entry of ``table`` (mode -> metrics), in place."""
    for base in BASELINES:
        ref = (table.get(base) or {}).get("tokens_per_s")
        for m in table.values():
            m[f"speedup_vs_{base}"] = _div(m["tokens_per_s"], ref) if ref and m["tokens_per_s"] else None


def summarize(records: Sequence[dict], modes: Sequence[str], datasets: Sequence[str]) -> dict:
    """One temperature's records -> {mode: metrics + speedups + per_dataset: {dataset: metrics + speedups}}."""
    both = paired(records, modes)
    out = {m: metrics([r for r in both if r["mode"] == m]) for m in modes}
    add_speedups(out)
    per_ds = {}
    for ds in datasets:
        table = {m: metrics([r for r in both if r["mode"] == m and r["dataset"] == ds]) for m in modes}
        add_speedups(table)
        per_ds[ds] = table
    for m in modes:
        out[m]["per_dataset"] = {ds: per_ds[ds][m] for ds in datasets}
        out[m]["failed"] = sum(1 for r in records if r["mode"] == m and not r.get("ok", True))
    return out


def greedy_equality(records: Sequence[dict], modes: Sequence[str], reference: str = "ar") -> dict:
    """At T=0: per mode, how many prompts' token ids equal the reference mode's, and the first divergence."""
    greedy = [r for r in records if float(r["temperature"]) == 0.0 and r.get("ok", True) and "token_ids" in r]
    ref = {prompt_key(r): r["token_ids"] for r in greedy if r["mode"] == reference}
    out = {}
    for m in modes:
        if m == reference or not ref:
            continue
        compared = matching = 0
        first = None
        for r in greedy:
            if r["mode"] != m or prompt_key(r) not in ref:
                continue
            a, b = ref[prompt_key(r)], r["token_ids"]
            compared += 1
            if a == b:
                matching += 1
            elif first is None:
                pos = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
                first = {"dataset": r["dataset"], "line": r["line"], "turn": r.get("turn", 0), "position": pos,
                         reference: a[pos : pos + 4], m: b[pos : pos + 4], f"{reference}_tokens": len(a),
                         f"{m}_tokens": len(b)}
        out[m] = {"matching": matching, "compared": compared, "first_divergence": first}
    return out


def results(setup: dict, records: Sequence[dict], modes: Sequence[str] | None = None) -> dict:
    """The whole results.json: setup, top-level ``modes`` (T=0 if run, else the first temperature),
    ``by_temperature`` {"0": {"modes": ...}, ...}, ``greedy_equality``, ``timeline_prompt``."""
    modes = order_modes(modes or setup.get("modes") or [r["mode"] for r in records])
    temps = [float(t) for t in setup.get("temperatures") or sorted({float(r["temperature"]) for r in records})]
    datasets = list(setup.get("datasets") or dict.fromkeys(r["dataset"] for r in records))
    by_t = {}
    for t in temps:
        rs = [r for r in records if temp_key(r["temperature"]) == temp_key(t)]
        by_t[temp_key(t)] = {"modes": summarize(rs, modes, datasets)}
    top = temp_key(0.0) if temp_key(0.0) in by_t else (temp_key(temps[0]) if temps else None)
    return {
        "setup": dict(setup),
        "modes": by_t[top]["modes"] if top is not None else {},
        "modes_temperature": top,
        "by_temperature": by_t,
        "greedy_equality": greedy_equality(records, modes),
        "records": len(records),
        "failed": sum(1 for r in records if not r.get("ok", True)),
    }


# ---------------------------------------------------------------------------------------------- markdown


def _f(v, fmt: str = ".2f", suffix: str = "") -> str:
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:{fmt}}{suffix}"


def _pct(v) -> str:
    return "–" if v is None else f"{100 * v:.0f}%"


def markdown(res: dict) -> str:
    s = res["setup"]
    lines = ["# flowspec bench: decoding modes side by side on an emulated edge cluster", ""]
    if s.get("emulation"):
        lines += [f"> {s['emulation']}", ""]
    if s.get("agent_links"):
        lines += [f"> Agent links: {s['agent_links']}.", ""]
    load, cores = s.get("load_average"), s.get("host_cores")
    if load is not None and cores and load > cores / 2:
        lines += [f"> **Warning:** the host's load average was {load:g} on {cores} cores at the start (other work): "
                  "devices contended for cores, which penalises the modes that compute on several stages at once "
                  "(compare `stage forward ms` across modes); raise --slowdown or run on an idle host.", ""]
    for t, block in res["by_temperature"].items():
        table = block["modes"]
        modes = list(table)
        n = max((m["prompts"] for m in table.values()), default=0)
        lines += [f"## T = {t} ({n} requests per mode, {s.get('max_tokens', '?')} max new tokens)", "",
                  "| mode | tokens/s (ξ, decode) | e2e tokens/s | tau | tokens/round | utilization | per stage | "
                  "leader busy | vs chunk | vs ar |",
                  "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
        for name, m in table.items():
            stages = " ".join(_pct(u) for u in m.get("stage_utilization") or [])
            lines.append(f"| {name} | {_f(m['tokens_per_s'])} | {_f(m['e2e_tokens_per_s'])} | {_f(m['tau'])} | "
                         f"{_f(m['tokens_per_round'])} | {_pct(m['utilization'])} | {stages} | "
                         f"{_pct(m.get('leader_utilization'))} | {_f(m['speedup_vs_chunk'], '.2f', 'x')} | "
                         f"{_f(m['speedup_vs_ar'], '.2f', 'x')} |")
        lines += ["", *_dataset_table(table, modes), "", *_diagnostics(table), ""]
    eq = res.get("greedy_equality") or {}
    if eq:
        lines += ["## Greedy equality (T = 0, token ids vs ar)", "", "| mode | same as ar | first divergence |",
                  "|---|---:|---|"]
        for m, e in eq.items():
            d = e["first_divergence"]
            where = "–" if d is None else (f"{d['dataset']} line {d['line']}, token {d['position']}: ar "
                                           f"{d.get('ar')} vs {d.get(m)}")
            lines.append(f"| {m} | {e['matching']}/{e['compared']} | {where} |")
        lines.append("")
    lines += ["## Setup", ""]
    for k, v in s.items():
        if k in ("emulation", "plan_text"):
            continue
        lines.append(f"- {k}: {json.dumps(v) if isinstance(v, dict | list) else v}")
    if s.get("plan_text"):
        lines += ["", "```", s["plan_text"].rstrip(), "```"]
    lines += ["", "Definitions: ξ = Σ new tokens / Σ decode time (prefill excluded, as the paper); e2e includes "
              "prefill; tau = new tokens / the mode's own steps (not comparable across modes); tokens/round = "
              "(new tokens - 1) / verification rounds; utilization = mean over stages of the busy fraction of the "
              "decode window (emulated slowdown included); ms after continue / unsent continue / restart = mean "
              "time from a walk with that outcome to the next walk (a continue to a child already in flight, to one "
              "not yet sent, a fresh root); live trip ms = mean time from sending a segment to its return, for "
              "segments that came back with live nodes; only prompts every mode finished are counted.", ""]
    return "\n".join(lines)


def _diagnostics(table: dict[str, dict]) -> list[str]:
    hidden = {k for pair in EXTRA_MEANS.values() for k in pair}
    keys = [k for k in EXTRA_SUMS if k not in hidden and any(k in (m.get("extras") or {}) for m in table.values())]
    means = [k for k in EXTRA_MEANS if any(k in (m.get("walk_costs_ms") or {}) for m in table.values())]
    lines = ["| mode | stage forward ms | prompt prefill s | " + " | ".join(keys + means) + " |",
             "|---|---:|---:|" + "---:|" * len(keys + means)]
    for name, m in table.items():
        ex, costs = m.get("extras") or {}, m.get("walk_costs_ms") or {}
        prefill = m["prefill_s"] / m["prompts"] if m["prompts"] else None
        cells = [_f(m.get("stage_forward_ms"), ".1f"), _f(prefill), *(_f(ex.get(k), "g") for k in keys),
                 *(_f(costs.get(k), ".0f") for k in means)]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _dataset_table(table: dict[str, dict], modes: list[str]) -> list[str]:
    contenders = [m for m in modes if m not in BASELINES]
    bases = [b for b in BASELINES if b in table]
    cols = [(m, b) for m in contenders for b in bases]
    head = "| dataset | " + " | ".join(f"{m} ξ" for m in modes)
    head += "".join(f" | {m} vs {b}" for m, b in cols) + " |"
    lines = [head, "|---|" + "---:|" * (len(modes) + len(cols))]
    datasets = list(next(iter(table.values()))["per_dataset"]) if table else []
    for ds in datasets:
        row = [table[m]["per_dataset"][ds] for m in modes]
        cells = [_f(r["tokens_per_s"]) for r in row]
        cells += [_f(table[m]["per_dataset"][ds][f"speedup_vs_{b}"], ".2f", "x") for m, b in cols]
        lines.append(f"| {DATASET_NAMES.get(ds, ds)} | " + " | ".join(cells) + " |")
    cells = [_f(table[m]["tokens_per_s"]) for m in modes]
    cells += [_f(table[m][f"speedup_vs_{b}"], ".2f", "x") for m, b in cols]
    lines.append("| **all** | " + " | ".join(cells) + " |")
    return lines


def write_reports(out: Path, res: dict) -> None:
    """results.json and results.md in ``out``."""
    write_json_md(out, "results", res, markdown(res))
