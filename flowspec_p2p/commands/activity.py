"""What ``flowspec agent`` and ``flowspec cluster up`` say at the default log level (other commands stay quiet):
the device's measurement, the agent's start-up with its API and dashboard URLs, the cluster it joined, every plan
(and why it changed), the stage it loads, each API request (the access log) and weight fetches.

``show_activity`` turns those loggers up to INFO for an agent in this process; ``LogFollower`` copies the same
lines from the log files of ``cluster up``'s agent processes (which log everything at INFO) to the terminal, each
prefixed with its agent.
"""

from __future__ import annotations

import argparse
import logging
import re
import threading
from pathlib import Path
from typing import TextIO

ACTIVITY_LOGGERS = (
    "flowspec_p2p.agent",
    "flowspec_p2p.api.access",
    "flowspec_p2p.cluster.coordinator",
    "flowspec_p2p.cluster.member",
    "flowspec_p2p.cluster.profile",
    "flowspec_p2p.cluster.stage_host",
    "flowspec_p2p.cluster.weight_server",
    "flowspec_p2p.roles",
)
FOLLOW_POLL_S = 0.2
# a record as cli.setup_logging formats it: "12:00:01 I flowspec_p2p.agent: message"
RECORD = re.compile(r"^\d\d:\d\d:\d\d ([DIWEC]) (\S+): ")


def show_activity(args: argparse.Namespace) -> None:
    """At the default verbosity (neither -v nor -q), the ACTIVITY_LOGGERS log at INFO."""
    if not args.quiet and not args.verbose:
        for name in ACTIVITY_LOGGERS:
            logging.getLogger(name).setLevel(logging.INFO)


def wanted(level: str, logger: str, everything: bool) -> bool:
    """Whether a record of ``logger`` at ``level`` (its first letter) is activity to show."""
    return everything or level in "WEC" or (level == "I" and logger in ACTIVITY_LOGGERS)


class LogFollower:
    """Copies activity lines from growing log files to ``out`` on a thread, until ``stop()`` (which copies what is
    left first). A record's continuation lines (a rendered plan) follow it."""

    def __init__(self, logs: dict[str, Path], out: TextIO, everything: bool = False):
        self.logs, self.out, self.everything = logs, out, everything
        self.offsets = {label: 0 for label in logs}
        self.partial = {label: "" for label in logs}
        self.showing = dict.fromkeys(logs, False)  # whether the record being continued is shown
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="log-follower", daemon=True)

    def start(self) -> LogFollower:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(FOLLOW_POLL_S):
            self.poll()
        self.poll()

    def poll(self) -> None:
        for label, path in self.logs.items():
            try:
                with open(path, "rb") as f:
                    f.seek(self.offsets[label])
                    data = f.read()
            except OSError:
                continue
            self.offsets[label] += len(data)
            *lines, self.partial[label] = (self.partial[label] + data.decode(errors="replace")).split("\n")
            for line in lines:
                m = RECORD.match(line)
                if m:
                    self.showing[label] = wanted(m.group(1), m.group(2), self.everything)
                if self.showing[label] and line.strip():
                    self.out.write(f"{label} | {line}\n")
        self.out.flush()
