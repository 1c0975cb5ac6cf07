"""Finding the agents of a cluster: mDNS (python-zeroconf) plus static peers. Knows nothing of planning.

Each agent registers one service ``<cluster>-<agent id>._flowspec._tcp.local.`` whose TXT record carries what the
planner needs (``PeerInfo``: id, cluster, role, memory, compute score, threads, link, model fingerprint, control
protocol version, pid, start time, identity), and browses the same type. Resolved services of *its* cluster and
protocol version become ``PeerSeen`` events; removals become ``PeerLost``. Static peers (``--peer HOST:PORT``, for
networks that block multicast) are polled over HTTP (``GET /control/info``) instead.

With a cluster key, every advert is sealed (handshake.AdvertSeal: a proof of the key over every TXT field, the
port and a timestamp) and re-sealed every ADVERT_REFRESH_S; adverts without a valid, fresh seal are ignored and
logged once. A leadership claim counts only once the claimant confirmed it over an authenticated session pinned
to the identity it advertises (``confirm``), so neither a forged nor a replayed "older leader" changes anything;
an mDNS removal (unsealed by nature) counts only when the agent no longer confirms it is there.

Where real networks break mDNS (exo, Petals and friends fail here):

* interfaces are pinned (``--interface`` IP or name, repeatable) and zeroconf listens on exactly those;
* without pins, docker/bridge/VPN/link-local addresses are left out (``default_addresses``): a peer on the LAN
  cannot reach 172.17.0.1, and advertising it makes clients time out;
* only addresses this agent can actually bind are advertised (``bindable``);
* static peers work with multicast off entirely (``mdns=False``).

Timing constants are module-level so tests can shrink them.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from ..errors import ConfigError, ProtocolError
from .control import CONTROL_VERSION, PeerInfo
from .device import DeviceProfile
from .handshake import AdvertSeal
from .identity import id_of

log = logging.getLogger(__name__)

SERVICE_TYPE = "_flowspec._tcp.local."
RESOLVE_TIMEOUT_MS = 3000
STATIC_POLL_INTERVAL_S = 2.0
MAX_IGNORED = 256  # ignored advert names remembered (for logging each once); the oldest is forgotten beyond this
MAX_RESOLVING = 32  # mDNS names resolved at once; a change for a name already being resolved starts nothing
MAX_NAMES = 1024  # advertised agents remembered
MDNS_RETRY_S = 5.0  # after mDNS failed, try again this much later
ADVERT_REFRESH_S = 120.0  # a sealed advert is re-sealed this often (well within handshake.ADVERT_MAX_AGE_S)
VIRTUAL_INTERFACE_PREFIXES = ("docker", "br-", "veth", "virbr", "cni", "flannel", "podman", "lxcbr", "lxdbr",
                              "vmnet", "vboxnet", "tun", "tap", "wg", "tailscale", "utun", "zt", "kube", "ifb")


@dataclass(frozen=True)
class PeerSeen:
    info: PeerInfo
    via: Literal["mdns", "static"]


@dataclass(frozen=True)
class PeerLost:
    agent_id: str
    via: Literal["mdns", "static"]


DiscoveryEvent = PeerSeen | PeerLost


# ------------------------------------------------------------------------------------------- interfaces


def _adapters():
    import ifaddr  # a dependency of zeroconf

    return ifaddr.get_adapters()


def resolve_interfaces(wanted: Sequence[str]) -> list[str]:
    """IPv4 addresses for ``--interface`` values: an IP stands for itself, a name for its IPv4 addresses."""
    out: list[str] = []
    adapters = None
    for w in wanted:
        try:
            ip = ipaddress.ip_address(w)
        except ValueError:
            adapters = adapters if adapters is not None else _adapters()
            match = [a for a in adapters if w in (a.nice_name, a.name)]
            if not match:
                names = ", ".join(sorted(a.nice_name for a in adapters))
                raise ConfigError(f"no network interface {w!r} (have: {names})") from None
            ips = [a.ip for a in match[0].ips if isinstance(a.ip, str)]
            if not ips:
                raise ConfigError(f"interface {w!r} has no IPv4 address") from None
            out += ips
        else:
            if ip.version != 4:
                raise ConfigError(f"{w}: only IPv4 interfaces are supported for now")
            out.append(str(ip))
    return list(dict.fromkeys(out))


def default_addresses() -> list[str]:
    """IPv4 addresses of real LAN interfaces: no loopback, link-local, docker/bridge or VPN interfaces.
    Falls back to 127.0.0.1 (a one-host cluster) when nothing else is left."""
    out = []
    for a in _adapters():
        if a.nice_name.startswith(VIRTUAL_INTERFACE_PREFIXES) or a.nice_name == "lo":
            continue
        for ip in a.ips:
            if not isinstance(ip.ip, str):
                continue
            addr = ipaddress.ip_address(ip.ip)
            if addr.is_loopback or addr.is_link_local or addr.is_multicast:
                continue
            out.append(ip.ip)
    out = [ip for ip in dict.fromkeys(out) if bindable(ip)]
    if not out:
        log.warning("no LAN interface found; advertising 127.0.0.1 only (agents on this host only)")
        return ["127.0.0.1"]
    return out


def bindable(address: str) -> bool:
    """Can this host bind a TCP socket to ``address``? (Never advertise one it cannot.)"""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((address, 0))
        return True
    except OSError:
        return False


# -------------------------------------------------------------------------------------------------- TXT


def to_properties(info: PeerInfo) -> dict[str, str]:
    p = info.profile
    props = {
        "id": info.id, "name": info.name[:60], "c": info.cluster, "r": info.role, "v": str(info.version),
        "mem": str(p.memory_bytes), "gf": repr(p.gflops), "thr": str(p.threads), "sd": repr(p.slowdown),
        "lat": repr(p.latency_ms), "m": info.model, "pid": str(info.pid), "st": repr(info.started),
        "fp": info.identity,
    }
    if p.link_mbps is not None:
        props["mbps"] = repr(p.link_mbps)
    return props


def text_properties(props: dict) -> dict[str, str]:
    """A TXT record's keys and values as text (zeroconf gives bytes, and None for a key without a value)."""
    return {(k.decode(errors="replace") if isinstance(k, bytes) else k):
            (v.decode(errors="replace") if isinstance(v, bytes) else (v or "")) for k, v in props.items()}


