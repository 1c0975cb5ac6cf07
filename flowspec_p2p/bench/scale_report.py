"""bench-scale's report (results.md) from its result (results.json): one section per part, each target with its
figure and whether it is met."""

from __future__ import annotations


def _ok(flag) -> str:
    return "–" if flag is None else ("yes" if flag else "**no**")


def _f(x, digits: int = 1) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def markdown(r: dict) -> str:
    s, m = r["setup"], r["model"]
    lines = ["# A model bigger than any one agent: bench-scale", "", f"`{s['command']}`", "",
             f"Model {m['path']}: {m['name']}, {m['bytes'] / 1e9:.2f} GB, {m['layers']} layers (largest tensor "
             f"{m['largest_tensor_bytes'] / 2**20:.0f} MiB). {s['agents']} agents on this host ({s['cpus']} CPUs, "
             f"{s['ram_gb']} GiB, shared with other work: 1-minute load average {_f(s['load1_start'])} at the start, "
             f"{_f(s.get('load1_end'))} at the end), each offering {s['memory_mb']:g} MB; context {s['context']}, "
             f"{s['max_tokens']} new tokens per greedy request, {s['runs']} interleaved runs (medians).", ""]
    ref = r.get("reference")
    if ref:
        lines += ["## Reference: one process", "", f"`{ref['command']}`: {ref['new_tokens']} tokens at "
                  f"{_f(ref['decode_tokens_per_s'], 2)} tokens/s, peak RSS {ref['peak_rss_mb']:.0f} MiB.", ""]
    fe = r.get("fetch")
    if fe:
        lines += ["## The fetch alone", "", "A keyed weight server process (TLS, sessions, its digests computed "
                  f"before the clock starts) and {len(fe['ranges'])} member processes fetching layers "
                  f"{', '.join(f'[{a}, {b})' for a, b in fe['ranges'])} at once into empty caches (streamed, SHA-256 "
                  "checked, fsync'ed); CPU seconds per GB: each member's process while it fetches, the server's over "
                  "the run.", "", "| run | MB/s in all | each member MB/s | members CPU s/GB | server CPU s/GB | "
                  "load average |", "|---:|---:|---|---:|---:|---:|"]
        for i, x in enumerate(fe["samples"]):
            each = " + ".join(f"{m['mb_s']:.0f}" for m in x["members"])
            lines.append(f"| {i + 1} | {x['mb_s']:.0f} | {each} | "
                         f"{x['member_cpu_s_per_gb']:.2f} | {x['server_cpu_s_per_gb']:.2f} | {x['load1']:.1f} |")
        agg = fe["median_mb_s"]
        lines += [f"| median | **{agg:.0f}** | | {fe['median_member_cpu_s_per_gb']:.2f} | "
                  f"{fe['median_server_cpu_s_per_gb']:.2f} | {fe['median_load1']:.1f} |", "",
                  f"Fetch over loopback, members at once: {agg:.0f} MB/s; target ≥ 300 MB/s: {_ok(agg >= 300)}.", ""]
    st = r.get("startup")
    if st:
        rec = st["recovery"]
        lines += ["## Start to serving", "", f"From starting the agents to serving: **{st['serving_s']:.0f} s** "
                  f"(the leader's own count from its first plan: planning {rec['detect_plan_s']:.1f} s, loading "
                  f"{rec['load_s']:.1f} s, switching {rec['switch_s']:.1f} s).", "", "```", st["plan_text"], "```", "",
                  "| agent | fetched MB | seconds | MB/s | load (fetch + pack + warm-up) s |",
                  "|---|---:|---:|---:|---:|"]
        for i, fs in sorted(st["fetches"].items()):
            load = next((x["load_s"] for x in st["loads"].get(i, []) if x["source"] == "fetched"), None)
            lines.append(f"| agent{i} | {fs[0]['mb']:.0f} | {fs[0]['s']:.1f} | {fs[0]['mb_s']:.0f} | {_f(load)} |")
        agg = st.get("fetch_mb_s_aggregate")
        lines += ["", f"Fetch over loopback (TLS, SHA-256 on the way, fsync before use): {_f(agg, 0)} MB/s served by "
                  f"the leader to its members at once; target ≥ 300 MB/s: {_ok(None if agg is None else agg >= 300)}.",
                  ""]
    for key, title in (("members_loaded", "Memory once loaded"), ("members_served", "Memory after the requests")):
        mem = r.get(key)
        if not mem:
            continue
        lines += [f"## {title}", "", "| agent | layers | layers MiB | KV MiB | runtime MiB | planner's count MiB | RSS "
                  "MiB | RSS ÷ count | peak RSS MiB | bound: runtime + 1.15 × layers + KV | peak within |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for a in mem:
            role = " (leader)" if a["leader"] else ""
            if "layers" not in a:
                lines.append(f"| agent{a['agent']}{role} | – | | | {a['runtime_mb']:.0f} | | {a['rss_mb']:.0f} | | "
                             f"{a['peak_mb']:.0f} | | |")
                continue
            lines.append(f"| agent{a['agent']}{role} | [{a['layers'][0]}, {a['layers'][1]}) | {a['layers_mb']:.0f} | "
                         f"{a['kv_mb']:.0f} | {a['runtime_mb']:.0f} | {a['counted_mb']:.0f} | {a['rss_mb']:.0f} | "
                         f"{a['rss_vs_counted']:.3f} | {a['peak_mb']:.0f} | {_f(a.get('bound_mb'), 0)} | "
                         f"{_ok(a.get('peak_within_bound'))} |")
        lines += ["", "The planner's count: the stage's weights as the engine holds them, KV for the plan's requests, "
                  "activations, and the agent's measured runtime; target: RSS within 10% of it. The peak during load "
                  "against the final RSS plus the largest tensor: " + ", ".join(
                      f"agent{a['agent']} {a['peak_mb']:.0f} ≤ {a['rss_mb'] + a['largest_tensor_mb']:.0f}: "
                      f"{_ok(a['peak_mb'] <= a['rss_mb'] + a['largest_tensor_mb'])}" for a in mem if "layers" in a)
                  + ".", ""]
    d = r.get("decode")
    if d:
        apart = "" if d["together"] else " (no room for both: llama.cpp's side ran after ours had stopped)"
        lines += ["## Decode against llama.cpp's RPC pipeline", "",
                  f"Both sides up at once: {_ok(d['together'])}{apart}. Decode tokens/s (each server's own timing), "
                  "medians; ratios within each run.", "", "| side | decode tokens/s | ÷ llama.cpp RPC |",
                  "|---|---:|---:|"]
        for side in d["sides"]:
            lines.append(f"| {side} | {_f(d['decode_tokens_per_s'][side], 2)} | "
                         f"{_f(d['vs_llama'].get(side), 2) + '×' if d['vs_llama'].get(side) else '–'} |")
        lines += ["", "| side | processes | RSS MiB | sum of peak RSS MiB |", "|---|---:|---:|---:|"]
        for side, mm in d["memory"].items():
            lines.append(f"| {side} | {len(mm['processes'])} | {mm['rss_mb']:.0f} | {mm['peak_mb']:.0f} |")
        lines += ["", f"Our greedy text equals the one-process reference: {_ok(d['equals_reference'])}. "
                  f"Target ≥ 1.5× llama.cpp: {_ok(d['vs_llama'].get('ours-ar', 0) >= 1.5 if d['vs_llama'] else None)} "
                  "(ar).", ""]
        if d.get("llama"):
            lines += [f"llama.cpp: {d['llama']['version']}; {d['llama']['processes']}.", ""]
    rs = r.get("resume")
    if rs and "skipped" not in rs:
        lines += ["## A fetch killed half-way", "", f"The last member killed when it held "
                  f"{rs['held_at_kill_share']:.0%} of its {rs['range_mb']:.0f} MB range, then restarted: it fetched "
                  f"{_f(rs['fetched_after_restart_mb'], 0)} MB "
                  f"({_f(100 * (rs['fetched_after_restart_share'] or 0), 0)}% of the range); target ≤ 55%: "
                  f"{_ok(rs['within_55pct'])}. While it was gone the leader said: "
                  f"{rs['others_alone'] or 'it re-planned without it'}.", ""]
    npl = r.get("no_plan")
    if npl:
        lines += ["## Every agent offering too little", "", f"{s['agents']} agents offering {npl['offered_mb_each']:g} "
                  f"MB each: /health {npl.get('status')} `{npl.get('no_plan')}` after {npl.get('seconds')} s; agents "
                  f"that loaded layers: {npl.get('agents_that_loaded')}.", ""]
    return "\n".join(lines) + "\n"
