"""The leader's HTTP API: OpenAI-compatible completions over the cluster, plus health and cluster views.

    POST /v1/chat/completions   messages -> chat template -> Leader.generate; ``stream: true`` = SSE, ``[DONE]``
    POST /v1/completions        prompt (text: raw, the BOS first where the model's tokenizer adds one; or token ids,
                                taken as given) -> the same
    GET  /v1/models             the model this cluster serves, under each of its names (catalog.py)
    /api/...                    the Ollama-compatible routes (ollama.py): chat, generate, tags, show, ps, version
    GET  /health                200 {"status": "ok"} when a pipeline is ready, else 503 {"status": "not_ready"} (with
                                ``no_plan``: why, when no plan fits the members, e.g. "no plan: short by 812 MB: ...")
    GET  /cluster               what the control plane knows (``cluster_view()``: members with id, role,
                                address, pid, capabilities; the plan; per-stage counters) + the leader's state
    GET  /metrics               Prometheus text format (metrics.py)
    GET  /, /dashboard/...      the dashboard: static page, its assets and its event stream (dashboard.py)

Every route but /health is one an API key (when the cluster has one) must cover: the app's middlewares see them all.
Each request leaves one access-log line (access.py).

Extensions to the OpenAI request body: ``decoding`` ("ar", "chunk", "pipedec", "flowspec"; default: the leader's
default mode, or ``model`` when that names a mode) and ``top_k``. Non-streamed responses carry a top-level ``stats``
object (mode, new_tokens, steps, tau, prefill_s, decode_s, decode_started_at, decode_finished_at, ...: a view of the
request's ledger, ledger.reply_stats); the last streamed chunk carries it too. For benchmarks, ``return_token_ids:
true`` adds the generated ids to it (``token_ids``) and ``return_leader_timeline: true`` the leader's compute
intervals (``leader_intervals``, time.time() pairs).
``temperature`` defaults to 1.0 as in OpenAI's API (0 = greedy). ``logprobs`` (and ``top_logprobs``) work in every
mode, streamed and not: the target's log-probabilities at each committed token (ledger.py). Fields the server cannot
honour are refused with a 400 naming them (schemas.py).

Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: 400 for requests the client must
fix (malformed JSON, wrong types, unknown mode, prompt over the context limit, max_tokens out of range), 503 with
Retry-After when the cluster is busy, re-planning or lost a stage, 500 when a stage failed. An error after a
stream started arrives as a final ``data: {"error": ...}`` event.

With a key (``create_app(api_key=...)``: ``--api-key`` / ``FLOWSPEC_API_KEY``) every route but /health asks for it as
a Bearer token (auth.py); ``cors`` names browser origins it answers cross-origin. Without a key, bind it to
127.0.0.1 (the default of ``flowspec agent --api-host``; the agent refuses to serve it beyond loopback without one
unless ``--api-insecure``).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import psutil
from aiohttp import web
from pydantic import ValidationError

from ..decoding.leader import Leader
from ..errors import (
    FlowSpecError,
)
from ..ledger import TokenLogprob
from .access import JOB, access_log
from .auth import secure_api
from .catalog import SERVED, ServedModel, default_served
from .dashboard import Timelines, install_dashboard
from .logprobs import chat_logprobs, completion_logprobs
from .metrics import install_metrics
from .ollama import install_ollama
from .schemas import (
    ERROR_STATUS,
    REASON,
    ApiError,
    Body,
    ChatRequest,
    CompletionRequest,
    api_error,
    validation_error,
)
from .serving import LEADER, Job, until_hangup, whole_text

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 * 1024 * 1024

ClusterView = Callable[[], dict | Awaitable[dict]]
CLUSTER_VIEW = web.AppKey("cluster_view", object)


# ------------------------------------------------------------------------------------------------ serving


class _Job(Job):
    """A Job whose replies take OpenAI's shapes (chat.completion / text_completion, their chunks, usage, logprobs)."""

    def __init__(self, leader: Leader, body: Body, prompt: list[int], kind: str):
        super().__init__(leader, body, prompt, kind)
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.text_offset = 0  # characters of the reply whose logprobs went out (completions' text_offset)

    def usage(self) -> dict:
        n = self.ledger.new_tokens + len(self.resume)
        return {"prompt_tokens": len(self.prompt), "completion_tokens": n, "total_tokens": len(self.prompt) + n,
                "prompt_tokens_details": {"cached_tokens": self.ledger.cached_tokens}}

    def logprobs(self, entries: list[TokenLogprob] | None) -> dict | None:
        """OpenAI's ``logprobs`` object of a choice for ``entries`` (None when the request did not ask)."""
        if entries is None or self.ledger.logprobs is None:
            return None
        decode = self.leader.tokenizer.decode
        if self.kind == "chat":
            return chat_logprobs(entries, decode)
        out = completion_logprobs(entries, decode, self.text_offset)
        self.text_offset += sum(len(t) for t in out["tokens"])
        return out

    def chunk(self, delta: str | None, finish: str | None = None, role: bool = False,
              logprobs: list[TokenLogprob] | None = None) -> dict:
        lp = self.logprobs(logprobs)
        if self.kind == "chat":
            d = {"role": "assistant", "content": ""} if role else ({} if delta is None else {"content": delta})
            choice = {"index": 0, "delta": d, "logprobs": lp, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": delta or "", "logprobs": lp, "finish_reason": finish}
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.leader.model_id,
                "choices": [choice]}

    def full(self, text: str) -> dict:
        lp = self.logprobs(self.ledger.logprobs)
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                      "finish_reason": self.finish_reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": self.finish_reason}
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.leader.model_id,
                "choices": [choice], "usage": self.usage(), "stats": self.stats_dict()}


