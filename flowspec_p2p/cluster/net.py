"""The control plane's HTTP client: what the coordinator and a member need of their agent's network (``Net``), the
client that posts control messages and fetches peers' info (``ControlClient``), and binding the agent server.
Authentication and TLS are the session's (pinning.py) and the server's (guard.py) business, not the messages'."""

from __future__ import annotations

import logging
import ssl
from collections.abc import Awaitable, Callable

import aiohttp
from aiohttp import web

from ..errors import ConfigError, FlowSpecError, PeerGone, ProtocolError
from .control import CONTROL_PATH, INFO_PATH, ControlMessage, PeerInfo, agent_url, decode_message, encode_message
from .gate import Gate, GatedSite

log = logging.getLogger(__name__)

CONTROL_TIMEOUT_S = 3.0


class Net:
    """What the coordinator and a member need of their agent's network layer (the agent implements it)."""

    async def post(self, url: str, msg: ControlMessage) -> ControlMessage:
        """POST a control message to the agent at ``url`` -> its reply. Raises PeerGone or ProtocolError."""
        raise NotImplementedError

    async def fetch_info(self, host: str, port: int, timeout_s: float = CONTROL_TIMEOUT_S) -> PeerInfo | None:
        """GET /control/info of an agent; None when it does not answer (or cannot authenticate)."""
        raise NotImplementedError

    def spawn(self, coro: Awaitable, name: str | None = None) -> None:
        """Run ``coro`` as a task the agent owns (dropped once the agent is stopping)."""
        raise NotImplementedError


class ControlClient:
    """Posts control messages and fetches info over ``session`` (in secure mode an AuthClient's: it authenticates
    and pins). ``identity_at(host, port)`` names the identity the agent at an address proved (None: open mode)."""

    def __init__(self, session: aiohttp.ClientSession, *,
                 identity_at: Callable[[str, int], str | None] | None = None):
        self.session = session
        self.identity_at = identity_at

    async def post(self, url: str, msg: ControlMessage) -> ControlMessage:
        body = encode_message(msg)
        try:
            async with self.session.post(url + CONTROL_PATH, data=body, headers={"Content-Type": "application/json"},
                                         timeout=aiohttp.ClientTimeout(total=CONTROL_TIMEOUT_S)) as r:
                data = await r.read()
                text = data[:200].decode(errors="replace")
                if r.status in (401, 403):
                    raise ProtocolError(f"{url} refused the message ({r.status}): {text}")
                if r.status != 200:
                    raise PeerGone(f"{url} answered {r.status}: {text}")
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as e:  # ValueError: an address idna refuses
            raise PeerGone(f"{url} unreachable: {e or type(e).__name__}") from e
        return decode_message(data)

    async def fetch_info(self, host: str, port: int, timeout_s: float = CONTROL_TIMEOUT_S) -> PeerInfo | None:
        secure = self.identity_at is not None
        url = agent_url(host, port, secure=secure) + INFO_PATH
        try:
            async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                if r.status != 200:
                    return None
                info = PeerInfo.model_validate_json(await r.read())
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError, FlowSpecError) as e:
            log.debug("no info from %s:%d: %s", host, port, e)
            return None
        if secure and info.identity != self.identity_at(host, port):
            log.warning("%s:%d describes itself with identity %s, not the one it proved; ignored", host, port,
                        info.identity[:12])
            return None
        return info


async def bind(runner: web.AppRunner, hosts: list[str], port: int, ssl_context: ssl.SSLContext | None = None, *,
               gate: Gate | None = None, reuse_port: bool = False) -> int:
    """Start a TCP site (TLS with ``ssl_context``) on each host, all on one port (the first site picks it when
    ``port`` is 0); with ``gate``, its connections pass through it (gate.py)."""
    for host in hosts:
        if gate is not None:
            site = GatedSite(runner, host, port, gate=gate, ssl_context=ssl_context, reuse_port=reuse_port)
        else:
            site = web.TCPSite(runner, host, port, ssl_context=ssl_context, reuse_port=reuse_port or None)
        try:
            await site.start()
        except OSError as e:
            raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
        if port == 0:
            port = runner.addresses[-1][1]
    return port
