"""A stranger on the LAN (run as its own process by test_robustness.py): it holds IDLE idle TCP connections to an
agent server and floods its /auth/challenge, from source address SOURCE, until killed. Prints one JSON line once
its idle connections are made: {"idle": opened, "refused": count}.

    python tests/cluster/stranger.py HOST PORT IDLE SOURCE
"""

import asyncio
import json
import resource
import secrets
import ssl
import sys

from flowspec_p2p.cluster.handshake import CHALLENGE_PATH
from flowspec_p2p.cluster.identity import Identity

FLOODERS = 8


async def idle_connections(host: str, port: int, n: int, source: str) -> tuple[list, int]:
    """Open ``n`` TCP connections (a hundred at a time, each given 1 s) and hold them, sending nothing."""
    held, refused = [], 0

    async def one():
        try:
            return await asyncio.wait_for(asyncio.open_connection(host, port, local_addr=(source, 0)), 1.0)
        except (OSError, TimeoutError):
            return None

    for start in range(0, n, 100):
        for got in await asyncio.gather(*(one() for _ in range(min(100, n - start)))):
            if got is None:
                refused += 1
            else:
                held.append(got)
    return held, refused


async def flood(host: str, port: int, source: str, cert: str) -> None:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    while True:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host, port, ssl=ctx, local_addr=(source, 0)), 3)
            for _ in range(50):
                body = json.dumps({"v": 1, "cert": cert, "nonce": secrets.token_hex(32)}).encode()
                writer.write(f"POST {CHALLENGE_PATH} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
                await writer.drain()
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 3)
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                await reader.readexactly(length)
            writer.close()
        except (OSError, TimeoutError, asyncio.IncompleteReadError, ssl.SSLError, StopIteration, ValueError):
            await asyncio.sleep(0.05)


async def main() -> None:
    host, port, n, source = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    held, refused = await idle_connections(host, port, n, source)
    sys.stdout.write(json.dumps({"idle": len(held), "refused": refused}) + "\n")
    sys.stdout.flush()
    cert = Identity.generate().cert_pem.decode()
    await asyncio.gather(*(flood(host, port, source, cert) for _ in range(FLOODERS)))


if __name__ == "__main__":
    asyncio.run(main())
