"""The API of an agent that does not lead: every route forwarded to the cluster's leader, so a client pointed at any
agent keeps working, and a streamed completion outlives the leader.

    client -> this agent's API -> (the cluster's authenticated session) -> leader's agent server /relay/<path>
           -> the leader's own API (app.py)

``forward`` passes one request through as it is (status, body, streamed or not). A completion
(``/v1/completions``, ``/v1/chat/completions``) goes through ``Resumable``: it asks the leader for the token ids
behind each streamed text delta (``relay_ids``), and when the leader is lost mid-reply -- its connection breaks, or
it stops answering and this agent's control plane turns to a new leader -- it asks the new leader to continue from
the ids already sent (``resume_ids``): the new leader prefills prompt + those ids and streams on, so the client
gets the reply it would have had undisturbed (greedy, and seeded sampling: draws depend only on (seed, position);
a sampled request without a seed gets one here, before the first attempt). The chunks keep the first reply's id.
A reply that had not started yet is simply asked again. The last chunk's ``stats`` carry ``failover``: how often
the reply moved, and the seconds from each loss to the next token. Log-probabilities continue too: the next
leader's come for the tokens after the resumed ones, and a completion's ``text_offset`` counts on from the last one
sent (``LogprobsSoFar``; a non-streamed reply gets them all in one object).

Everything else (the Ollama routes, /health, /cluster, /metrics, the dashboard) is forwarded without resuming.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from typing import Protocol

import aiohttp
from aiohttp import web

from .access import access_log
from .auth import secure_api
from .schemas import ApiError

log = logging.getLogger(__name__)

RELAY_PATH = "/relay"  # on the leader's agent server: its API, for the members' APIs
MAX_BODY_BYTES = 4 * 1024 * 1024
CONNECT_TIMEOUT_S = 5.0
LEADER_WAIT_S = 30.0  # a reply waits this long for a leader (none yet, or a new one after a loss)
SAME_LEADER_RETRY_S = 5.0  # after a break, the same leader is asked again when no other came within this
MOVE_GRACE_S = 1.0  # a leader's "cluster unavailable" answer is the client's unless the leader changes within this
RELAY_CODES = frozenset({"leader_unreachable", "not_leading"})  # the relay's own errors: the leader is not serving
MAX_MOVES = 4  # a reply moves to another leader at most this often
RESUMABLE = frozenset({"/v1/completions", "/v1/chat/completions"})
PASSED_HEADERS = ("Content-Type", "Accept", "Last-Event-ID")
RETURNED_HEADERS = ("Content-Type", "Retry-After", "Cache-Control", "Content-Encoding")
SEED_RANGE = (0, 2**63 - 1)


class LeaderLink(Protocol):
    """What the proxy needs of its agent: the leader's agent URL and the session that reaches it."""

    session: aiohttp.ClientSession

    def leader_url(self) -> str | None:
        """The agent URL of the leader this agent follows now (None: none yet)."""

    async def leader_change(self, url: str | None, timeout_s: float | None) -> str | None:
        """Wait until the leader is another than ``url`` (at most ``timeout_s``) -> leader_url()."""


def _unavailable(why: str) -> web.Response:
    return ApiError(503, why, "cluster_unavailable", code="no_leader", retry_after=2).response()


def not_leading() -> web.Response:
    """The relay's answer on an agent that does not lead (any more)."""
    return ApiError(503, "this agent does not lead the cluster", "cluster_unavailable", code="not_leading",
                    retry_after=2).response()


def _error_of(data: bytes | dict) -> dict:
    """The ``error`` object of an API answer ({} when there is none)."""
    try:
        obj = json.loads(data) if isinstance(data, bytes) else data
    except ValueError:
        return {}
    err = obj.get("error") if isinstance(obj, dict) else None
    return err if isinstance(err, dict) else {}


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


class LogprobsSoFar:
    """The log-probabilities of a reply that may move between leaders: each leader's completion ``text_offset``s
    count from its own first token, so those after a move are shifted by the offset the reply had reached; and the
    whole reply's, for a non-streamed answer. Chat logprobs (``content``) carry no offsets."""

    COMPLETION = ("tokens", "token_logprobs", "top_logprobs", "text_offset")

    def __init__(self):
        self.merged: dict | None = None
        self.offset = 0  # the text_offset after the last token whose logprobs went out
        self.base = 0  # what this attempt's text_offsets add

    def moved(self) -> None:
        """A new attempt (on the next leader) starts: its offsets count from 0 again."""
        self.base = self.offset

    def add(self, lp: dict) -> None:
        """One chunk's ``logprobs`` (changed in place: its offsets made the whole reply's)."""
        if "text_offset" in lp:
            lp["text_offset"] = [o + self.base for o in lp["text_offset"]]
            if lp["text_offset"]:
                self.offset = lp["text_offset"][-1] + len(lp["tokens"][-1])
            merged = self.merged or {k: [] for k in self.COMPLETION}
            for k in self.COMPLETION:
                merged[k] = [*merged[k], *(lp.get(k) or [])]
        else:
            merged = self.merged or {"content": [], "refusal": None}
            merged["content"] = [*merged["content"], *(lp.get("content") or [])]
        self.merged = merged


