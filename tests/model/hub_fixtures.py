"""A local stand-in for the Hugging Face hub (aiohttp, port 0): the resolve endpoint answers a HEAD as the hub does
(an LFS file: 302 to a CDN on another host with X-Linked-Etag = its SHA-256, X-Linked-Size, X-Repo-Commit; a small
file: 200 with its git blob id as ETag; a renamed repository: a relative 307), and the CDN serves Range requests.
Knobs make it drop a connection mid-file, serve corrupt bytes, or ask for a token; it records what it was sent."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from aiohttp import web

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class FakeHub:
    lfs: dict[str, bytes] = field(default_factory=dict)  # "owner/repo/file" -> bytes (LFS: on the CDN)
    small: dict[str, bytes] = field(default_factory=dict)  # "owner/repo/file" -> bytes (served by the hub itself)
    renamed: dict[str, str] = field(default_factory=dict)  # "old-owner/old-repo" -> "owner/repo"
    token: str | None = None  # required as a Bearer token when set
    drop_after: int | None = None  # the next CDN GETs stop after this many bytes of the body ...
    drops: int = 0  # ... this many times
    corrupt: bool = False  # the CDN flips a byte
    requests: list[tuple[str, str, dict]] = field(default_factory=list)  # (host, method path, headers)
    hub_url: str = ""
    cdn_url: str = ""

    def sha(self, key: str) -> str:
        return hashlib.sha256(self.lfs[key]).hexdigest()

    def _note(self, request: web.Request, where: str) -> None:
        self.requests.append((where, f"{request.method} {request.path}", dict(request.headers)))

    def _authorized(self, request: web.Request) -> bool:
        return self.token is None or request.headers.get("Authorization") == f"Bearer {self.token}"

    async def resolve(self, request: web.Request) -> web.StreamResponse:
        self._note(request, "hub")
        owner, repo, file = request.match_info["owner"], request.match_info["repo"], request.match_info["file"]
        moved = self.renamed.get(f"{owner}/{repo}")
        if moved is not None:
            raise web.HTTPTemporaryRedirect(f"/{moved}/resolve/{request.match_info['rev']}/{file}")
        if not self._authorized(request):
            raise web.HTTPUnauthorized(text="Invalid credentials")
        key = f"{owner}/{repo}/{file}"
        headers = {"X-Repo-Commit": COMMIT}
        if key in self.lfs:
            sha = self.sha(key)
            headers |= {"X-Linked-Etag": f'"{sha}"', "X-Linked-Size": str(len(self.lfs[key])),
                        "ETag": '"aaaabbbb"', "Location": f"{self.cdn_url}/cdn/{sha}"}
            return web.Response(status=302, headers=headers)
        if key in self.small:
            data = self.small[key]
            blob = hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()
            headers["ETag"] = f'"{blob}"'
            return web.Response(body=data, headers=headers)  # aiohttp sends no body to a HEAD
        raise web.HTTPNotFound(text="Entry not found")

    async def cdn(self, request: web.Request) -> web.StreamResponse:
        self._note(request, "cdn")
        data = next((v for v in self.lfs.values() if hashlib.sha256(v).hexdigest() == request.match_info["sha"]),
                    None)
        if data is None:
            raise web.HTTPNotFound()
        if self.corrupt:
            data = bytes([data[0]]) + bytes([data[1] ^ 0xFF]) + data[2:]
        start = 0
        rng = request.http_range
        if rng.start is not None:
            start = rng.start
            if start >= len(data):
                raise web.HTTPRequestRangeNotSatisfiable()
        body = data[start:]
        status = 206 if start else 200
        headers = {"Content-Length": str(len(body)), "Accept-Ranges": "bytes"}
        if start:
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        resp = web.StreamResponse(status=status, headers=headers)
        await resp.prepare(request)
        if self.drops > 0 and self.drop_after is not None:
            self.drops -= 1
            await resp.write(body[: self.drop_after])
            request.transport.close()  # the connection drops mid-file
            return resp
        await resp.write(body)
        await resp.write_eof()
        return resp

    def apps(self) -> tuple[web.Application, web.Application]:
        hub = web.Application()
        hub.router.add_route("*", "/{owner}/{repo}/resolve/{rev}/{file:.+}", self.resolve)
        cdn = web.Application()
        cdn.router.add_get("/cdn/{sha}", self.cdn)
        return hub, cdn


async def start(hub: FakeHub) -> list[web.AppRunner]:
    """Serve ``hub`` on two loopback ports (the hub and its CDN: two hosts as far as a client can tell)."""
    runners = []
    for app, attr in zip(hub.apps(), ("hub_url", "cdn_url"), strict=True):
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        setattr(hub, attr, f"http://127.0.0.1:{runner.addresses[0][1]}")
        runners.append(runner)
    return runners
