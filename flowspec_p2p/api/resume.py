"""Resuming a completion on the next leader (the member's API, proxy.py): ``Resumable`` asks the leader for the
token ids behind each streamed text delta (``relay_ids``), and when the leader is lost mid-reply -- its connection
breaks, or it stops answering and this agent's control plane turns to a new leader, or it says it stops -- it asks
the new leader to continue from the ids already sent (``resume_ids``): the new leader prefills prompt + those ids
and streams on, so the client gets the reply it would have had undisturbed (greedy, and seeded sampling: draws
depend only on (seed, position); a sampled request without a seed gets one here, before the first attempt). The
chunks keep the first reply's id. A reply that had not started yet is simply asked again. The last chunk's
``stats`` carry ``failover``: how often the reply moved, and the seconds from each loss to the next token.
Log-probabilities continue too: the next leader's come for the tokens after the resumed ones, and a completion's
``text_offset`` counts on from the last one sent (``LogprobsSoFar``; a non-streamed reply gets them all in one
object). ``OllamaResumable`` does the same for Ollama's /api/chat and /api/generate, in their shapes (NDJSON parts,
``options.seed``).
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

from .schemas import ApiError

log = logging.getLogger(__name__)

RELAY_PATH = "/relay"  # on the leader's agent server: its API, for the members' APIs
CONNECT_TIMEOUT_S = 5.0
LEADER_WAIT_S = 30.0  # a reply waits this long for a leader (none yet, or a new one after a loss)
SAME_LEADER_RETRY_S = 5.0  # after a break, the same leader is asked again when no other came within this
MOVE_GRACE_S = 1.0  # a leader's "cluster unavailable" answer is the client's unless the leader changes within this
RELAY_CODES = frozenset({"leader_unreachable", "not_leading"})  # the relay's own errors: the leader is not serving
MAX_MOVES = 4  # a reply moves to another leader at most this often
SEED_RANGE = (0, 2**63 - 1)


class LeaderLink(Protocol):
    """What the proxy needs of its agent: the leader's agent URL and the session that reaches it."""

    session: aiohttp.ClientSession

    def leader_url(self) -> str | None:
        """The agent URL of the leader this agent follows now (None: none yet)."""

    async def leader_change(self, url: str | None, timeout_s: float | None) -> str | None:
        """Wait until the leader is another than ``url`` (at most ``timeout_s``) -> leader_url()."""


def unavailable(why: str) -> web.Response:
    return ApiError(503, why, "cluster_unavailable", code="no_leader", retry_after=2).response()


def _error_of(data: bytes | dict) -> dict:
    """The ``error`` object of an API answer ({} when there is none)."""
    try:
        obj = json.loads(data) if isinstance(data, bytes) else data
    except ValueError:
        return {}
    err = obj.get("error") if isinstance(obj, dict) else None
    return err if isinstance(err, dict) else {}


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
    """One completion through the proxy (see the module docstring), in OpenAI's shapes (SSE; OllamaResumable:
    Ollama's)."""

    STREAM_DEFAULT = False

    def __init__(self, request: web.Request, link: LeaderLink, body: dict):
        self.request, self.link = request, link
        self.body = body
        self._pin_seed()  # every attempt draws the same (seed, position)
        self.stream = bool(body.get("stream", self.STREAM_DEFAULT))
        self.sent: list[int] = []  # token ids whose text the client has
        self.first: dict = {}  # the first reply's id and created
        self.moves: list[float] = []  # seconds from each loss to the next token
        self.lost_at: float | None = None
        self.resp: web.StreamResponse | None = None
        self.usage: dict | None = None
        self.logprobs = LogprobsSoFar()
        self.parts: list[str] = []  # the reply's text so far, over every attempt (a non-streamed reply's whole)

    def _pin_seed(self) -> None:
        if self.body.get("temperature", 1.0) != 0 and self.body.get("seed") is None:
            self.body["seed"] = secrets.randbelow(SEED_RANGE[1])

    def _payload(self) -> dict:
        payload = {**self.body, "stream": True, "relay_ids": True}
        if not self.stream:
            payload["stream_options"] = {"include_usage": True}
        return payload

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
            return unavailable(why)
        return await self._end(ApiError(503, why, "cluster_unavailable", code="no_leader").body())

    async def _end(self, error: dict) -> web.StreamResponse:
        """End a reply under way with ``error`` (an API error object)."""
        await self._open()
        await self._send(error)
        await self._send("[DONE]")
        return self.resp

    def _unavailable_answer(self, status: int, err: dict) -> bool:
        """A leader's answer that says the cluster is unavailable (it may be going: see whether it moved)."""
        return status == 503 and err.get("type") == "cluster_unavailable"

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
        payload = self._payload()
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
                if self._unavailable_answer(up.status, err) and await self._moved(url):
                    return None
                if self.resp is None:
                    return web.Response(status=up.status, body=data, content_type="application/json",
                                        headers={k: up.headers[k] for k in ("Retry-After",) if k in up.headers})
                return await self._end(json.loads(data or b"{}") or {"error": f"leader answered {up.status}"})
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
                return await self._end(obj)
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
            self._took(obj, ids, bool(choice.get("finish_reason")))
            if choice.get("logprobs"):
                self.logprobs.add(choice["logprobs"])
            text = choice.get("text", delta.get("content")) or ""
            self.parts.append(text)
            last = obj
            if self.stream:
                await self._open()
                await self._send(obj)
        return None  # the stream ended without [DONE]: the leader is gone

    def _took(self, obj: dict, ids: list[int], finished: bool) -> None:
        """A chunk with ``ids`` came: the reply's ids so far, and (after a loss) how long it took to resume."""
        if self.lost_at is not None and (ids or finished):
            self.moves[-1] = round(time.monotonic() - self.lost_at, 3)
            log.info("the reply resumed %.2f s after its leader was lost", self.moves[-1])
            self.lost_at = None
        if "stats" in obj and self.moves:
            obj["stats"]["failover"] = {"moves": len(self.moves), "seconds": self.moves}
        self.sent += ids

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


