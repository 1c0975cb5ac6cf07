"""``flowspec plan``: preview the plan for a set of agent profiles (agents/*.toml), and write golden plans."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ConfigError
from . import add_engine_argument

if TYPE_CHECKING:
    from ..cluster.plans import Device

log = logging.getLogger(__name__)
MB = 1024 * 1024


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="preview how a model would be split across devices",
        description="Plan the pipeline for the devices described by agent profiles (TOML files such as "
        "agents/leader.toml; exactly one must say leader = true) and print it. Values missing from a profile's "
        "[profile] table are measured on this host. --out writes the plan as JSON (a golden plan).",
    )
    p.add_argument("profiles", nargs="+", type=Path, help="agent profile TOML files")
    p.add_argument("--model", default=None, help="GGUF file, HF folder or model name (default: SmolLM2-135M)")
    p.add_argument("--context", type=int, default=2048, help="KV cache tokens per request (default 2048)")
    p.add_argument("--tokens-per-step", type=int, default=16, help="segment size (default 16; 1 = autoregressive)")
    p.add_argument("--stages", type=int, default=None, help="force exactly N layer-holding stages")
    p.add_argument("--leader-layers", choices=["auto", "always", "never"], default="auto",
                   help="may the leader also hold layers (default auto; never = FlowSpec's layout)")
    add_engine_argument(p, "the engine whose memory the plan counts")
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of the table")
    p.add_argument("--out", type=Path, default=None, help="write devices, model, options, plan and rendering here")
    p.set_defaults(func=run)


def device_from_profile(path: Path) -> Device:
    from .. import config as config_mod  # here: the planner's modules stay unimported for the other commands
    from ..cluster.plans import Device
    from ..cluster.profile import measure

    cfg = config_mod.load(path)
    o = cfg.profile
    measured = None
    if o.memory_mb is None or o.gflops is None:
        measured = measure(threads=cfg.threads)
    return Device(
        id=cfg.name or path.stem,
        memory_bytes=int(o.memory_mb * MB) if o.memory_mb is not None else measured.memory_bytes,
        gflops=o.gflops if o.gflops is not None else measured.gflops,
        link_mbps=o.link_mbps,
        latency_ms=o.latency_ms or 0.0,
        leader=cfg.leader,
    )


def run(args: argparse.Namespace) -> int:
    from ..cluster.planner import plan
    from ..cluster.plans import PlanOptions, describe_model, render
    from ..model.load import get_engine
    from ..model.weights import open_source

    devices = [device_from_profile(p) for p in args.profiles]
    if sum(d.leader for d in devices) != 1:
        raise ConfigError("exactly one profile must say leader = true")
    source = open_source(args.model)
    model = describe_model(source, get_engine(args.engine), context=args.context)
    opts = PlanOptions(tokens_per_step=args.tokens_per_step, stages=args.stages, leader_layers=args.leader_layers)
    result = plan(devices, model, opts)
    text = render(result, devices)
    sys.stdout.write((result.model_dump_json(indent=2) if args.json else text) + "\n")
    if args.out is not None:
        golden = {
            "devices": [d.model_dump(mode="json") for d in devices],
            "model": model.model_dump(mode="json"),
            "options": opts.model_dump(mode="json"),
            "plan": result.model_dump(mode="json"),
            "rendering": text,
        }
        args.out.write_text(json.dumps(golden, indent=1) + "\n")
        log.info("wrote %s", args.out)
    return 0
