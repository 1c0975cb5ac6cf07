"""``flowspec bench``'s PNG charts (matplotlib, Agg backend): per-stage timelines of one request under each mode,
and speedup bars per dataset. Inputs are the records and results of report.py; nothing here measures."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from .report import BASELINES, DATASET_NAMES

log = logging.getLogger(__name__)

MODE_COLORS = {"ar": "#888888", "chunk": "#4c72b0", "pipedec": "#55a868", "flowspec": "#dd8452"}
LEADER_COLOR = "#8172b3"
ZOOM_FORWARDS = 25  # the zoomed timeline spans this many median stage forwards from the decode window's start


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no charts")
        return None
    return plt


def timeline_chart(records: Sequence[dict], path: Path, zoom_s: float | None = None) -> bool:
    """One request (the same prompt) under each mode: rows = the leader's compute and each stage's busy intervals
    over the decode window (``record["timeline"]``, seconds from the window's start). -> written?"""
    records = [r for r in records if r.get("timeline")]
    plt = _pyplot()
    if plt is None or not records:
        return False
    fig, axes = plt.subplots(len(records), 1, figsize=(10, 1.0 + 1.4 * len(records)), sharex=True, squeeze=False)
    for ax, r in zip(axes[:, 0], records, strict=True):
        tl = r["timeline"]
        rows = [("leader", tl.get("leader") or [], LEADER_COLOR)]
        rows += [(f"stage {i + 1}", iv, MODE_COLORS.get(r["mode"], "#c44e52")) for i, iv in enumerate(tl["stages"])]
        for y, (_, iv, color) in enumerate(rows):
            ax.broken_barh([(a, b - a) for a, b in iv], (y - 0.4, 0.8), facecolors=color, linewidth=0)
        ax.set_yticks(range(len(rows)), [name for name, _, _ in rows], fontsize=8)
        ax.invert_yaxis()
        util = r.get("utilization")
        ax.set_title(f"{r['mode']}: {r['new_tokens']} tokens in {r['window_s']:.2f} s decode, stage utilization "
                     f"{'–' if util is None else f'{100 * util:.0f}%'}", fontsize=9, loc="left")
        ax.set_xlim(0, zoom_s or max(rr["window_s"] for rr in records))
    r0 = records[0]
    shown = f", first {zoom_s:.2g} s" if zoom_s else ""
    axes[-1, 0].set_xlabel(f"seconds since the first token (decode window){shown}")
    fig.suptitle(f"busy (bar) / idle (gap) per device: {r0['dataset']} line {r0['line']}, T={r0['temperature']:g}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def speedup_chart(res: dict, path: Path) -> bool:
    """Per temperature: ξ speedup of every non-baseline mode vs chunk and vs ar, per dataset and overall."""
    plt = _pyplot()
    temps = list(res.get("by_temperature") or {})
    if plt is None or not temps:
        return False
    fig, axes = plt.subplots(1, len(temps), figsize=(6.5 * len(temps), 3.6), squeeze=False, sharey=True)
    for ax, t in zip(axes[0], temps, strict=True):
        table = res["by_temperature"][t]["modes"]
        contenders = [m for m in table if m not in BASELINES]
        pairs = [(m, b) for m in contenders for b in BASELINES if b in table]
        datasets = list(next(iter(table.values()))["per_dataset"]) if table else []
        labels = [DATASET_NAMES.get(d, d) for d in datasets] + ["all"]
        width = 0.8 / max(1, len(pairs))
        for k, (m, b) in enumerate(pairs):
            vals = [table[m]["per_dataset"][d][f"speedup_vs_{b}"] or 0.0 for d in datasets]
            vals.append(table[m][f"speedup_vs_{b}"] or 0.0)
            xs = [i + (k - (len(pairs) - 1) / 2) * width for i in range(len(labels))]
            ax.bar(xs, vals, width=width, label=f"{m} vs {b}", color=MODE_COLORS.get(m, "#c44e52"),
                   alpha=1.0 if b == "chunk" else 0.55, edgecolor="black", linewidth=0.4)
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_xticks(range(len(labels)), labels, fontsize=8, rotation=20)
        ax.set_title(f"T = {t}: decode throughput speedup (ξ ratio)", fontsize=10)
        if pairs:
            ax.legend(fontsize=8)
    axes[0, 0].set_ylabel("speedup")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _zoom_s(records: Sequence[dict]) -> float:
    """ZOOM_FORWARDS median stage forwards, at most the shortest decode window."""
    lengths = sorted(b - a for r in records for iv in r["timeline"]["stages"] for a, b in iv)
    shortest = min(r["window_s"] for r in records)
    if not lengths:
        return shortest
    return min(shortest, ZOOM_FORWARDS * lengths[len(lengths) // 2])


def write_charts(out: Path, res: dict, records: Sequence[dict]) -> list[str]:
    """speedup.png, and timeline_T<t>.png (+ _zoom) for the first prompt that has a timeline under several modes.
    -> the files written"""
    written = []
    if speedup_chart(res, out / "speedup.png"):
        written.append("speedup.png")
    by_prompt: dict[tuple, list[dict]] = {}
    for r in records:
        if r.get("timeline") and r.get("ok", True):
            by_prompt.setdefault((f"{float(r['temperature']):g}", r["dataset"], r["line"]), []).append(r)
    done: set[str] = set()
    order = list(res.get("modes") or {})
    for (t, _, _), rs in by_prompt.items():
        if t in done:
            continue
        rs.sort(key=lambda r: order.index(r["mode"]) if r["mode"] in order else len(order))
        done.add(t)
        if timeline_chart(rs, out / f"timeline_T{t}.png"):
            written.append(f"timeline_T{t}.png")
        if timeline_chart(rs, out / f"timeline_T{t}_zoom.png", zoom_s=_zoom_s(rs)):
            written.append(f"timeline_T{t}_zoom.png")
    return written
