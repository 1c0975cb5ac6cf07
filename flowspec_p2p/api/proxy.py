"""The API of an agent that does not lead: every route forwarded to the cluster's leader, so a client pointed at any
agent keeps working, and a completion outlives the leader.

    client -> this agent's API -> (the cluster's authenticated session) -> leader's agent server /relay/<path>
           -> the leader's own API (app.py)

``forward`` passes one request through as it is (status, body, streamed or not). A completion
(``/v1/completions``, ``/v1/chat/completions``, and Ollama's ``/api/chat``, ``/api/generate``) goes through
resume.py instead: when the leader is lost mid-reply, the reply goes on at the next leader from the tokens already
sent. Everything else (/health, /cluster, /metrics, the dashboard, the other Ollama routes) is forwarded as it is.
"""

from __future__ import annotations

import contextlib
import json
import logging

import aiohttp
from aiohttp import web

from .access import access_log
from .auth import secure_api
from .resume import CONNECT_TIMEOUT_S, RELAY_PATH, LeaderLink, OllamaResumable, Resumable, unavailable
from .schemas import ApiError

__all__ = ["RELAY_PATH", "create_proxy_app", "forward", "not_leading"]

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 * 1024 * 1024
RESUMABLE = {"/v1/completions": Resumable, "/v1/chat/completions": Resumable, "/api/chat": OllamaResumable,
             "/api/generate": OllamaResumable}
PASSED_HEADERS = ("Content-Type", "Accept", "Last-Event-ID")
RETURNED_HEADERS = ("Content-Type", "Retry-After", "Cache-Control", "Content-Encoding")


def not_leading() -> web.Response:
    """The relay's answer on an agent that does not lead (any more)."""
    return ApiError(503, "this agent does not lead the cluster", "cluster_unavailable", code="not_leading",
                    retry_after=2).response()


async def forward(request: web.Request, url: str, session: aiohttp.ClientSession, *,
                  headers: dict[str, str] | None = None, body: bytes | None = None) -> web.StreamResponse:
    """Pass ``request`` to ``url`` and its answer back, streamed. A peer that cannot be reached is a 502."""
    data = await request.read() if body is None else body
    sent = {k: request.headers[k] for k in PASSED_HEADERS if k in request.headers} | (headers or {})
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S)
    resp: web.StreamResponse | None = None
    try:
        async with session.request(request.method, url, params=request.query, data=data or None, headers=sent,
                                   timeout=timeout, allow_redirects=False) as up:
            resp = web.StreamResponse(status=up.status, reason=up.reason,
                                      headers={k: up.headers[k] for k in RETURNED_HEADERS if k in up.headers})
            if up.content_length is not None and "Content-Encoding" not in up.headers:
                resp.content_length = up.content_length
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
    except (aiohttp.ClientError, OSError, TimeoutError) as e:
        if resp is None:
            return ApiError(502, f"the leader cannot be reached: {e or type(e).__name__}", "cluster_unavailable",
                            code="leader_unreachable", retry_after=2).response()
        return resp  # the stream broke: the client sees it end
    with contextlib.suppress(ConnectionResetError):
        await resp.write_eof()
    return resp


def create_proxy_app(link: LeaderLink, *, api_key: str | None = None, cors: tuple[str, ...] = ()) -> web.Application:
    """The API app of an agent that does not lead (see the module docstring)."""
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[access_log])
    secure_api(app, api_key, cors)

    async def handle(request: web.Request) -> web.StreamResponse:
        if request.method == "POST" and request.path in RESUMABLE:
            try:
                body = json.loads(await request.read())
            except ValueError:
                body = None
            if isinstance(body, dict):
                return await RESUMABLE[request.path](request, link, body).run()
        url = link.leader_url()
        if url is None:
            return unavailable("no leader yet: the cluster is starting or electing one; retry shortly")
        return await forward(request, url + RELAY_PATH + request.path, link.session)

    app.router.add_route("*", "/{tail:.*}", handle)
    return app
