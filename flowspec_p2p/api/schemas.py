"""The API's request bodies (OpenAI's chat and completions fields, plus ``decoding``, ``top_k`` and the bench's
``return_*`` flags) and its errors in OpenAI's shape; app.py serves them.

Every field the server accepts does what it says; the ones it cannot honour are refused with a 400 that names the
field (``unsupported``): tools and function calling, ``response_format`` other than text, non-zero penalties, a
``logit_bias``, ``echo``, ``suffix``. Every number is range-checked (a 400, never a 500); ``seed`` is a signed
64-bit integer."""

from __future__ import annotations

import logging
from typing import Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..errors import (
    Busy,
    ConfigError,
    ContextOverflow,
    FlowSpecError,
    InvalidRequest,
    NotReady,
    PeerGone,
    StageFailed,
)
from ..model.sampling import SamplingParams

log = logging.getLogger(__name__)

DEFAULT_TEMPERATURE = 1.0  # OpenAI's default
DEFAULT_MAX_TOKENS = 256
MAX_STOP_STRINGS = 4
MAX_TOP_LOGPROBS = 20
MAX_TOP_K = 1 << 20
MIN_TEMPERATURE = 1e-5  # below this (but above 0, greedy) logits / temperature can overflow
SEED_RANGE = (-(1 << 63), (1 << 63) - 1)
# Fields of other OpenAI-compatible servers that change the output, with the value that changes nothing: any other
# value is refused (unknown fields are otherwise ignored)
REFUSED_EXTRAS = {"repetition_penalty": 1.0, "min_p": 0.0, "typical_p": 1.0, "min_tokens": 0, "ignore_eos": False,
                  "guided_json": None, "guided_regex": None, "guided_choice": None, "guided_grammar": None,
                  "grammar": None, "json_schema": None, "prediction": None, "audio": None, "modalities": ["text"]}


# ------------------------------------------------------------------------------------------------ requests


class Body(BaseModel):
    """Fields shared by both endpoints. Unknown fields are ignored (REFUSED_EXTRAS excepted); known ones are
    type-checked strictly."""

    model_config = ConfigDict(extra="allow", strict=True, frozen=True)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(DEFAULT_TEMPERATURE, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=MAX_TOP_K)
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None
    n: int = Field(1, ge=1, le=1)
    decoding: str | None = Field(None, min_length=1, max_length=32)
    return_token_ids: bool = False  # stats carry "token_ids": the generated ids (benchmarks compare modes by them)
    # the prompt cache (llama-server's name): start from the KV an earlier request with the same prefix left on the
    # stages, and leave this one's for the next; false: a cold prefill, nothing taken or kept
    cache_prompt: bool = True
    return_leader_timeline: bool = False  # stats carry "leader_intervals": the leader's compute [start, end] pairs
    # for an agent relaying the request (proxy.py): each streamed chunk carries "token_ids", the ids behind its
    # text; and "resume_ids": the reply's ids already sent, which this reply continues after (failover)
    relay_ids: bool = False
    resume_ids: list[int] | None = Field(None, max_length=1 << 20)
    # the request's deadline, seconds from its arrival: a turn that does not come by then is a 503 (Retry-After), a
    # reply still decoding then ends with the text decided so far (finish_reason "length", stats.deadline_reached)
    timeout: float | None = Field(None, ge=0.001, le=86400.0)
    # accepted only at the values that change nothing (see unsupported()); the ranges are OpenAI's
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    response_format: dict | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    functions: list[dict] | None = None
    function_call: str | dict | None = None

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float) -> float:
        if 0.0 < v < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
            raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} non-empty strings")
        return stops

    def stop_strings(self) -> list[str]:
        return list(self.stop or [])

    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed)

    def budget(self) -> tuple[str, int | None]:
        """(the field that bounds the new tokens, its value; None: the server's default)."""
        if self.max_completion_tokens:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    def top_logprobs_wanted(self) -> int | None:
        """None: no logprobs; else how many alternatives per token."""
        return None

    def unsupported(self) -> ApiError | None:
        """The first field set to something this server cannot do, as the 400 to answer."""
        fmt = (self.response_format or {}).get("type", "text")
        refusals = [
            ("tools", bool(self.tools), "function calling (tools) is not supported"),
            ("tool_choice", self.tool_choice not in (None, "none", "auto"), "tools are not supported"),
            ("functions", bool(self.functions), "function calling is not supported"),
            ("function_call", self.function_call not in (None, "none", "auto"), "function calling is not supported"),
            ("response_format", fmt != "text", f"response_format {fmt!r} is not supported: only plain text"),
            ("frequency_penalty", self.frequency_penalty != 0.0, "penalties are not supported (only 0)"),
            ("presence_penalty", self.presence_penalty != 0.0, "penalties are not supported (only 0)"),
            ("logit_bias", bool(self.logit_bias), "logit_bias is not supported"),
            *self._refusals(),
            *((k, v != REFUSED_EXTRAS[k], "not supported by this server") for k, v in (self.model_extra or {}).items()
              if k in REFUSED_EXTRAS),
        ]
        for param, refused, why in refusals:
            if refused:
                return ApiError(400, f"{param}: {why}", "invalid_request_error", param, "unsupported_parameter")
        return None

    def _refusals(self) -> list[tuple[str, bool, str]]:
        return []


