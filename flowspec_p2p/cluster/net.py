"""The control plane's HTTP client and server hooks: what the coordinator and a member need of their agent's
network (``Net``), the client that posts control messages and fetches peers' info (``ControlClient``), and the
request signing on both ends (with the cluster's shared secret, when there is one)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable

import aiohttp
from aiohttp import web

from ..errors import ConfigError, PeerGone, ProtocolError
from .control import (
    AUTH_HEADER,
    CONTROL_PATH,
    INFO_PATH,
    ControlMessage,
    PeerInfo,
    check_signature,
    decode_message,
    encode_message,
    sign,
)

log = logging.getLogger(__name__)

CONTROL_TIMEOUT_S = 3.0


class Net:
    """What the coordinator and a member need of their agent's network layer (the agent implements it)."""

    async def post(self, url: str, msg: ControlMessage) -> ControlMessage:
        """POST a control message to the agent at ``url`` -> its reply. Raises PeerGone or ProtocolError."""
        raise NotImplementedError

    async def fetch_info(self, host: str, port: int, timeout_s: float = CONTROL_TIMEOUT_S) -> PeerInfo | None:
        """GET /control/info of an agent; None when it does not answer (or not with a valid signature)."""
        raise NotImplementedError

    def spawn(self, coro: Awaitable, name: str | None = None) -> None:
        """Run ``coro`` as a task the agent owns (dropped once the agent is stopping)."""
        raise NotImplementedError


class ControlClient:
    """Posts control messages and fetches info over ``session`` (whose requests ``signing`` signs)."""

    def __init__(self, session: aiohttp.ClientSession, secret: bytes | None):
        self.session = session
        self.secret = secret

    async def post(self, url: str, msg: ControlMessage) -> ControlMessage:
        body = encode_message(msg)
        headers = {"Content-Type": "application/json"}
        if self.secret is not None:
            headers[AUTH_HEADER] = sign(self.secret, "POST", CONTROL_PATH, body)
        try:
            async with self.session.post(url + CONTROL_PATH, data=body, headers=headers,
                                         timeout=aiohttp.ClientTimeout(total=CONTROL_TIMEOUT_S)) as r:
                data = await r.read()
                if r.status == 401:
                    raise ProtocolError(f"{url} refused our signature: {data.decode(errors='replace')}")
                if r.status != 200:
                    raise PeerGone(f"{url} answered {r.status}: {data[:200].decode(errors='replace')}")
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            raise PeerGone(f"{url} unreachable: {e or type(e).__name__}") from e
        return decode_message(data)

    async def fetch_info(self, host: str, port: int, timeout_s: float = CONTROL_TIMEOUT_S) -> PeerInfo | None:
        url = f"http://{host}:{port}{INFO_PATH}"
        try:
            async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                if r.status != 200:
                    return None
                return PeerInfo.model_validate_json(await r.read())
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
            return None


def signing(secret: bytes | None):
    """A ClientSession middleware that signs every request the agent makes (GETs of ring links and weights too)."""

    async def sign_request(req: aiohttp.ClientRequest, handler):
        if secret is not None and AUTH_HEADER not in req.headers:
            req.headers[AUTH_HEADER] = sign(secret, req.method, req.url.raw_path_qs)
        return await handler(req)

    return sign_request


def checking(secret: bytes | None):
    """A server middleware that refuses (401) requests without a valid signature, when there is a secret."""

    @web.middleware
    async def check_request(request: web.Request, handler):
        if secret is not None:
            body = await request.read() if request.method == "POST" else b""
            try:
                check_signature(secret, request.headers.get(AUTH_HEADER), request.method, request.raw_path, body)
            except ProtocolError as e:
                log.warning("refused %s %s from %s: %s", request.method, request.path, request.remote, e)
                raise web.HTTPUnauthorized(text=str(e)) from None
        return await handler(request)

    return check_request


async def bind(runner: web.AppRunner, hosts: list[str], port: int) -> int:
    """Start a TCP site on each host, all on one port (the first site picks it when ``port`` is 0)."""
    for host in hosts:
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except OSError as e:
            raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
        if port == 0:
            port = runner.addresses[-1][1]
    return port