def from_properties(props: dict, host: str, port: int) -> PeerInfo:
    """Parse a TXT record (bytes or str keys/values). Raises ValueError/KeyError on anything malformed."""
    d = text_properties(props)
    profile = DeviceProfile(
        memory_bytes=int(d["mem"]), gflops=float(d["gf"]), threads=int(d["thr"]),
        link_mbps=float(d["mbps"]) if d.get("mbps") else None, latency_ms=float(d.get("lat") or 0),
        slowdown=float(d.get("sd") or 1),
    )
    return PeerInfo(id=d["id"], name=d.get("name", ""), cluster=d["c"], role=d["r"], host=host, port=port,
                    pid=int(d.get("pid") or 0), started=float(d.get("st") or 0), profile=profile,
                    model=d.get("m", ""), version=int(d["v"]), identity=d.get("fp", ""))


def instance_name(info: PeerInfo) -> str:
    return f"{info.cluster}-{info.id}.{SERVICE_TYPE}"


# ------------------------------------------------------------------------------------------- discovery


class Discovery:
    """Advertise ``me`` and report the peers of its cluster as events on ``events`` (an asyncio.Queue).

    ``run()`` owns every resource (zeroconf, browser, resolve tasks, the static-peer poller) and releases them
    when cancelled: the service is unregistered, so peers see a prompt mDNS removal."""

    def __init__(
        self,
        me: PeerInfo,
        events: asyncio.Queue,
        *,
        addresses: Sequence[str],
        interfaces: Sequence[str] | None = None,
        seal: AdvertSeal | None = None,
        confirm: Callable[[PeerInfo], Awaitable[PeerInfo | None]] | None = None,
        mdns: bool = True,
        static_peers: Sequence[tuple[str, int]] = (),
        fetch_info: Callable[[str, int], Awaitable[PeerInfo | None]] | None = None,
    ):
        """``seal``: seal this agent's advert and check others' (None: the open mode); ``confirm(claim)``: the
        claimant's own word on a leadership claim (None: the claim as advertised)."""
        self.me = me
        self.events = events
        self.addresses = list(addresses)
        self.interfaces = list(interfaces) if interfaces else None
        self.seal = seal
        self.confirm = confirm
        self.mdns = mdns
        self.static_peers = list(static_peers)
        self.fetch_info = fetch_info
        self.registered = asyncio.Event()
        self._aiozc = None
        self._service = None
        self._names: dict[str, PeerInfo] = {}  # mDNS instance name -> the agent it advertised
        self.ignored: dict[str, str] = {}  # mDNS instance name -> why it was first ignored (logged once)
        self._tasks: set[asyncio.Task] = set()
        self._resolving: set[str] = set()  # names with a resolve task running

    async def run(self) -> None:
        try:
            async with asyncio.TaskGroup() as tg:
                if self.mdns:
                    tg.create_task(self._run_mdns(), name="mdns")
                    if self.seal is not None:
                        tg.create_task(self._reseal(), name="mdns-reseal")
                else:
                    self.registered.set()
                if self.static_peers and self.fetch_info is not None:
                    tg.create_task(self._poll_static(), name="static-peers")
        finally:
            for t in list(self._tasks):
                t.cancel()

    async def _run_mdns(self) -> None:
        """Advertise and browse; a failure of mDNS (an interface going away, a socket error) is logged and tried
        again after MDNS_RETRY_S: it never ends the agent (static peers keep working meanwhile)."""
        while True:
            try:
                await self._mdns_once()
            except Exception as e:  # zeroconf's errors have no common base; cancellation passes
                log.warning("mDNS failed (%s: %s); trying again in %.0f s", type(e).__name__, e, MDNS_RETRY_S)
            await asyncio.sleep(MDNS_RETRY_S)

    async def _mdns_once(self) -> None:
        from zeroconf import IPVersion
        from zeroconf.asyncio import AsyncServiceBrowser, AsyncZeroconf

        self._aiozc = AsyncZeroconf(interfaces=self.interfaces or self.addresses, ip_version=IPVersion.V4Only)
        browser, registered = None, False
        try:
            self._service = self._service_info(self.me)
            # a name someone else holds (a stale record, a squatter) gets another instance name: peers read who
            # an agent is from its sealed TXT record, never from the name
            await self._aiozc.async_register_service(self._service, allow_name_change=True)
            registered = True
            self.registered.set()
            if self._service.name != instance_name(self.me):
                log.warning("mDNS: %s is taken; advertising as %s", instance_name(self.me), self._service.name)
            log.info("mDNS: advertising %s on %s", self._service.name, ", ".join(self.addresses))
            browser = AsyncServiceBrowser(self._aiozc.zeroconf, SERVICE_TYPE, handlers=[self._on_change])
            await asyncio.Event().wait()  # until cancelled
        finally:
            if browser is not None:
                await browser.async_cancel()
            if registered:
                try:
                    await asyncio.wait_for(self._aiozc.async_unregister_service(self._service), 2.0)
                except (TimeoutError, OSError, RuntimeError) as e:  # best effort on the way out
                    log.debug("mDNS unregister: %s", e)
            self._service = None
            await self._aiozc.async_close()
            self._aiozc = None

    def _service_info(self, me: PeerInfo, name: str | None = None):
        from zeroconf.asyncio import AsyncServiceInfo

        props = to_properties(me)
        if self.seal is not None:
            props = self.seal.seal(props, me.port, time.time())
        return AsyncServiceInfo(
            SERVICE_TYPE, name or instance_name(me), port=me.port, properties=props,
            addresses=[socket.inet_aton(a) for a in self.addresses], server=f"{me.cluster}-{me.id}.local.",
        )

    async def update(self, me: PeerInfo) -> None:
        """Re-advertise (role, profile or model changed)."""
        self.me = me
        if self._aiozc is not None and self._service is not None:
            self._service = self._service_info(me, self._service.name)  # the name it registered under
            await self._aiozc.async_update_service(self._service)

    async def _reseal(self) -> None:
        """Keep the advert's seal fresh."""
        await self.registered.wait()
        while True:
            await asyncio.sleep(ADVERT_REFRESH_S)
            await self.update(self.me)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_change(self, zeroconf, service_type: str, name: str, state_change) -> None:
        from zeroconf import ServiceStateChange

        if state_change is ServiceStateChange.Removed:
            peer = self._names.pop(name, None)
            if peer is not None:
                self._spawn(self._removed(name, peer))
        elif name not in self._resolving and len(self._resolving) < MAX_RESOLVING:
            self._resolving.add(name)
            self._spawn(self._resolve(name))

    async def _resolve(self, name: str) -> None:
        try:
            await self._resolve_one(name)
        finally:
            self._resolving.discard(name)

    async def _resolve_one(self, name: str) -> None:
        from zeroconf.asyncio import AsyncServiceInfo

        if self._aiozc is None:
            return
        info = AsyncServiceInfo(SERVICE_TYPE, name)
        if not await info.async_request(self._aiozc.zeroconf, RESOLVE_TIMEOUT_MS):
            log.debug("mDNS: could not resolve %s", name)
            return
        addrs = info.parsed_addresses()
        if not addrs or info.port is None:
            return
        host = next((a for a in addrs if a in self.addresses), addrs[0])
        try:
            peer = from_properties(info.properties, host, info.port)
        except (KeyError, ValueError) as e:
            self._ignore(name, f"malformed TXT record ({e})")
            return
        if peer.id == self.me.id or peer.cluster != self.me.cluster:
            return
        if peer.version != CONTROL_VERSION:
            self._ignore(name, f"control protocol {peer.version} (this agent speaks {CONTROL_VERSION})")
            return
        props = text_properties(info.properties)
        if self.seal is None:
            if props.get("p"):
                self._ignore(name, "a sealed advert of a keyed cluster (this agent runs --insecure)")
                return
        else:
            try:
                self.seal.check(props, info.port, time.time())
            except ProtocolError as e:
                self._ignore(name, f"an unproven advert ({e})")
                return
            if peer.id != id_of(peer.identity):
                self._ignore(name, f"agent id {peer.id} is not the one its identity {peer.identity[:12]} proves")
                return
            if peer.role == "leader" and self.confirm is not None and await self.confirm(peer) is None:
                self._ignore(name, f"agent {peer.id} did not confirm its leadership claim at {peer.host}:{peer.port}")
                return
        if name not in self._names and len(self._names) >= MAX_NAMES:
            self._ignore(name, f"already {len(self._names)} agents advertised")
            return
        self._names[name] = peer
        self.events.put_nowait(PeerSeen(info=peer, via="mdns"))

    async def _removed(self, name: str, peer: PeerInfo) -> None:
        """An mDNS removal (which anyone can send): with ``confirm``, it counts only when the agent is gone."""
        if self.confirm is not None and await self.confirm(peer) is not None:
            log.info("mDNS: ignoring the removal of %s: agent %s still answers", name, peer.id)
            self._names[name] = peer
            return
        self.events.put_nowait(PeerLost(agent_id=peer.id, via="mdns"))

    def _ignore(self, name: str, why: str) -> None:
        if name not in self.ignored:
            if len(self.ignored) >= MAX_IGNORED:
                del self.ignored[next(iter(self.ignored))]
            self.ignored[name] = why
            log.warning("mDNS: ignoring %s: %s", name, why)

    async def _poll_static(self) -> None:
        assert self.fetch_info is not None
        while True:
            for host, port in self.static_peers:
                peer = await self.fetch_info(host, port)
                if peer is not None and peer.id != self.me.id and peer.cluster == self.me.cluster:
                    self.events.put_nowait(PeerSeen(info=peer, via="static"))
            await asyncio.sleep(STATIC_POLL_INTERVAL_S)
