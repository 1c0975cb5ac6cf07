"""``flowspec agent``: run one agent of a cluster on this device (a member, or with --leader the one serving the
API)."""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import logging
import signal
from pathlib import Path
from typing import TYPE_CHECKING

from .. import env
from . import add_engine_argument, run_async
from .activity import show_activity

if TYPE_CHECKING:
    from ..config import AgentConfig

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "agent",
        help="run an agent of a cluster on this device",
        description="Start an agent: it measures what this device can offer, advertises it over mDNS, finds the "
        "other agents of its cluster and runs whatever pipeline stage the leader plans for it. One agent per "
        "cluster runs with --leader: it plans, serves the weights and the OpenAI-compatible API. Every link between "
        "agents is TLS, mutually authenticated with the cluster key: the leader makes one on its first start and "
        f"prints the line members need (${env.CLUSTER_KEY}); --insecure runs an open cluster instead.",
    )
    p.add_argument("--config", type=Path, default=None, help="agent profile TOML (e.g. agents/leader.toml)")
    p.add_argument("--cluster", default=None, help="cluster name (default 'default')")
    p.add_argument("--name", default=None, help="a label for this device (default: host name)")
    p.add_argument("--leader", action="store_true", default=None, help="plan, serve weights and the API")
    p.add_argument("--model", type=Path, default=None,
                   help="this device's own model copy (GGUF file, HF folder or model name); members without one "
                   "fetch their layers from the leader; the leader defaults to the packaged SmolLM2-135M")
    p.add_argument("--draft", type=Path, default=None,
                   help="(leader) draft head bundle (stem, .json or .safetensors; default: the one installed for "
                   "the model, if any)")
    p.add_argument("--interface", action="append", default=None, dest="interfaces", metavar="IP_OR_NAME",
                   help="pin mDNS and the agent server to this interface (repeatable; default: LAN interfaces "
                   "without docker/VPN/link-local ones)")
    p.add_argument("--peer", action="append", default=None, dest="peers", metavar="HOST:PORT",
                   help="a static peer (repeatable), for networks that block multicast")
    p.add_argument("--no-mdns", action="store_false", dest="mdns", default=None, help="static peers only")
    p.add_argument("--port", type=int, default=None, help="agent server port (default 0 = any)")
    p.add_argument("--api-host", default=None, help="leader API address (default 127.0.0.1)")
    p.add_argument("--api-port", type=int, default=None,
                   help=f"leader API port (default {env.DEFAULT_API_PORT})")
    p.add_argument("--state-dir", type=Path, default=None,
                   help=f"keeps the agent id and fetched weights (default ${env.STATE_DIR} or "
                   f"{env.DEFAULT_STATE_DIR})")
    p.add_argument("--threads", type=int, default=None, help="compute threads (default: this device's physical cores)")
    add_engine_argument(p, "this agent's model engine (a member's stages run the one its leader's plan names)")
    p.add_argument("--cache-max-gb", type=float, default=None, metavar="GB",
                   help="bound the fetched-weights cache in the state folder (least recently used dropped first)")
    p.add_argument("--secret", default=None, help=f"shared secret (prefer ${env.SECRET})")
    p.add_argument("--cluster-key-file", type=Path, default=None, metavar="PATH",
                   help=f"the cluster key (default ${env.CLUSTER_KEY}, else the state folder's cluster.key; the "
                   "leader makes one there on its first start; `flowspec keygen` makes one; a --secret passphrase "
                   "derives one instead)")
    p.add_argument("--leader-identity", default=None, metavar="FINGERPRINT",
                   help=f"(member) join only the leader with this identity (and the successors its plans name); its "
                   f"leader prints it next to the key (default ${env.LEADER_IDENTITY}, else the first leader found)")
    p.add_argument("--insecure", action="store_true", default=None,
                   help="no cluster key: an open cluster (plain http; anyone on the network may join). Lab only")
    p.add_argument("--api-key", default=None,
                   help=f"(leader) the API's Bearer token, asked on every route but /health (prefer ${env.API_KEY})")
    p.add_argument("--api-insecure", action="store_true", default=None,
                   help="(leader) serve the API beyond loopback without a key")
    p.add_argument("--api-cors", action="append", default=None, metavar="ORIGIN",
                   help="(leader) a browser origin the API answers cross-origin (repeatable; '*' for any)")
    p.add_argument("--context", type=int, default=None, help="(leader) KV tokens per request on every stage")
    p.add_argument("--max-requests", type=int, default=None, metavar="N",
                   help="(leader) requests decoded at once; every stage holds KV for N requests (default: as many as "
                   "the devices' memory holds, at most 8); more wait in a queue, and beyond it get 503 + Retry-After")
    p.add_argument("--stages", type=int, default=None, help="(leader) force exactly N layer-holding stages")
    p.add_argument("--leader-layers", choices=["auto", "always", "never"], default=None,
                   help="(leader) may the leader hold layers itself (never = FlowSpec's layout)")
    p.add_argument("--wire-dtype", choices=["float16", "bfloat16", "float32"], default=None,
                   help="(leader) activations between stages (default float32: exact; float16/bfloat16 halve "
                   "the bytes but round hidden states)")
    p.add_argument("--decoding", choices=["auto", "ar", "chunk", "pipedec", "flowspec"], default=None,
                   help="(leader) the API's decoding mode when a request names none (default: auto, which runs "
                   "each request in the mode measured fastest on this cluster for requests like it, flowspec or "
                   "ar, and re-measures the other now and then; the reply's stats say which ran)")
    p.add_argument("--flowspec-config", default=None, metavar="JSON",
                   help="(leader) FlowSpec settings that differ from the defaults, as JSON of FlowSpecConfig fields, "
                   "e.g. '{\"segment_cap\": 1, \"in_flight\": 8}' (see flowspec_p2p/decoding/flowspec.py)")
    p.add_argument("--memory-mb", type=float, default=None,
                   help="memory this agent offers for the model: weights, KV cache, activations (its own runtime "
                   "comes on top; the planner leaves 5%% of it free). Default: 80%% of what is available at start")
    p.add_argument("--gflops", type=float, default=None, help="use this compute score instead of measuring")
    p.add_argument("--link-mbps", type=float, default=None, help="emulate this link bandwidth (Mbit/s)")
    p.add_argument("--link-latency-ms", type=float, default=None, help="emulate this one-way link latency")
    p.add_argument("--slowdown", type=float, default=None,
                   help="emulate a device this many times slower (a stage's and the leader's own compute)")
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> AgentConfig:
    from .. import config as config_mod  # here: the agent's modules stay unimported for the other commands

    overrides = {
        "cluster": args.cluster, "name": args.name, "leader": args.leader, "model": args.model, "draft": args.draft,
        "interfaces": args.interfaces, "peers": args.peers, "mdns": args.mdns, "port": args.port,
        "api_host": args.api_host, "api_port": args.api_port, "state_dir": args.state_dir, "threads": args.threads,
        "cache_max_gb": args.cache_max_gb, "engine": args.engine, "max_requests": args.max_requests,
        "secret": args.secret, "cluster_key_file": args.cluster_key_file, "insecure": args.insecure,
        "leader_identity": args.leader_identity,
        "api_key": args.api_key, "api_insecure": args.api_insecure, "api_cors": args.api_cors,
        "wire_dtype": args.wire_dtype, "decoding": args.decoding,
        "flowspec": config_mod.json_object(args.flowspec_config, "--flowspec-config"),
        "planning": {"context": args.context, "stages": args.stages, "leader_layers": args.leader_layers},
        "profile": {"memory_mb": args.memory_mb, "gflops": args.gflops},
        "emulation": {"link_mbps": args.link_mbps, "link_latency_ms": args.link_latency_ms,
                      "slowdown": args.slowdown},
    }
    return config_mod.load(args.config, overrides)


async def serve(cfg: AgentConfig) -> None:
    """Run an agent until SIGINT/SIGTERM, then stop it cleanly."""
    from ..agent import Agent

    agent = Agent(cfg)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, agent.stop)
    try:
        await agent.run()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def run(args: argparse.Namespace) -> int:

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID` dumps every stack to stderr
    show_activity(args)
    run_async(serve(config_from_args(args)))
    return 0
