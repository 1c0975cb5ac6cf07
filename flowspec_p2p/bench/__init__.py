"""Every benchmark, report and chart: the emulated edge cluster (edge, report, charts), the model core against
transformers (core), the data path (hop), single-device speculation and the tree tuner (single_device), the
engine against llama.cpp on one device (engine, engine_report, llamacpp) and the whole product against llama.cpp's
RPC pipeline (rpc_compare).

A leaf: no product module imports it (only commands/ does). May import every product part.
"""

import json
from collections.abc import Callable
from pathlib import Path

ENGINE_PARTS = ("decode", "rows", "memory")  # what bench-engine measures (engine.py), in run order


def write_json_md(out: Path, stem: str, result: dict, md: str, *, indent: int = 2,
                  default: Callable | None = None) -> tuple[Path, Path]:
    """A benchmark's ``stem.json`` (the result) and ``stem.md`` (its report) in ``out``. -> both paths"""
    out.mkdir(parents=True, exist_ok=True)
    j, m = out / f"{stem}.json", out / f"{stem}.md"
    j.write_text(json.dumps(result, indent=indent, default=default) + "\n")
    m.write_text(md)
    return j, m
