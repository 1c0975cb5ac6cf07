"""A member's API (api/proxy.py) against two fake leaders on loopback: the first breaks off a completion mid-reply,
the second continues it from the ids already sent. The client gets the whole reply once -- its text, and its
log-probabilities with completions' text offsets counting on -- streamed or not."""

import asyncio
import contextlib
import json

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from flowspec_p2p.api.proxy import RELAY_PATH, create_proxy_app

TOKENS = ["He", "llo", " wor", "ld"]  # one id each: 10, 11, 12, 13


def lp(texts: list[str], chat: bool, offset: int) -> dict:
    """What a leader sends for these tokens: offsets from its own first token (``offset`` before them)."""
    if chat:
        return {"content": [{"token": t, "logprob": -0.5, "bytes": list(t.encode()), "top_logprobs": []}
                            for t in texts], "refusal": None}
    offsets = [offset + sum(len(x) for x in texts[:i]) for i in range(len(texts))]
    return {"tokens": texts, "token_logprobs": [-0.5] * len(texts), "top_logprobs": [{t: -0.5} for t in texts],
            "text_offset": offsets}


def leader_app(chat: bool, *, breaks_after: int | None, seen: list, died=lambda: None) -> web.Application:
    """A leader's /relay: streams TOKENS[len(resume_ids):], one chunk each; ``breaks_after`` chunks, then it
    drops the connection (it died: ``died()``)."""

    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append(body)
        assert body["relay_ids"]
        assert body["stream"]
        start = len(body.get("resume_ids") or [])
        assert body.get("resume_ids", []) == list(range(10, 10 + start))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for n, i in enumerate(range(start, len(TOKENS))):
            if breaks_after is not None and n == breaks_after:
                died()
                request.transport.close()
                return resp
            text = TOKENS[i]
            own = sum(len(t) for t in TOKENS[start:i])  # this leader's text before this token
            choice = {"index": 0, "logprobs": lp([text], chat, own), "finish_reason": None,
                      **({"delta": {"content": text}} if chat else {"text": text})}
            chunk = {"id": f"x{start}", "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": 1, "model": "m", "choices": [choice], "token_ids": [10 + i]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        last = {"id": "y", "object": "chat.completion.chunk" if chat else "text_completion", "created": 2, "model": "m",
                "choices": [{"index": 0, "text": "", "delta": {}, "logprobs": None, "finish_reason": "length"}],
                "stats": {}}
        await resp.write(f"data: {json.dumps(last)}\n\ndata: [DONE]\n\n".encode())
        return resp

    app = web.Application()
    app.router.add_post(RELAY_PATH + "/{tail:.*}", handle)
    return app


class Link:
    """resume.LeaderLink: the first leader until it dies, then the second."""

    def __init__(self, session: aiohttp.ClientSession):
        self.session, self.url = session, ""
        self.changed = asyncio.Event()

    def turn_to(self, url: str) -> None:
        self.url = url
        self.changed.set()
        self.changed = asyncio.Event()

    def leader_url(self) -> str:
        return self.url

    async def leader_change(self, url, timeout_s):
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                while self.url == url:
                    await self.changed.wait()
        return self.url


@contextlib.asynccontextmanager
async def two_leaders(session: aiohttp.ClientSession, make):
    """A Link to a first leader that breaks off after two chunks and turns the link to a second one;
    ``make(breaks_after, died)`` builds a leader's app."""
    link = Link(session)
    second = TestServer(make(None, lambda: None))
    first = TestServer(make(2, lambda: link.turn_to(str(second.make_url("")).rstrip("/"))))
    await first.start_server()
    await second.start_server()
    link.turn_to(str(first.make_url("")).rstrip("/"))
    try:
        yield link
    finally:
        await first.close()
        await second.close()


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_a_reply_with_logprobs_moves_to_the_next_leader_whole(chat, stream):
    seen: list = []
    async with aiohttp.ClientSession() as session, two_leaders(
            session, lambda breaks_after, died: leader_app(chat, breaks_after=breaks_after, seen=seen, died=died)
    ) as link:
        body = {"max_tokens": 4, "temperature": 0, "logprobs": 1, "stream": stream,
                **({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})}
        path = "/v1/chat/completions" if chat else "/v1/completions"
        async with TestClient(TestServer(create_proxy_app(link))) as client:
            r = await client.post(path, json=body)
            assert r.status == 200
            if stream:
                chunks = [json.loads(line[6:]) for line in (await r.text()).splitlines()
                          if line.startswith("data: ") and line != "data: [DONE]"]
                choices = [c["choices"][0] for c in chunks if c["choices"][0].get("logprobs")]
                text = "".join(ch.get("text", (ch.get("delta") or {}).get("content")) or "" for ch in choices)
                if chat:
                    got = [e["token"] for ch in choices for e in ch["logprobs"]["content"]]
                else:
                    got = [o for ch in choices for o in ch["logprobs"]["text_offset"]]
                assert {c["id"] for c in chunks} == {"x0"}  # the first reply's id throughout
            else:
                whole = (await r.json())["choices"][0]
                text = whole["message"]["content"] if chat else whole["text"]
                got = ([e["token"] for e in whole["logprobs"]["content"]] if chat
                       else whole["logprobs"]["text_offset"])
    assert text == "Hello world"
    assert got == (TOKENS if chat else [0, 2, 5, 9])
    assert [len(b.get("resume_ids") or []) for b in seen] == [0, 2]


def ollama_leader(chat: bool, *, breaks_after: int | None, seen: list, died=lambda: None) -> web.Application:
    """A leader's Ollama route under /relay: NDJSON parts of TOKENS[len(resume_ids):], the last one done."""

    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append(body)
        start = len(body.get("resume_ids") or [])
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        for n, i in enumerate(range(start, len(TOKENS))):
            if breaks_after is not None and n == breaks_after:
                died()
                request.transport.close()
                return resp
            text = TOKENS[i]
            part = {"model": "m", "done": False, "token_ids": [10 + i],
                    "logprobs": [{"token": text, "logprob": -0.5, "bytes": [], "top_logprobs": []}],
                    **({"message": {"role": "assistant", "content": text}} if chat else {"response": text})}
            await resp.write(json.dumps(part).encode() + b"\n")
        last = {"model": "m", "done": True, "done_reason": "length", "eval_count": len(TOKENS), "stats": {},
                **({"message": {"role": "assistant", "content": ""}} if chat else {"response": ""})}
        await resp.write(json.dumps(last).encode() + b"\n")
        return resp

    app = web.Application()
    app.router.add_post(RELAY_PATH + "/{tail:.*}", handle)
    return app


@pytest.mark.parametrize("chat", [False, True], ids=["generate", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_an_ollama_reply_moves_to_the_next_leader_whole_with_its_seed(chat, stream):
    """Ollama's default sampling (temperature 0.8, no seed) gets a seed at the member, the same on every attempt."""
    seen: list = []
    async with aiohttp.ClientSession() as session, two_leaders(
            session, lambda breaks_after, died: ollama_leader(chat, breaks_after=breaks_after, seen=seen, died=died)
    ) as link:
        body = {"model": "m", "stream": stream, "logprobs": True, "options": {"seed": -1},
                **({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})}
        async with TestClient(TestServer(create_proxy_app(link))) as client:
            r = await client.post("/api/chat" if chat else "/api/generate", json=body)
            assert r.status == 200
            if stream:
                parts = [json.loads(line) for line in (await r.text()).splitlines() if line.strip()]
                assert parts[-1]["done"]
                assert all("token_ids" not in p for p in parts)
            else:
                parts = [await r.json()]
            text = "".join((p.get("message") or {}).get("content") or p.get("response") or "" for p in parts)
            tokens = [e["token"] for p in parts for e in p.get("logprobs") or []]
    assert text == "Hello world"
    assert tokens == TOKENS
    assert [len(b.get("resume_ids") or []) for b in seen] == [0, 2]
    seeds = {b["options"]["seed"] for b in seen}
    assert len(seeds) == 1
    assert seeds.pop() >= 0
