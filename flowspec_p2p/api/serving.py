"""What every completion route of the API shares, whatever shape its replies take (OpenAI's in app.py, Ollama's in
ollama.py): ``Job``, one validated request's generation (its budget and mode checked against the leader, its
ledger, the text deltas over the leader's chunks with stop strings applied), and ``until_hangup``, which cancels a
request's whole generation as soon as its client leaves."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable

from aiohttp import web

from ..decoding.leader import Leader
from ..ledger import Ledger, TokenLogprob, reply_stats
from ..model.tokenizer import Detokenizer
from .schemas import DEFAULT_MAX_TOKENS, REASON, ApiError, Body

log = logging.getLogger(__name__)

LEADER = web.AppKey("leader", Leader)  # the app's leader (create_app sets it)
HANGUP_POLL_S = 0.2  # how often a request's connection is checked: a client that left is cancelled within this


def mode_named(leader: Leader, model: str | None) -> str | None:
    """``model`` when it names a decoding mode (for clients that set only ``model``); any other name is not checked:
    the cluster serves one model."""
    return model if model in leader.modes else None


class Job:
    """One validated request: prompt ids, generation arguments (``body``), and the text layer over the leader's
    chunks. ``kind``: "chat" or "text". Raises ApiError / InvalidRequest / ContextOverflow for a request the leader
    cannot take (the budget over the context, an unknown mode)."""

    def __init__(self, leader: Leader, body: Body, prompt: list[int], kind: str):
        self.leader, self.body, self.prompt, self.kind = leader, body, prompt, kind
        settings = leader.settings
        param, max_tokens = body.budget()
        max_tokens = max_tokens or min(DEFAULT_MAX_TOKENS, settings.max_context)
        if max_tokens > settings.max_context:
            raise ApiError(400, f"{param} must be at most {settings.max_context}", "invalid_request_error", param)
        mode = body.decoding or mode_named(leader, body.model)
        self.spec, self.budget = leader.check(len(prompt), max_tokens, mode)
        self.resume = list(body.resume_ids or [])  # the reply's ids an earlier leader already sent (proxy.py)
        vocab = leader.head.cfg.vocab_size
        if len(self.resume) > self.budget or any(not 0 <= t < vocab for t in self.resume):
            raise ApiError(400, f"resume_ids must be at most {self.budget} token ids in [0, {vocab})",
                           "invalid_request_error", "resume_ids")
        self.deadline = None if body.timeout is None else time.monotonic() + body.timeout
        self.ledger = Ledger(mode=self.spec.name, prompt_tokens=len(prompt), top_logprobs=body.top_logprobs_wanted())
        self.finish_reason = "length"
        self.token_ids: list[int] = []
        self._ids_out = 0  # token_ids handed out with text (take_ids)

    def take_ids(self) -> list[int]:
        """The ids behind the text handed out since the last call (a relaying agent's ``relay_ids``)."""
        out = self.token_ids[self._ids_out:]
        self._ids_out = len(self.token_ids)
        return out

    def stats_dict(self) -> dict:
        """The reply's ``stats``: the ledger's view, with the token ids and the leader's compute intervals when
        asked for."""
        d = reply_stats(self.ledger)
        if self.body.return_token_ids:
            d["token_ids"] = list(self.token_ids)
        if self.body.return_leader_timeline:
            d["leader_intervals"] = [[round(a, 6), round(b, 6)] for a, b in self.ledger.leader_busy]
        return d

    async def deltas(self) -> AsyncIterator[tuple[str, list[TokenLogprob]]]:
        """Text deltas, each with the logprobs of the tokens behind it when the request asked for them (else
        none); sets ``finish_reason``. Closing it stops the generation (and releases the stages)."""
        tok = self.leader.tokenizer
        detok = Detokenizer(tok, self.body.stop_strings())
        stop_ids = tok.stop_ids
        detok.push(self.resume)  # their text went out before (by another leader): this reply continues after it
        noted = self.ledger.logprobs
        taken = 0

        def new_logprobs() -> list[TokenLogprob]:
            nonlocal taken
            out = noted[taken:] if noted is not None else []
            taken += len(out)
            return out

        if self.resume and (len(self.resume) >= self.budget or self.resume[-1] in stop_ids or detok.finished):
            if self.resume[-1] in stop_ids or detok.finished:
                self.finish_reason = "stop"
            return  # the reply was complete
        chunks = self.leader.generate(self.prompt + self.resume, params=self.body.sampling(),
                                      max_tokens=self.budget - len(self.resume),
                                      stop_ids=stop_ids, mode=self.spec.name, stats=self.ledger,
                                      cache_prompt=self.body.cache_prompt, deadline=self.deadline)
        async with contextlib.aclosing(chunks):
            async for ids in chunks:
                self.token_ids += ids
                text = detok.push(ids)
                if ids and ids[-1] in stop_ids:
                    self.finish_reason = "stop"
                if detok.finished:
                    self.finish_reason = "stop"
                    rest = new_logprobs()
                    if text or rest:
                        yield text, rest
                    return
                if text:
                    yield text, new_logprobs()
        tail, rest = detok.flush(), new_logprobs()
        if tail or rest:
            yield tail, rest


def _hung_up(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


async def whole_text(job: Job) -> str:
    """A request's whole reply, for a non-streamed answer: its deltas joined."""
    parts: list[str] = []
    async with contextlib.aclosing(job.deltas()) as deltas:
        async for text, _ in deltas:
            parts.append(text)
    return "".join(parts)


async def until_hangup(request: web.Request, work: Awaitable[web.StreamResponse]) -> web.StreamResponse:
    """Run ``work`` (a request's whole generation) and cancel it as soon as the client hangs up (looked at every
    HANGUP_POLL_S): the leader's turn and every stage's cache for the request are freed then, not when the reply
    would have ended. -> its response (a 499-like 400 nobody reads when the client left)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=HANGUP_POLL_S)
            if done:
                return task.result()
            if _hung_up(request):
                log.info("client %s hung up; cancelling its request", request.remote)
                task.cancel()
                await asyncio.wait({task})
                resp = web.Response(status=400, text="client closed the connection")
                resp[REASON] = "client_gone"
                return resp
    finally:
        if not task.done():  # the handler itself was cancelled (the server stops)
            task.cancel()
            await asyncio.wait({task})