class OllamaResumable(Resumable):
    """A completion of the Ollama routes (/api/chat, /api/generate): NDJSON parts, the last one ``done``; Ollama's
    default sampling (temperature 0.8, a negative seed: a random one) gets its seed here as the OpenAI routes'."""

    STREAM_DEFAULT = True

    def _pin_seed(self) -> None:
        options = self.body.get("options")
        options = self.body["options"] = dict(options) if isinstance(options, dict) else {}
        seed = options.get("seed")
        if options.get("temperature", 0.8) != 0 and not (isinstance(seed, int) and seed >= 0):
            options["seed"] = secrets.randbelow(SEED_RANGE[1])

    def _payload(self) -> dict:
        return {**self.body, "stream": True, "relay_ids": True}

    def _unavailable_answer(self, status: int, err: dict) -> bool:
        return status == 503  # Ollama's errors are a message alone: not ready, or busy

    async def _fail(self, why: str) -> web.StreamResponse:
        if self.resp is None:
            return web.json_response({"error": why}, status=503, headers={"Retry-After": "2"})
        return await self._end({"error": why})

    async def _end(self, error: dict) -> web.StreamResponse:
        message = error.get("error")
        await self._open()
        await self._send({"error": message.get("message", str(message)) if isinstance(message, dict) else message})
        return self.resp

    async def _send(self, obj: dict | str) -> None:
        assert self.resp is not None
        assert isinstance(obj, dict)
        transport = self.request.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client left")
        await self.resp.write(json.dumps(obj, separators=(",", ":")).encode() + b"\n")

    async def _open(self) -> None:
        if self.resp is None:
            self.resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson",
                                                    "Cache-Control": "no-cache"})
            await self.resp.prepare(self.request)

    async def _relay(self, url: str, up: aiohttp.ClientResponse) -> web.StreamResponse | None:
        self.logprobs.moved()
        async for raw in up.content:
            if not raw.strip():
                continue
            obj = json.loads(raw)
            if "error" in obj:
                if await self._moved(url):
                    return None  # the leader stopped or was lost meanwhile: the reply goes on at the next one
                if self.resp is None and not self.stream:
                    return web.json_response(obj, status=500)
                return await self._end(obj)
            self._took(obj, obj.pop("token_ids", None) or [], bool(obj.get("done")))
            if obj.get("logprobs"):
                self.logprobs.add({"content": obj["logprobs"]})
            self.parts.append((obj.get("message") or {}).get("content") or obj.get("response") or "")
            if self.stream:
                await self._open()
                await self._send(obj)
            if obj.get("done"):
                return await self._finish(obj)
        return None  # the stream ended before its last part: the leader is gone

    async def _finish(self, last: dict | None) -> web.StreamResponse:
        if self.stream:
            with contextlib.suppress(ConnectionResetError):
                await self.resp.write_eof()
            return self.resp
        whole = dict(last or {})
        text = "".join(self.parts)
        if "message" in whole:
            whole["message"] = {**whole["message"], "content": text}
        else:
            whole["response"] = text
        if self.logprobs.merged is not None:
            whole["logprobs"] = self.logprobs.merged["content"]
        return web.json_response(whole)