class _Lost(Exception):
    """The leader a reply was streaming from is not this agent's leader any more."""


class Resumable:
    """One completion through the proxy (see the module docstring)."""

    def __init__(self, request: web.Request, link: LeaderLink, body: dict):
        self.request, self.link = request, link
        self.body = body
        if body.get("temperature", 1.0) != 0 and body.get("seed") is None:
            body["seed"] = secrets.randbelow(SEED_RANGE[1])  # every attempt draws the same (seed, position)
        self.stream = bool(body.get("stream"))
        self.sent: list[int] = []  # token ids whose text the client has
        self.first: dict = {}  # the first reply's id and created
        self.moves: list[float] = []  # seconds from each loss to the next token
        self.lost_at: float | None = None
        self.resp: web.StreamResponse | None = None
        self.usage: dict | None = None
        self.logprobs = LogprobsSoFar()
        self.parts: list[str] = []  # the reply's text so far, over every attempt (a non-streamed reply's whole)

    async def run(self) -> web.StreamResponse:
        try:
            return await self._run()
        except ConnectionResetError:  # the client left: so does the reply (the leader's stops with it)
            return self.resp or web.Response(status=400, text="client closed the connection")

    async def _run(self) -> web.StreamResponse:
        path = self.request.path
        url = self.link.leader_url() or await self.link.leader_change(None, LEADER_WAIT_S)
        while True:
            if url is None:
                return await self._fail("no leader: the cluster is electing one; retry shortly")
            try:
                done = await self._until_lost(url, self._attempt(url, path))
            except ConnectionResetError:
                raise
            except (aiohttp.ClientError, OSError, TimeoutError, _Lost) as e:
                log.warning("a reply through leader %s broke (%s); resuming after %d token(s)", url,
                            e or type(e).__name__, len(self.sent))
                done = None
            if done is not None:
                return done
            if self.lost_at is None:
                self.lost_at = time.monotonic()
            if len(self.moves) >= MAX_MOVES:
                return await self._fail("the reply lost its leader too often")
            self.moves.append(float("nan"))  # filled in by the next token
            nxt = await self.link.leader_change(url, SAME_LEADER_RETRY_S)
            url = nxt if nxt is not None else await self.link.leader_change(None, LEADER_WAIT_S)

    async def _until_lost(self, url: str, work):
        """``work`` (one attempt on the leader at ``url``), unless this agent's leader changes first (the leader
        froze, or went away without closing its connections): then _Lost."""
        attempt = asyncio.ensure_future(work)
        changed = asyncio.ensure_future(self.link.leader_change(url, None))
        try:
            await asyncio.wait({attempt, changed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            changed.cancel()
            if not attempt.done():
                attempt.cancel()
                await asyncio.wait({attempt})
        if attempt.cancelled():
            raise _Lost(f"leader {url} is not this agent's leader any more")
        return attempt.result()

    async def _fail(self, why: str) -> web.StreamResponse:
        if self.resp is None:
            return _unavailable(why)
        await self._send(ApiError(503, why, "cluster_unavailable", code="no_leader").body())
        await self._send("[DONE]")
        return self.resp

    async def _send(self, obj: dict | str) -> None:
        assert self.resp is not None
        transport = self.request.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client left")
        data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
        await self.resp.write(f"data: {data}\n\n".encode())

    async def _attempt(self, url: str, path: str) -> web.StreamResponse | None:
        """One try on the leader at ``url``. -> the finished response, or None when the reply may go on elsewhere
        (the leader answered 503 before starting: it is not ready, or not the leader any more)."""
        payload = {**self.body, "stream": True, "relay_ids": True}
        if not self.stream:
            payload["stream_options"] = {"include_usage": True}
        if self.sent:
            payload["resume_ids"] = self.sent
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S)
        async with self.link.session.post(url + RELAY_PATH + path, json=payload, timeout=timeout) as up:
            if up.status != 200:
                data = await up.read()
                err = _error_of(data)
                if up.status in (502, 503) and err.get("code") in RELAY_CODES:
                    raise _Lost(f"leader {url} does not serve: {err.get('message')}")  # it stops, or leads no more
                if up.status in (502, 503) and self.lost_at is not None:
                    await asyncio.sleep(0.2)  # a leader that is only starting to lead
                    return None
                if up.status == 503 and err.get("type") == "cluster_unavailable" and await self._moved(url):
                    return None
                if self.resp is None:
                    return web.Response(status=up.status, body=data, content_type="application/json",
                                        headers={k: up.headers[k] for k in ("Retry-After",) if k in up.headers})
                await self._send(json.loads(data or b"{}") or {"error": {"message": f"leader answered {up.status}"}})
                await self._send("[DONE]")
                return self.resp
            return await self._relay(url, up)

    async def _relay(self, url: str, up: aiohttp.ClientResponse) -> web.StreamResponse | None:
        resumed = bool(self.sent) or self.lost_at is not None
        self.logprobs.moved()
        last: dict | None = None
        async for data in self._events(url, up):
            if data == "[DONE]":
                return await self._finish(last)
            obj = json.loads(data)
            if "error" in obj and "choices" not in obj:
                if _error_of(obj).get("type") == "cluster_unavailable" and await self._moved(url):
                    return None  # the leader stopped or was lost meanwhile: the reply goes on at the next one
                if self.resp is None and not self.stream:
                    return web.json_response(obj, status=503 if "unavailable" in json.dumps(obj) else 500)
                await self._open()
                await self._send(obj)
                await self._send("[DONE]")
                return self.resp
            ids = obj.pop("token_ids", None) or []
            if "usage" in obj and not obj.get("choices"):
                self.usage = obj["usage"]  # the leader counts the resumed ids among the completion's
                if self.stream:
                    await self._open()
                    await self._send(obj)
                continue
            choice = (obj.get("choices") or [{}])[0]
            delta = choice.get("delta") or {}
            if resumed and "role" in delta:
                continue  # the new leader's opening chunk: the client has it
            if not self.first:
                self.first = {k: obj[k] for k in ("id", "created") if k in obj}
            else:
                obj.update({k: v for k, v in self.first.items() if k in obj})
            if self.lost_at is not None and (ids or choice.get("finish_reason")):
                self.moves[-1] = round(time.monotonic() - self.lost_at, 3)
                log.info("the reply resumed %.2f s after its leader was lost", self.moves[-1])
                self.lost_at = None
            if "stats" in obj and self.moves:
                obj["stats"]["failover"] = {"moves": len(self.moves), "seconds": self.moves}
            self.sent += ids
            if choice.get("logprobs"):
                self.logprobs.add(choice["logprobs"])
            text = choice.get("text", delta.get("content")) or ""
            self.parts.append(text)
            last = obj
            if self.stream:
                await self._open()
                await self._send(obj)
        return None  # the stream ended without [DONE]: the leader is gone

    async def _moved(self, url: str) -> bool:
        """After the leader at ``url`` said the cluster is unavailable: whether this agent follows another leader
        (or none) within MOVE_GRACE_S -- the leader stopped or was lost, so the reply resumes."""
        return await self.link.leader_change(url, MOVE_GRACE_S) != url

    async def _events(self, url: str, up: aiohttp.ClientResponse) -> AsyncIterator[str]:
        """The upstream's SSE data."""
        async for raw in up.content:
            text = raw.decode(errors="replace").strip()
            if text.startswith("data: "):
                yield text[6:]

    async def _open(self) -> None:
        if self.resp is None:
            self.resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await self.resp.prepare(self.request)

    async def _finish(self, last: dict | None) -> web.StreamResponse:
        if self.stream:
            await self._open()
            await self._send("[DONE]")
            with contextlib.suppress(ConnectionResetError):
                await self.resp.write_eof()
            return self.resp
        return web.json_response(_whole(self.parts, last, self.first, self.usage, self.logprobs.merged))


def _whole(parts: list[str], last: dict | None, first: dict, usage: dict | None, logprobs: dict | None) -> dict:
    """A non-streamed reply assembled from the streamed chunks."""
    last = last or {}
    choice = (last.get("choices") or [{}])[0]
    text = "".join(parts)
    chat = last.get("object", "").startswith("chat")
    out_choice = {"index": 0, "finish_reason": choice.get("finish_reason"), "logprobs": logprobs}
    if chat:
        out_choice["message"] = {"role": "assistant", "content": text}
    else:
        out_choice["text"] = text
    out = {"id": first.get("id", last.get("id")), "object": "chat.completion" if chat else "text_completion",
           "created": first.get("created", last.get("created")), "model": last.get("model"),
           "choices": [out_choice]}
    if usage is not None:
        out["usage"] = usage
    if "stats" in last:
        out["stats"] = last["stats"]
    return out


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
                return await Resumable(request, link, body).run()
        url = link.leader_url()
        if url is None:
            return _unavailable("no leader yet: the cluster is starting or electing one; retry shortly")
        return await forward(request, url + RELAY_PATH + request.path, link.session)

    app.router.add_route("*", "/{tail:.*}", handle)
    return app