async def _parse(request: web.Request, model: type[Body]) -> Body:
    raw = await request.read()
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise validation_error(e) from None


def _prompt_ids(leader: Leader, body: Body) -> tuple[list[int], str]:
    tok = leader.tokenizer
    if isinstance(body, ChatRequest):
        return tok.chat([m.as_dict() for m in body.messages]), "chat"
    assert isinstance(body, CompletionRequest)
    if not body.prompt:
        raise ApiError(400, "the prompt is empty", "invalid_request_error", "prompt")
    if isinstance(body.prompt, str):  # raw text: BOS as the tokenizer metadata says (once, if the client wrote it)
        return tok.encode_raw(body.prompt), "text"
    vocab = leader.head.cfg.vocab_size
    if any(not 0 <= t < vocab for t in body.prompt):
        raise ApiError(400, f"prompt token ids must lie in [0, {vocab})", "invalid_request_error", "prompt")
    return list(body.prompt), "text"


async def _complete(request: web.Request, model: type[Body]) -> web.StreamResponse:
    leader = request.app[LEADER]
    retry = leader.settings.retry_after_s
    param = "messages" if model is ChatRequest else "prompt"
    try:
        body = await _parse(request, model)
        refusal = body.unsupported()
        if refusal is not None:
            raise refusal
        # off the event loop: a long prompt's tokenization must not hold up heartbeats and the ring
        prompt, kind = await asyncio.to_thread(_prompt_ids, leader, body)
        job = _Job(leader, body, prompt, kind)
    except (ApiError, FlowSpecError) as e:
        return api_error(e, retry, param).response()
    request[JOB] = job
    if body.stream:
        return await until_hangup(request, _stream(request, job, retry, param))
    return await until_hangup(request, _whole(job, retry, param))


async def _whole(job: _Job, retry: int, param: str) -> web.Response:
    try:
        text = await whole_text(job)
    except Exception as e:
        return api_error(e, retry, param).response()
    return web.json_response(job.full(text))


