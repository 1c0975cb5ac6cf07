"""The API's request bodies (OpenAI's chat and completions fields, plus ``decoding``, ``top_k`` and the bench's
``return_*`` flags) and its errors in OpenAI's shape; app.py serves them."""

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


# ------------------------------------------------------------------------------------------------ requests


class Body(BaseModel):
    """Fields shared by both endpoints. Unknown OpenAI fields are ignored; known ones are type-checked strictly."""

    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(DEFAULT_TEMPERATURE, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None
    n: int = Field(1, ge=1, le=1)
    decoding: str | None = Field(None, min_length=1, max_length=32)
    return_token_ids: bool = False  # stats carry "token_ids": the generated ids (benchmarks compare modes by them)
    return_leader_timeline: bool = False  # stats carry "leader_intervals": the leader's compute [start, end] pairs

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

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


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


class CompletionRequest(Body):
    prompt: str | list[int] | list[str]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], str):
            if len(v) != 1:
                raise ValueError("only one prompt per request is supported")
            return v[0]
        return v


# ------------------------------------------------------------------------------------------------- errors


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str, param: str | None = None, code: str | None = None,
                 retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.retry_after = retry_after

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after else None
        return web.json_response(self.body(), status=self.status, headers=headers)


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
