"""``flowspec chat``: talk to a running cluster from the terminal, through the leader's OpenAI-compatible API.

Multi-turn: every reply joins the conversation the next message is sent with (``/reset`` starts over, ``/exit`` or
end of input ends). Replies stream to stdout as they are decided; with ``--stats`` each reply's statistics (mode,
tokens, tau, tokens/s) go to stderr. Ctrl-C during a reply stops it (the server stops decoding) and keeps the
conversation. A message on the command line is sent alone and the command exits.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import TextIO

from .. import env
from ..errors import FlowSpecError

log = logging.getLogger(__name__)

DEFAULT_URL = "http://127.0.0.1:8000"
HTTP_TIMEOUT_S = 300.0
PROMPT = "you> "


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="chat with a running cluster (streaming, multi-turn)",
                       description="Chat with the cluster whose leader serves --url. Replies stream as they are "
                       "decided; each reply joins the conversation. /reset starts over, /exit (or end of input) "
                       "ends. A MESSAGE on the command line is sent alone.")
    p.add_argument("message", nargs="*", help="send this one message and exit (default: a conversation)")
    p.add_argument("--url", default=DEFAULT_URL, help=f"the leader's API (default {DEFAULT_URL})")
    p.add_argument("--decoding", choices=["ar", "chunk", "pipedec", "flowspec"], default=None,
                   help="decoding mode (default: the leader's)")
    p.add_argument("--max-tokens", type=int, default=256, help="new tokens per reply at most (default 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); >0 samples")
    p.add_argument("--system", default=None, help="a system message that opens the conversation")
    p.add_argument("--api-key", default=None, help=f"the API's key, if it has one (prefer ${env.API_KEY})")
    p.add_argument("--stats", action="store_true", help="each reply's statistics on stderr")
    p.set_defaults(func=run)


class ChatClient:
    """Streams chat completions from the API at ``url`` (urllib: no event loop needed)."""

    def __init__(self, url: str, *, api_key: str | None = None, decoding: str | None = None, max_tokens: int = 256,
                 temperature: float = 0.0):
        self.url = url.rstrip("/")
        self.api_key, self.decoding = api_key, decoding
        self.max_tokens, self.temperature = max_tokens, temperature
        self.stats: dict = {}  # of the last reply

    def stream(self, messages: list[dict]) -> Iterator[str]:
        """The reply's text deltas. Raises FlowSpecError with the API's message when it refuses or fails."""
        body = {"messages": messages, "stream": True, "max_tokens": self.max_tokens, "temperature": self.temperature}
        if self.decoding:
            body["decoding"] = self.decoding
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.url + "/v1/chat/completions", json.dumps(body).encode(), headers)
        self.stats = {}
        try:
            with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT_S) as r:
                for raw in r:
                    line = raw.decode().strip()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[len("data: "):])
                    if "error" in event:
                        raise FlowSpecError(f"the reply failed: {event['error'].get('message')}")
                    for choice in event.get("choices", []):
                        piece = (choice.get("delta") or {}).get("content")
                        if piece:
                            yield piece
                    self.stats = event.get("stats") or self.stats
        except urllib.error.HTTPError as e:
            raise FlowSpecError(f"{self.url} answered {e.code}: {_api_message(e)}") from None
        except (urllib.error.URLError, OSError) as e:
            raise FlowSpecError(f"cannot reach the API at {self.url}: {getattr(e, 'reason', e)}") from None


def _api_message(e: urllib.error.HTTPError) -> str:
    try:
        return json.loads(e.read())["error"]["message"]
    except (ValueError, KeyError, TypeError, OSError):
        return e.reason


def describe(stats: dict) -> str:
    tps = stats.get("decode_tokens_per_s")
    return (f"[{stats.get('mode')}: {stats.get('new_tokens')} tokens, tau {stats.get('tau', 0):.2f}"
            + (f", {tps:.1f} tokens/s" if tps else "") + (f", resumed {stats['resumed']}x" if stats.get("resumed")
                                                         else "") + "]")


def reply(client: ChatClient, messages: list[dict], out: TextIO) -> str | None:
    """Stream one reply to ``out`` -> its text (None when it failed). Ctrl-C stops it early."""
    parts: list[str] = []
    try:
        for piece in client.stream(messages):
            parts.append(piece)
            out.write(piece)
            out.flush()
    except KeyboardInterrupt:
        out.write(" [stopped]")
    except FlowSpecError as e:
        out.write("\n")
        log.error("%s", e)
        return None
    out.write("\n")
    out.flush()
    return "".join(parts)


def converse(client: ChatClient, stdin: TextIO, out: TextIO, err: TextIO, *, system: str | None = None,
             stats: bool = False, interactive: bool = False) -> int:
    """Read messages from ``stdin`` line by line, stream each reply; -> the number of replies."""
    opening = [{"role": "system", "content": system}] if system else []
    messages = list(opening)
    replies = 0
    while True:
        if interactive:
            out.write(PROMPT)
            out.flush()
        line = stdin.readline()
        if not line or line.strip() == "/exit":
            return replies
        text = line.strip()
        if not text:
            continue
        if text == "/reset":
            messages = list(opening)
            err.write("(a new conversation)\n")
            continue
        messages.append({"role": "user", "content": text})
        answer = reply(client, messages, out)
        if answer is None:
            messages.pop()  # not answered: the next message replaces it
            continue
        messages.append({"role": "assistant", "content": answer})
        replies += 1
        if stats and client.stats:
            err.write(describe(client.stats) + "\n")


def run(args: argparse.Namespace) -> int:
    client = ChatClient(args.url, api_key=args.api_key or env.api_key(), decoding=args.decoding,
                        max_tokens=args.max_tokens, temperature=args.temperature)
    if args.message:
        messages = [*([{"role": "system", "content": args.system}] if args.system else []),
                    {"role": "user", "content": " ".join(args.message)}]
        ok = reply(client, messages, sys.stdout) is not None
        if ok and args.stats and client.stats:
            sys.stderr.write(describe(client.stats) + "\n")
        return 0 if ok else 1
    interactive = sys.stdin.isatty()
    if interactive:
        sys.stderr.write(f"chatting with {args.url} (/reset starts over, /exit or Ctrl-D ends)\n")
    try:
        converse(client, sys.stdin, sys.stdout, sys.stderr, system=args.system, stats=args.stats,
                 interactive=interactive)
    except KeyboardInterrupt:
        sys.stdout.write("\n")
    return 0
