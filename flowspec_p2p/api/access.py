"""The API's access log and the HTTP side of its metrics: one middleware sees every reply.

    flowspec_p2p.api.access  INFO  POST /v1/chat/completions 200 24 tokens (flowspec) 1.234 s

One line per request, when its reply is complete (a stream when it ends; a client that left shows 499). A stream
that failed after it started logs and counts the status of its error event. /metrics (metrics.py) counts every
4xx/5xx by reason and every completion request by mode and status.
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web

from .metrics import API_METRICS
from .schemas import ERROR_STATUS, REASON

log = logging.getLogger(__name__)

JOB = web.RequestKey("job", object)  # the completion request's app._Job, set by its handler
COMPLETION_PATHS = ("/v1/chat/completions", "/v1/completions", "/api/chat", "/api/generate")  # OpenAI, Ollama
CLIENT_CLOSED = 499  # nginx's code for a client that left before the reply was complete


@web.middleware
async def access_log(request: web.Request, handler):
    t0 = time.perf_counter()
    status, reason = 500, "internal_error"
    try:
        resp = await handler(request)
        status = resp.get(ERROR_STATUS, resp.status)
        reason = resp.get(REASON) or reason
        return resp
    except web.HTTPException as e:
        status, reason = e.status, e.reason.lower().replace(" ", "_")
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        status, reason = CLIENT_CLOSED, "client_closed"
        raise
    finally:
        _done(request, status, reason, time.perf_counter() - t0)


def _done(request: web.Request, status: int, reason: str, seconds: float) -> None:
    job = request.get(JOB)
    ledger = getattr(job, "ledger", None)
    metrics = request.app.get(API_METRICS)
    if metrics is not None:
        metrics.reply(status, reason, ledger, request.path in COMPLETION_PATHS)
    tokens = f" {ledger.new_tokens} tokens ({ledger.mode})" if ledger is not None else ""
    log.info("%s %s %d%s %.3f s", request.method, request.path, status, tokens, seconds)