async def _stream(request: web.Request, job: _Job, retry: int, param: str) -> web.StreamResponse:
    deltas = job.deltas()
    try:
        first = await anext(deltas, None)  # errors before any output still get a proper status code
    except Exception as e:
        await deltas.aclose()
        return api_error(e, retry, param).response()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)

    async def send(obj: dict | str) -> None:
        if job.body.relay_ids and isinstance(obj, dict) and obj.get("choices"):
            obj["token_ids"] = job.take_ids()  # for the agent relaying this reply (proxy.py)
        data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
        await resp.write(f"data: {data}\n\n".encode())

    try:
        if job.kind == "chat":
            await send(job.chunk(None, role=True))
        if first:
            await send(job.chunk(first[0], logprobs=first[1]))
        async for text, logprobs in deltas:
            await send(job.chunk(text, logprobs=logprobs))
        last = job.chunk(None, finish=job.finish_reason)
        last["stats"] = job.stats_dict()
        await send(last)
        if job.body.include_usage():
            await send({**job.chunk(None), "choices": [], "usage": job.usage()})
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    except Exception as e:
        err = api_error(e, retry, param)
        resp[REASON], resp[ERROR_STATUS] = err.reason, err.status
        with contextlib.suppress(ConnectionResetError):
            await send(err.body())
    finally:
        await deltas.aclose()
    with contextlib.suppress(ConnectionResetError):
        await send("[DONE]")
        await resp.write_eof()
    return resp


# ------------------------------------------------------------------------------------------------ handlers


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, ChatRequest)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, CompletionRequest)


async def models(request: web.Request) -> web.Response:
    """The served model under each of its names (catalog.py), its id in replies first."""
    served = request.app[SERVED]
    return web.json_response({"object": "list", "data": [
        {"id": name, "object": "model", "created": int(served.modified_at), "owned_by": "flowspec_p2p"}
        for name in served.names]})


async def health(request: web.Request) -> web.Response:
    leader = request.app[LEADER]
    ok = leader.ready
    body = {"status": "ok" if ok else "not_ready", "modes": leader.available_modes(),
            "default_mode": leader.default_mode()}
    view = request.app[CLUSTER_VIEW]
    if not ok and view is not None:  # say why, where the control plane knows: e.g. "no plan: short by 812 MB: ..."
        known = view()
        if inspect.isawaitable(known):
            known = await known
        if known.get("no_plan"):
            body["no_plan"] = known["no_plan"]
    return web.json_response(body, status=200 if ok else 503)


async def cluster(request: web.Request) -> web.Response:
    view = request.app[CLUSTER_VIEW]
    known: dict = {}
    if view is not None:
        known = view()
        if inspect.isawaitable(known):
            known = await known
    leader = {**request.app[LEADER].snapshot(), "rss_bytes": psutil.Process().memory_info().rss}
    return web.json_response({**known, "leader": leader})


def create_app(leader: Leader, cluster_view: ClusterView | None = None, *, run_leader: bool = True,
               api_key: str | None = None, cors: tuple[str, ...] = (), timelines: Timelines | None = None,
               served: ServedModel | None = None) -> web.Application:
    """The API app. ``run_leader``: run ``leader.run()`` (the demultiplexer) for the app's lifetime
    (cleanup_ctx); pass False when the composition root already runs it in its own TaskGroup. ``api_key``: every
    route but /health needs it; ``cors``: browser origins allowed cross-origin. ``timelines``: the stages' busy
    intervals for the dashboard (cluster/telemetry.py), when there is a cluster. ``served``: what /v1/models and the
    Ollama routes list (default: the leader's model id and config)."""
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[access_log])
    secure_api(app, api_key, cors)
    app[LEADER] = leader
    app[CLUSTER_VIEW] = cluster_view
    app[SERVED] = served or default_served(leader)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/cluster", cluster)
    install_ollama(app)  # Ollama's routes beside OpenAI's (ollama.py)
    install_metrics(app, leader, cluster_view)
    install_dashboard(app, leader, cluster_view, timelines)
    if run_leader:
        app.cleanup_ctx.append(_leader_task)
    return app


async def _leader_task(app: web.Application) -> AsyncIterator[None]:
    leader = app[LEADER]
    task = asyncio.get_running_loop().create_task(leader.run(), name="leader-demux")
    yield
    task.cancel()
    await asyncio.wait([task])  # unlike suppress(CancelledError), never swallows the caller's own cancellation
    leader.close()
