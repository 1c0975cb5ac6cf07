"""A stranger on the LAN (run as its own process by test_robustness.py): it holds IDLE idle TCP connections to an
agent server and floods its /auth/challenge, from source address SOURCE, until killed. Prints one JSON line once
its idle connections are made: {"idle": opened, "refused": count}.

    python tests/cluster/stranger.py HOST PORT IDLE SOURCE
"""

import asyncio
import json
import resource
import secrets
import socket
import ssl
import sys

from flowspec_p2p.cluster.handshake import CHALLENGE_PATH
from flowspec_p2p.cluster.identity import Identity

FLOODERS = 8


def idle_connections(host: str, port: int, n: int, source: str) -> tuple[list[socket.socket], int]:
    held, refused = [], 0
    for _ in range(n):
        s = socket.socket()
        s.settimeout(2.0)
        try:
            s.bind((source, 0))
            s.connect((host, port))
            held.append(s)
        except OSError:
            refused += 1
            s.close()
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
    _held, _refused = await asyncio.to_thread(idle_connections, host, port, n, source)
    cert = Identity.generate().cert_pem.decode()
    await asyncio.gather(*(flood(host, port, source, cert) for _ in range(FLOODERS)))


if __name__ == "__main__":
    asyncio.run(main())
