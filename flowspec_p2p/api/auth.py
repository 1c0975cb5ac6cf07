"""The API's key and cross-origin rules: two aiohttp middlewares, ahead of every route of the app.

    api key    with a key, every route but ``OPEN_PATHS`` (``/health``) needs ``Authorization: Bearer <key>`` (what
               OpenAI clients send); a browser may give it as the password of HTTP Basic auth instead (GET routes
               outside /v1/ ask for it with ``WWW-Authenticate: Basic``, so a dashboard opens after a prompt).
               Without it: 401 in OpenAI's error shape.
    cors       with ``--api-cors ORIGIN`` (repeatable; ``*``: any), requests from those browser origins get the
               CORS headers, and their preflights (OPTIONS) a 204 without the key (browsers send none there).
"""

from __future__ import annotations

import base64
import binascii
import hmac
from collections.abc import Sequence

from aiohttp import hdrs, web

from .schemas import ApiError

OPEN_PATHS = frozenset({"/health"})
CORS_MAX_AGE_S = 600


def _presented(request: web.Request) -> str:
    """The key a request presents (Bearer token, or the password of Basic auth), "" for none."""
    scheme, _, value = request.headers.get(hdrs.AUTHORIZATION, "").partition(" ")
    if scheme.lower() == "bearer":
        return value.strip()
    if scheme.lower() == "basic":
        try:
            return base64.b64decode(value.strip(), validate=True).decode().partition(":")[2]
        except (binascii.Error, UnicodeDecodeError):
            return ""
    return ""


def _refusal(request: web.Request, presented: str) -> web.Response:
    if presented:
        message = "Incorrect API key provided."
    else:
        message = "You didn't provide an API key: send it as 'Authorization: Bearer <key>'."
    resp = ApiError(401, message, "invalid_request_error", code="invalid_api_key").response()
    browser = request.method == "GET" and not request.path.startswith("/v1/")
    resp.headers[hdrs.WWW_AUTHENTICATE] = 'Basic realm="flowspec_p2p"' if browser else "Bearer"
    return resp


def api_key_middleware(api_key: str):
    expected = api_key.encode()

    @web.middleware
    async def check_api_key(request: web.Request, handler):
        if request.path in OPEN_PATHS or request.method == "OPTIONS":
            return await handler(request)
        presented = _presented(request)
        if not hmac.compare_digest(presented.encode(), expected):
            return _refusal(request, presented)
        return await handler(request)

    return check_api_key


def _cors(origins: Sequence[str]):
    """-> (a middleware answering preflights, an on_response_prepare hook adding the headers to every answer)."""
    allowed = frozenset(origins)

    def allow(origin: str | None) -> bool:
        return origin is not None and ("*" in allowed or origin in allowed)

    @web.middleware
    async def preflight(request: web.Request, handler):
        if request.method != "OPTIONS" or hdrs.ACCESS_CONTROL_REQUEST_METHOD not in request.headers:
            return await handler(request)
        if not allow(request.headers.get(hdrs.ORIGIN)):
            raise web.HTTPForbidden(text="origin not allowed")
        return web.Response(status=204, headers={
            hdrs.ACCESS_CONTROL_ALLOW_METHODS: "GET, POST, OPTIONS",
            hdrs.ACCESS_CONTROL_ALLOW_HEADERS: "Authorization, Content-Type",
            hdrs.ACCESS_CONTROL_MAX_AGE: str(CORS_MAX_AGE_S)})

    async def add_headers(request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get(hdrs.ORIGIN)
        if allow(origin):
            response.headers[hdrs.ACCESS_CONTROL_ALLOW_ORIGIN] = origin
            response.headers[hdrs.VARY] = "Origin"

    return preflight, add_headers


def secure_api(app: web.Application, api_key: str | None, cors: Sequence[str] = ()) -> None:
    """Put the key check (with a key) and the CORS rules (with origins) ahead of every route of ``app``, the ones
    added later included. Call before the app starts."""
    if cors:
        preflight, add_headers = _cors(cors)
        app.middlewares.append(preflight)
        app.on_response_prepare.append(add_headers)
    if api_key is not None:
        app.middlewares.append(api_key_middleware(api_key))
