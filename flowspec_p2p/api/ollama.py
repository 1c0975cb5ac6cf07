"""The Ollama-compatible API beside the OpenAI one, for clients that speak Ollama's (Home Assistant's Ollama
integration, Open WebUI, the ``ollama`` Python client): the same leader, decoding modes, limits, API key (auth.py)
and refusals, in Ollama's shapes.

    POST /api/chat       messages -> chat template -> reply; NDJSON stream (Ollama's default) or one object with
                         ``"stream": false``; the last object has done_reason and Ollama's counters (nanoseconds)
    POST /api/generate   prompt (+ system; ``raw``, or a model without a chat template: no template, the BOS first
                         where the tokenizer adds one; ``context``: the ids of an earlier reply, continued) -> the
                         same, ``context`` (prompt + reply ids) in the last object; an empty prompt: done_reason "load"
    GET  /api/tags       the served model under each of its names (catalog.py), as name:latest
    POST /api/show       its details, model_info, template and parameters
    GET  /api/ps         the model running (always the one)
    GET  /api/version    the Ollama API level followed

``model`` is read as on the OpenAI routes: a decoding mode's name (``flowspec``, ``ar:latest``, ...) picks the mode,
any other name means the served model (``decoding``, an extension, names the mode too). ``options`` maps onto the
same sampling as the OpenAI routes: temperature, top_k, top_p (Ollama's defaults 0.8, 40, 0.9 when absent), seed
(negative: random), num_predict (absent or -1/-2: until a stop or the context limit), stop. Options that would
change the output in a way we cannot (repeat_penalty, presence/frequency_penalty, min_p, typical_p, tfs_z,
mirostat) are refused with a 400 naming them unless they are at their neutral value; options that size Ollama's
runtime (num_ctx, num_gpu, num_thread, ...) are accepted and ignored, as is keep_alive. ``tools``, ``format`` (JSON
mode, schemas), ``images``, ``think``, ``suffix`` and ``template`` get a 400 naming the field. Models are not pulled,
created, copied or deleted over this API (``flowspec models`` on the leader's device does that): a 400 says so.

Errors are Ollama's ``{"error": "..."}`` with the status the OpenAI routes give (400, 503 + Retry-After, 500); after a
stream has started, an error arrives as a last ``{"error": ...}`` line.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import logging
import time
from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..decoding.leader import Leader
from ..errors import FlowSpecError
from ..ledger import TokenLogprob
from ..model.tokenizer import is_base
from .access import JOB
from .catalog import SERVED, ServedModel
from .logprobs import chat_logprobs
from .schemas import ERROR_STATUS, MAX_TOP_LOGPROBS, REASON, ApiError, Body, api_error, validation_error
from .serving import LEADER, Job, until_hangup, whole_text

log = logging.getLogger(__name__)

API_VERSION = "0.12.0"  # the Ollama API level these routes follow
NS = 1_000_000_000
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}  # Ollama's, when a request sets none
NEUTRAL = {"repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_p": 0.0, "typical_p": 1.0,
           "tfs_z": 1.0, "mirostat": 0}  # accepted only at these values
IGNORED = {"num_ctx", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all", "vocab_only",
           "use_mmap", "use_mlock", "embedding_only", "num_thread", "numa", "num_keep", "repeat_last_n",
           "penalize_newline", "mirostat_tau", "mirostat_eta"}  # the runtime's sizing, or no effect without penalties
NOT_HERE = ("pull", "push", "create", "copy", "delete", "embed", "embeddings")



# ------------------------------------------------------------------------------------------------ requests


class _Message(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] | None = None
    tool_calls: list[dict] | None = None


class _Request(BaseModel):
    """Fields both routes take. Unknown fields are ignored, as Ollama does."""

    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)

    model: str | None = None
    options: dict[str, Any] | None = None
    stream: bool = True
    format: str | dict | None = None
    keep_alive: str | int | float | None = None
    think: bool | str | None = None
    decoding: str | None = Field(None, min_length=1, max_length=32)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # for an agent relaying the request (proxy.py), as on the OpenAI routes: each part carries "token_ids", and
    # "resume_ids" are the reply's ids already sent, which this reply continues after (failover)
    relay_ids: bool = False
    resume_ids: list[int] | None = Field(None, max_length=1 << 20)

    def refusals(self) -> list[tuple[str, bool, str]]:
        return [("format", self.format not in (None, ""), "structured output (JSON mode, schemas) is not supported"),
                ("think", self.think not in (None, False), "this model does not support thinking"),
                ("top_logprobs", self.top_logprobs is not None and not self.logprobs, "needs logprobs: true")]


class ChatRequest(_Request):
    messages: list[_Message] = Field(default_factory=list)
    tools: list[dict] | None = None

    def refusals(self) -> list[tuple[str, bool, str]]:
        out = [("tools", bool(self.tools), "tool calling is not supported")]
        for i, m in enumerate(self.messages):
            out += [(f"messages.{i}.images", bool(m.images), "images are not supported: this model reads text"),
                    (f"messages.{i}.role", m.role == "tool", "tool messages are not supported (no tool calling)"),
                    (f"messages.{i}.tool_calls", bool(m.tool_calls), "tool calling is not supported")]
        return out + super().refusals()


class GenerateRequest(_Request):
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    context: list[int] | None = None
    suffix: str | None = None
    template: str | None = None
    images: list[str] | None = None

    def refusals(self) -> list[tuple[str, bool, str]]:
        return [("suffix", bool(self.suffix), "fill-in-the-middle (suffix) is not supported"),
                ("template", bool(self.template), "a custom template is not supported: the model's own is used"),
                ("images", bool(self.images), "images are not supported: this model reads text"),
                *super().refusals()]


class OllamaBody(Body):
    """The generation arguments an Ollama request maps to (Job reads these)."""

    logprobs_top: int | None = None

    def budget(self) -> tuple[str, int | None]:
        return "options.num_predict", self.max_tokens

    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs_top


def _refuse(param: str, why: str) -> ApiError:
    return ApiError(400, f"{param}: {why}", "invalid_request_error", param, "unsupported_parameter")


def _number(options: dict, key: str) -> Any:
    v = options.get(key, DEFAULTS.get(key))
    if isinstance(v, int) and not isinstance(v, bool) and key in ("temperature", "top_p"):
        return float(v)  # JSON writes 1.0 as 1
    return v


def to_body(req: _Request, leader: Leader) -> OllamaBody:
    """The OllamaBody of ``req``, or an ApiError (400) naming the first field or option it cannot honour."""
    for param, refused, why in req.refusals():
        if refused:
            raise _refuse(param, why)
    options = dict(req.options or {})
    for key, neutral in NEUTRAL.items():
        if key in options and options[key] is not None and options[key] != neutral:
            raise _refuse(f"options.{key}", f"not supported (only {neutral}): penalties and other samplers would "
                          "change the output")
    unknown = sorted(set(options) - set(NEUTRAL) - IGNORED - {"temperature", "top_k", "top_p", "seed",
                                                              "num_predict", "stop"})
    if unknown:
        log.debug("ignoring unknown options %s", unknown)
    predict = options.get("num_predict")
    if predict is not None and (isinstance(predict, bool) or not isinstance(predict, int) or predict == 0
                                or predict < -2):
        raise ApiError(400, "options.num_predict: a positive number of tokens, or -1 (until a stop or the context "
                       "limit)", "invalid_request_error", "options.num_predict")
    seed = options.get("seed")
    name = (req.model or "").removesuffix(":latest")
    fields = {"model": name or None, "temperature": _number(options, "temperature"),
              "top_p": _number(options, "top_p"), "top_k": _number(options, "top_k"),
              "seed": None if seed is None or (isinstance(seed, int) and seed < 0) else seed,
              "stop": options.get("stop"), "stream": req.stream, "decoding": req.decoding,
              "max_tokens": leader.settings.max_context if predict is None or predict < 0 else predict,
              "logprobs_top": (req.top_logprobs or 0) if req.logprobs else None,
              "relay_ids": req.relay_ids or None, "resume_ids": req.resume_ids}
    try:
        return OllamaBody(**{k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        if where not in ("model", "decoding", "stream"):  # the rest came from options
            where = "options." + ("stop" if where.startswith("stop") else where.replace("max_tokens", "num_predict"))
        raise ApiError(400, f"{where}: {first['msg']}", "invalid_request_error", where) from None


def _prompt(leader: Leader, req: _Request) -> list[int]:
    """The prompt's token ids ([] for an empty request: Ollama's "load the model")."""
    tok = leader.tokenizer
    if isinstance(req, ChatRequest):
        return tok.chat([{"role": m.role, "content": m.content} for m in req.messages]) if req.messages else []
    assert isinstance(req, GenerateRequest)
    before = list(req.context or [])
    vocab = leader.head.cfg.vocab_size
    if any(not 0 <= t < vocab for t in before):
        raise ApiError(400, f"context: token ids must lie in [0, {vocab})", "invalid_request_error", "context")
    if not req.prompt:
        return before
    if req.raw or is_base(tok):  # as Ollama's default template ({{ .Prompt }}) does for a model without one
        return before + (tok.encode(req.prompt) if before else tok.encode_raw(req.prompt))
    messages = ([{"role": "system", "content": req.system}] if req.system else []) + [
        {"role": "user", "content": req.prompt}]
    return before + tok.chat(messages)


# ------------------------------------------------------------------------------------------------ replies


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat().replace("+00:00", "Z")


class _OllamaJob(Job):
    def __init__(self, leader: Leader, body: OllamaBody, prompt: list[int], kind: str, model: str):
        super().__init__(leader, body, prompt, kind)
        self.model = model
        self.t0 = time.perf_counter()

    def part(self, text: str, logprobs: list[TokenLogprob] | None = None) -> dict:
        out: dict = {"model": self.model, "created_at": _now()}
        if self.kind == "chat":
            out["message"] = {"role": "assistant", "content": text}
        else:
            out["response"] = text
        out["done"] = False
        if logprobs and self.ledger.logprobs is not None:
            out["logprobs"] = chat_logprobs(logprobs, self.leader.tokenizer.decode)["content"]
        if self.body.relay_ids:
            out["token_ids"] = self.take_ids()  # for the agent relaying this reply (proxy.py)
        return out

    def last(self, text: str = "", logprobs: list[TokenLogprob] | None = None) -> dict:
        led = self.ledger
        out = {**self.part(text, logprobs), "done": True, "done_reason": self.finish_reason,
               "total_duration": int((time.perf_counter() - self.t0) * NS), "load_duration": 0,
               "prompt_eval_count": len(self.prompt) - led.cached_tokens,
               "prompt_eval_duration": int(led.prefill_s * NS), "eval_count": led.new_tokens + len(self.resume),
               "eval_duration": int(led.decode_s * NS)}
        if self.kind == "text":
            out["context"] = self.prompt + self.resume + self.token_ids
        out["stats"] = self.stats_dict()
        return out


def _error(e: BaseException, retry: int, param: str) -> tuple[ApiError, web.Response]:
    err = api_error(e, retry, param)
    headers = {"Retry-After": str(err.retry_after)} if err.retry_after else None
    resp = web.json_response({"error": err.message}, status=err.status, headers=headers)
    resp[REASON] = err.reason
    return err, resp


def _loaded(model: str, kind: str) -> web.Response:
    out: dict = {"model": model, "created_at": _now()}
    out |= {"message": {"role": "assistant", "content": ""}} if kind == "chat" else {"response": ""}
    return web.json_response({**out, "done": True, "done_reason": "load"})


async def _complete(request: web.Request, model: type[_Request]) -> web.StreamResponse:
    leader, served = request.app[LEADER], request.app[SERVED]
    retry = leader.settings.retry_after_s
    kind, param = ("chat", "messages") if model is ChatRequest else ("text", "prompt")
    try:
        try:
            req = model.model_validate_json(await request.read())
        except ValidationError as e:
            raise validation_error(e) from None
        body = to_body(req, leader)
        prompt = await asyncio.to_thread(_prompt, leader, req)
        name = req.model or f"{served.name}:latest"
        if not prompt:
            return _loaded(name, kind)
        job = _OllamaJob(leader, body, prompt, kind, name)
    except (ApiError, FlowSpecError) as e:
        return _error(e, retry, param)[1]
    request[JOB] = job
    if body.stream:
        return await until_hangup(request, _stream(request, job, retry, param))
    return await until_hangup(request, _whole(job, retry, param))


async def _whole(job: _OllamaJob, retry: int, param: str) -> web.Response:
    try:
        text = await whole_text(job)
    except Exception as e:
        return _error(e, retry, param)[1]
    return web.json_response(job.last(text, job.ledger.logprobs))


async def _stream(request: web.Request, job: _OllamaJob, retry: int, param: str) -> web.StreamResponse:
    deltas = job.deltas()
    try:
        first = await anext(deltas, None)  # errors before any output still get a proper status code
    except Exception as e:
        await deltas.aclose()
        return _error(e, retry, param)[1]
    resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson", "Cache-Control": "no-cache"})
    await resp.prepare(request)

    async def send(obj: dict) -> None:
        await resp.write(json.dumps(obj, separators=(",", ":")).encode() + b"\n")

    try:
        if first:
            await send(job.part(*first))
        async for text, logprobs in deltas:
            await send(job.part(text, logprobs))
        await send(job.last())
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    except Exception as e:
        err, _ = _error(e, retry, param)
        resp[REASON], resp[ERROR_STATUS] = err.reason, err.status
        with contextlib.suppress(ConnectionResetError):
            await send({"error": err.message})
    finally:
        await deltas.aclose()
    with contextlib.suppress(ConnectionResetError):
        await resp.write_eof()
    return resp


# ------------------------------------------------------------------------------------------------ handlers


async def chat(request: web.Request) -> web.StreamResponse:
    return await _complete(request, ChatRequest)


async def generate(request: web.Request) -> web.StreamResponse:
    return await _complete(request, GenerateRequest)


def _details(m: ServedModel) -> dict:
    return {"parent_model": "", "format": m.format, "family": m.family, "families": [m.family],
            "parameter_size": m.parameter_size(), "quantization_level": m.quantization}


def _entry(m: ServedModel, name: str) -> dict:
    tagged = name if ":" in name else f"{name}:latest"
    return {"name": tagged, "model": tagged, "modified_at": m.modified_iso(), "size": m.size, "digest": m.digest,
            "details": _details(m)}


async def tags(request: web.Request) -> web.Response:
    m = request.app[SERVED]
    return web.json_response({"models": [_entry(m, n) for n in m.names]})


async def ps(request: web.Request) -> web.Response:
    m = request.app[SERVED]
    far = datetime.datetime(2318, 1, 1, tzinfo=datetime.UTC).isoformat().replace("+00:00", "Z")  # never unloaded
    return web.json_response({"models": [{**_entry(m, m.name), "expires_at": far, "size_vram": 0,
                                          "context_length": m.context_length}]})


async def show(request: web.Request) -> web.Response:
    m = request.app[SERVED]
    try:
        body = json.loads(await request.read() or b"{}")
    except ValueError as e:
        return web.json_response({"error": f"malformed JSON: {e}"}, status=400)
    if not isinstance(body, dict) or not isinstance(body.get("model", body.get("name")), str):
        return web.json_response({"error": "model: the model's name is required"}, status=400)
    params = "\n".join(f"{k:<15}{v}" for k, v in DEFAULTS.items())
    modelfile = f"# flowspec_p2p serves this model; `flowspec models list` on its leader shows where it lies\n" \
                f"FROM {m.name}\n" + "".join(f"PARAMETER {k} {v}\n" for k, v in DEFAULTS.items())
    return web.json_response({"modelfile": modelfile, "parameters": params, "template": m.template,
                              "details": _details(m), "model_info": m.info, "capabilities": ["completion"],
                              "modified_at": m.modified_iso()})


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": API_VERSION})


def _not_here(what: str):
    message = (f"/api/{what} is not supported by flowspec_p2p: the cluster serves one model; `flowspec models pull` "
               "on the leader's device gets another" if what in ("pull", "push", "create", "copy", "delete")
               else f"/api/{what}: embeddings are not supported")

    async def handler(request: web.Request) -> web.Response:
        resp = web.json_response({"error": message}, status=400)
        resp[REASON] = "unsupported_endpoint"
        return resp

    return handler


def install_ollama(app: web.Application) -> None:
    """Mount the Ollama routes on ``app`` (its LEADER and SERVED set; the app's API key and CORS rules cover them)."""
    app.router.add_post("/api/chat", chat)
    app.router.add_post("/api/generate", generate)
    app.router.add_get("/api/tags", tags)
    app.router.add_post("/api/show", show)
    app.router.add_get("/api/ps", ps)
    app.router.add_get("/api/version", version)
    for what in NOT_HERE:
        app.router.add_route("*", f"/api/{what}", _not_here(what))
