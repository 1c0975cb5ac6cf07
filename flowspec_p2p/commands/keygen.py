"""``flowspec keygen``: make a cluster key (cluster/keys.py) for a cluster's agents."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .. import env
from ..env import KEY_FILE


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "keygen",
        help="make a cluster key",
        description="Make a random cluster key. With --out, write it to that file (owner-only permissions) for "
        f"--cluster-key-file, or into an agent's state folder as {KEY_FILE} (--out STATE_DIR/{KEY_FILE}), and "
        f"print the ${env.CLUSTER_KEY} line members need; without, print only the key. A leader makes its own key "
        "on its first start, so this is for keys made ahead of time, or replaced.",
    )
    p.add_argument("--out", type=Path, default=None, help="write the key to this file (refuses to replace one)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..cluster.keys import ClusterKey, member_line, write_key  # the CLI imports only what its command needs

    key = ClusterKey.generate()
    if args.out is None:
        sys.stdout.write(key.text + "\n")
        return 0
    write_key(args.out.expanduser(), key, overwrite=args.force)
    sys.stdout.write(f"wrote cluster key {key.key_id} to {args.out}; members need:\n{member_line(key)}\n")
    return 0
