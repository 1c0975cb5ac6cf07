"""Separate hosts on one machine: a private LAN of Linux network namespaces on a bridge (``flowspec cluster up
--netns``, the separate-hosts test).

    device i   network namespace ``fs<tag>-<i>`` whose only LAN interface is ``eth0`` at ``10.A.B.<i+1>/24``, a veth
               whose other end is plugged into the bridge; its agents see one another only over that LAN (mDNS,
               TLS, weight fetches, ring links all cross the bridge)
    bridge     ``fsbr<tag>`` in this (the root) namespace, at ``10.A.B.254/24`` so the launcher reaches the leader's
               API; multicast snooping off, so mDNS floods as on a home switch
    unplug(i)  the device's cable pulled: its veth deleted (no FIN, no goodbye reaches anyone), then its processes
               killed and its namespace deleted

Needs root and iproute2 (``available()`` says why not). Only addresses of a private /24 this module picks, and only
interfaces and namespaces it creates, are touched; ``down()`` removes them all.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import signal
import subprocess

from ..errors import ConfigError

log = logging.getLogger(__name__)

IP_TIMEOUT_S = 30.0


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=IP_TIMEOUT_S)


def available() -> str | None:
    """None where namespaces and bridges can be made here, else the reason."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    probe = f"fsprobe{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", probe)
        _ip("netns", "del", probe)
    except (subprocess.CalledProcessError, OSError, subprocess.TimeoutExpired) as e:
        return f"cannot make a network namespace here: {getattr(e, 'stderr', '') or e}"
    return None


class Netns:
    """``n`` devices on a bridge. ``up()`` makes them, ``down()`` removes everything made (also after a failure)."""

    def __init__(self, n: int, tag: str | None = None):
        self.n = n
        self.tag = tag or secrets.token_hex(3)
        self.subnet = f"10.{secrets.randbelow(200) + 20}.{secrets.randbelow(250) + 1}"
        self.bridge = f"fsbr{self.tag}"
        self.namespaces = [f"fs{self.tag}-{i}" for i in range(n)]
        self._made_bridge = False
        self._made: list[str] = []  # namespaces made and not yet deleted
        self._links: dict[int, str] = {}  # device -> its veth's bridge end

    def address(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    @property
    def host_address(self) -> str:
        return f"{self.subnet}.254"

    def command(self, i: int, args: list[str]) -> list[str]:
        """``args`` run inside device ``i``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[i], *args]

    def up(self) -> Netns:
        why = available()
        if why:
            raise ConfigError(f"cannot emulate separate hosts: {why}")
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self._made_bridge = True
            # a fixed address: a bridge otherwise takes its lowest port's, which changes when a device is
            # unplugged, and the devices' ARP entries for this host would point at a port that is gone
            _ip("link", "set", self.bridge, "address", "02:" + ":".join(f"{secrets.randbelow(256):02x}"
                                                                       for _ in range(5)))
            _ip("link", "set", self.bridge, "type", "bridge", "mcast_snooping", "0")
            _ip("addr", "add", f"{self.host_address}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i, ns in enumerate(self.namespaces):
                _ip("netns", "add", ns)
                self._made.append(ns)
                outer, inner = f"fsv{self.tag}{i}", f"fsw{self.tag}{i}"
                _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
                self._links[i] = outer
                _ip("link", "set", outer, "master", self.bridge)
                _ip("link", "set", outer, "up")
                _ip("link", "set", inner, "netns", ns)
                run = ("netns", "exec", ns, "ip")
                _ip(*run, "link", "set", inner, "name", "eth0")  # a LAN interface, as on a device
                _ip(*run, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
                _ip(*run, "link", "set", "eth0", "up", "multicast", "on")
                _ip(*run, "link", "set", "lo", "up")
                _ip(*run, "route", "add", "default", "via", self.host_address)
        except (subprocess.CalledProcessError, OSError, subprocess.TimeoutExpired) as e:
            self.down()
            raise ConfigError(f"cannot wire {self.n} network namespaces on a bridge: "
                              f"{getattr(e, 'stderr', '') or e}") from e
        log.info("%d devices on bridge %s: %s.1-%d (this host %s)", self.n, self.bridge, self.subnet, self.n,
                 self.host_address)
        return self

    def _kill_all(self, ns: str) -> None:
        out = _ip("netns", "pids", ns, check=False).stdout.split()
        for pid in out:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)

    def unplug(self, i: int) -> None:
        """Device ``i`` vanishes: its link first (nothing more leaves it), then its processes and namespace."""
        link = self._links.pop(i, None)
        if link is not None:
            _ip("link", "del", link, check=False)
        ns = self.namespaces[i]
        if ns in self._made:
            self._kill_all(ns)
            _ip("netns", "del", ns, check=False)
            self._made.remove(ns)
        log.info("device %d (%s) unplugged", i, self.address(i))

    def down(self) -> None:
        for ns in list(self._made):
            self._kill_all(ns)
            _ip("netns", "del", ns, check=False)
            self._made.remove(ns)
        for link in self._links.values():
            _ip("link", "del", link, check=False)
        self._links.clear()
        if self._made_bridge:
            _ip("link", "del", self.bridge, check=False)
            self._made_bridge = False

    def __enter__(self) -> Netns:
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()
