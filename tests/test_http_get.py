"""The exporter's HTTP client against a real socket server that closes a kept-alive connection unanswered."""

from __future__ import annotations

import asyncio
import itertools

from batchlens.exporter.http_get import HttpGetter


async def _serve_once_per_connection(seen: list[str]) -> asyncio.Server:
    """Answers the first GET on each connection and keeps it open; reads the second and closes unanswered, as a
    server does whose keep-alive ran out as the request arrived. ``seen``: each request's Authorization."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for answered in (True, False):
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:  # the client closed a connection it no longer needs
                break
            lines = head.decode().split("\r\n")
            seen.append(next(line.split(": ", 1)[1] for line in lines if line.lower().startswith("authorization:")))
            if not answered:
                break
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def test_a_get_sent_again_on_a_fresh_connection_is_signed_afresh() -> None:
    """The plugin takes each signature once: a retry that re-sent the first one would be refused (401)."""

    async def scenario() -> list[str]:
        seen: list[str] = []
        server = await _serve_once_per_connection(seen)
        port = server.sockets[0].getsockname()[1]
        counter = itertools.count()
        client = HttpGetter()
        try:
            for _ in range(2):
                body = await client.text(f"http://127.0.0.1:{port}/x", timeout=5, limit=100,
                                         headers=lambda: {"Authorization": f"signed {next(counter)}"})  # fmt: skip
                assert body == "ok"
        finally:
            await client.aclose()
            server.close()
            await server.wait_closed()
        return seen

    seen = asyncio.run(scenario())
    # The first GET; the second on the kept connection, closed unanswered; the second again, on a new one.
    assert seen == ["signed 0", "signed 1", "signed 2"]