class _TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)

    type: Literal["text"]
    text: str


class _Message(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[_TextPart]

    def as_dict(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatRequest(Body):
    messages: list[_Message] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    def top_logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def _refusals(self) -> list[tuple[str, bool, str]]:
        return [("top_logprobs", self.top_logprobs is not None and not self.logprobs,
                 "top_logprobs needs logprobs: true")]


class CompletionRequest(Body):
    prompt: str | list[int] | list[str]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # the legacy API's: alternatives per token
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=1)

    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs

    def _refusals(self) -> list[tuple[str, bool, str]]:
        return [("echo", self.echo, "echo is not supported"), ("suffix", bool(self.suffix), "suffix is not supported")]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], str):
            if len(v) != 1:
                raise ValueError("only one prompt per request is supported")
            return v[0]
        return v


# ------------------------------------------------------------------------------------------------- errors

REASON = web.ResponseKey("reason", str)  # an error reply's reason, for the access log and /metrics
ERROR_STATUS = web.ResponseKey("error_status", int)  # a stream that failed after it started: its error's status


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str, param: str | None = None, code: str | None = None,
                 retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.retry_after = retry_after

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @property
    def reason(self) -> str:
        """What /metrics counts the error under."""
        return self.code or self.type

    def response(self) -> web.Response:
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after else None
        resp = web.json_response(self.body(), status=self.status, headers=headers)
        resp[REASON] = self.reason
        return resp


def api_error(e: BaseException, retry_after: int, prompt_param: str = "messages") -> ApiError:
    """``prompt_param``: the request field that holds the prompt (``messages`` or ``prompt``)."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, ContextOverflow):
        return ApiError(400, str(e), "invalid_request_error", prompt_param, "context_length_exceeded")
    if isinstance(e, InvalidRequest | ConfigError):
        return ApiError(400, str(e), "invalid_request_error", "decoding" if "mode" in str(e) else None)
    if isinstance(e, Busy):
        return ApiError(503, str(e), "server_busy", code="busy", retry_after=retry_after)
    if isinstance(e, NotReady | PeerGone):
        return ApiError(503, str(e), "cluster_unavailable", code="peer_gone" if isinstance(e, PeerGone) else
                        "not_ready", retry_after=retry_after)
    if isinstance(e, StageFailed):
        return ApiError(500, str(e), "stage_failed")
    if isinstance(e, FlowSpecError):
        return ApiError(500, str(e), "server_error")
    log.exception("unexpected error in a request", exc_info=e)
    return ApiError(500, f"internal error: {type(e).__name__}", "server_error")


def validation_error(e: ValidationError) -> ApiError:
    first = e.errors()[0]
    if first["type"] == "json_invalid":
        return ApiError(400, f"malformed JSON: {first['msg']}", "invalid_request_error")
    where = ".".join(str(x) for x in first["loc"])
    return ApiError(400, f"{where or 'body'}: {first['msg']}", "invalid_request_error", where or None)
