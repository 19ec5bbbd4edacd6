"""The exporter's own HTTP client (h11 on asyncio) and its server (prometheus_client's), over real loopback sockets.

Fake boundary: the peers. Each test's other side is a raw asyncio socket server or client in this
process, scripted byte for byte, so that a server closing a kept-alive connection, a redirect, or a
request no client library would send can be staged exactly. The end-to-end paths (a real exporter
process against engines) are in test_exporter_faults.py and test_exporter_vllm.py.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Awaitable, Callable

import aiohttp
import pytest

from batchlens.config import Engine
from batchlens.exporter.http_get import HttpGetter
from batchlens.exporter.http_serve import Answer, HttpServer
from batchlens.exporter.sampler import SourceError
from batchlens.exporter.vllm_source import VllmSource
from batchlens.prometheus_api import Prometheus, PrometheusError
from batchlens.remediation.admin_client import AdminCallError, AdminClient
from harness.procs import free_port

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def ok(body: bytes, *extra: str) -> bytes:
    head = ["HTTP/1.1 200 OK", f"Content-Length: {len(body)}", *extra]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


async def read_request(reader: asyncio.StreamReader) -> bytes:
    return await reader.readuntil(b"\r\n\r\n")


async def peer(script: Script) -> tuple[str, asyncio.Server]:
    """A scripted server: its URL, and the server."""
    server = await asyncio.start_server(script, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return f"http://127.0.0.1:{port}", server


def run(coro: Awaitable) -> object:
    return asyncio.run(asyncio.wait_for(coro, 20))


def refusal_of(script: Script) -> SourceError:
    """The error one GET of the scripted peer's /metrics ends in (a 1 KiB limit, a 5 s timeout)."""

    async def main() -> None:
        url, server = await peer(script)
        getter = HttpGetter()
        try:
            await getter.text(url + "/metrics", timeout=5, limit=1024)
        finally:
            await getter.aclose()
            server.close()

    with pytest.raises(SourceError) as err:
        run(main())
    return err.value


def test_a_kept_alive_connection_is_reused_and_one_the_server_closed_is_retried_fresh() -> None:
    """uvicorn closes an idle connection after 5 s; a GET sent into it is sent again, once, on a new one."""
    connections = []

    async def main() -> list[str]:
        async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            connections.append(writer)
            await read_request(reader)
            writer.write(ok(b"first"))
            await writer.drain()
            if len(connections) == 1:
                await read_request(reader)  # the second request, on the same connection: kept alive
                writer.write(ok(b"second"))
                await writer.drain()
                await read_request(reader)
            writer.close()  # the third is never answered here: the server "timed out" the connection

        url, server = await peer(script)
        getter = HttpGetter()
        try:
            return [await getter.text(url + "/metrics", timeout=5, limit=1024) for _ in range(3)]
        finally:
            await getter.aclose()
            server.close()

    assert run(main()) == ["first", "second", "first"]
    assert len(connections) == 2  # one kept alive for two requests, a fresh one for the retry


def test_a_server_that_never_answers_on_a_fresh_connection_is_a_protocol_error_not_a_retry_loop() -> None:
    accepted = []

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        await read_request(reader)
        writer.close()

    err = refusal_of(script)
    assert err.reason == "protocol" and "without answering" in str(err)
    assert accepted == [1]


@pytest.mark.parametrize(
    ("answer", "reason", "says"),
    [
        # A redirect is not followed: it would carry the admin token wherever the answer points.
        (b"HTTP/1.1 302 Found\r\nLocation: http://203.0.113.9/steal\r\nContent-Length: 0\r\n\r\n", "http_302", "302"),
        (ok(b"x" * 2000), "too_large", "larger than 1024 bytes"),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n400\r\n"
            + b"y" * 1024
            + b"\r\n400\r\n"
            + b"y" * 1024,
            "too_large",
            "larger than 1024",
        ),
        (b"SSH-2.0-OpenSSH_9.2\r\n", "protocol", "not a valid HTTP/1.1 answer"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort", "protocol", "not a valid HTTP/1.1 answer"),
        (ok(b"\xff\xfe binary"), "parse", "not UTF-8"),
    ],
    ids=["redirect", "content-length over the limit", "chunked over the limit", "not http", "cut short", "binary"],
)
def test_each_bad_answer_is_one_bounded_reason(answer: bytes, reason: str, says: str) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(answer)
        await writer.drain()
        writer.close()

    err = refusal_of(script)
    assert err.reason == reason and says in str(err), str(err)


def test_a_hanging_body_times_out_and_a_refused_port_is_connect() -> None:
    async def main() -> tuple[SourceError, SourceError]:
        async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
            await writer.drain()
            await asyncio.sleep(30)

        url, server = await peer(script)
        getter = HttpGetter()
        errors = []
        for target in (url, "http://127.0.0.1:9"):
            try:
                await getter.text(target + "/metrics", timeout=0.5, limit=1024)
            except SourceError as exc:
                errors.append(exc)
        await getter.aclose()
        server.close()
        return errors[0], errors[1]

    timeout, refused = run(main())
    assert timeout.reason == "timeout" and "0.5s" in str(timeout)
    assert refused.reason == "connect" and "127.0.0.1:9" in str(refused)


def test_the_request_carries_the_path_query_host_and_url_credentials_but_a_given_authorization_wins() -> None:
    requests: list[bytes] = []

    async def main() -> None:
        async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                try:
                    requests.append(await read_request(reader))
                except asyncio.IncompleteReadError:
                    return
                writer.write(ok(b"fine"))
                await writer.drain()

        url, server = await peer(script)
        with_user = url.replace("http://", "http://ops:p%40ss@")
        getter = HttpGetter()
        await getter.text(with_user + "/prefix/metrics?x=1", timeout=5, limit=1024)
        await getter.text(with_user + "/admin", timeout=5, limit=1024, headers={"Authorization": "Bearer tok"})
        await getter.aclose()
        server.close()

    run(main())
    first, second = (r.decode() for r in requests)
    basic = base64.b64encode(b"ops:p@ss").decode()
    assert first.startswith("GET /prefix/metrics?x=1 HTTP/1.1\r\n") and f"Authorization: Basic {basic}" in first
    assert "@" not in first.split("\r\n")[1]  # Host: the address, never the credentials
    assert "Bearer tok" in second and "Basic" not in second


def serve(routes: dict, **options) -> Callable[[Callable[[str, int], Awaitable[object]]], object]:
    """Run ``test(host, port)`` against an HttpServer with ``routes``."""

    def runner(test: Callable[[str, int], Awaitable[object]]) -> object:
        async def main() -> object:
            server = HttpServer(routes, **options)
            probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
            port = probe.sockets[0].getsockname()[1]
            probe.close()
            await probe.wait_closed()
            await server.start("127.0.0.1", port)
            try:
                return await test("127.0.0.1", port)
            finally:
                await server.close()

        return run(main())

    return runner


async def exchange(host: str, port: int, data: bytes) -> bytes:
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(data)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 10)  # to the server's close: one request a connection
    writer.close()
    return answer


ROUTES = {"/metrics": lambda: Answer(200, "text/plain", b"up 1\n"), "/boom": lambda: 1 / 0}


def test_the_server_answers_get_and_head_one_request_a_connection_as_prometheus_clients_does() -> None:
    async def test(host: str, port: int) -> tuple[bytes, bytes]:
        first = await exchange(host, port, b"GET /metrics?x=1 HTTP/1.1\r\nHost: a\r\n\r\n")  # read to its close
        second = await exchange(host, port, b"HEAD /metrics HTTP/1.1\r\nHost: a\r\n\r\n")
        return first, second

    first, second = serve(ROUTES)(test)
    assert first.startswith(b"HTTP/1.0 200 ") and b"Content-Length: 5" in first and first.endswith(b"\r\n\r\nup 1\n")
    assert second.startswith(b"HTTP/1.0 200 ") and b"Content-Length: 5" in second  # HEAD: the length, no body
    assert second.endswith(b"\r\n\r\n")


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"GET /nowhere HTTP/1.1\r\nHost: a\r\n\r\n", b"404"),
        (b"POST /metrics HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\nhi", b"405"),
        (b"GET /metrics HTTP/1.1\r\nHost: a\r\nContent-Length: 70000\r\n\r\n" + b"z" * 70000, b"413"),
        (b"GET /boom HTTP/1.1\r\nHost: a\r\n\r\n", b"500"),
        (b"GARBAGE\r\n\r\n", b"400"),
        (b"GET /metrics HTTP/1.1\r\nHost: a\r\nX-Big: " + b"h" * 20000 + b"\r\n\r\n", b"431"),
        (b"GET /metrics HTTP/1.1\r\n\r\n", b"400"),  # HTTP/1.1 without Host
    ],
    ids=["unknown path", "post", "body too large", "handler fails", "not http", "headers too large", "no host"],
)
def test_the_server_answers_every_bad_request_with_its_status_and_keeps_serving(request_bytes, status) -> None:
    async def test(host: str, port: int) -> tuple[bytes, bytes]:
        bad = await exchange(host, port, request_bytes)
        good = await exchange(host, port, b"GET /metrics HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
        return bad, good

    bad, good = serve(ROUTES)(test)
    assert bad.split(b" ")[1] == status, bad[:200]
    assert good.startswith(b"HTTP/1.0 200 ") and good.endswith(b"up 1\n")


def test_an_idle_or_silent_client_is_dropped_and_connections_are_capped() -> None:
    async def test(host: str, port: int) -> tuple[bytes, bytes, bytes]:
        silent_reader, silent = await asyncio.open_connection(host, port)
        dropped = await asyncio.wait_for(silent_reader.read(), 5)  # EOF once the idle limit passed
        held = [await asyncio.open_connection(host, port) for _ in range(2)]
        await asyncio.sleep(0.1)
        over_reader, over = await asyncio.open_connection(host, port)
        await asyncio.sleep(0.1)  # closed unanswered by now: the request below is never read
        try:
            over.write(b"GET /metrics HTTP/1.1\r\nHost: a\r\n\r\n")
            refused = await asyncio.wait_for(over_reader.read(), 5)
        except ConnectionResetError:  # the server closed it first
            refused = b""
        for _, writer in held:
            writer.close()
        await asyncio.sleep(0.1)
        after = await exchange(host, port, b"GET /metrics HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
        silent.close()
        over.close()
        return dropped, refused, after

    dropped, refused, after = serve(ROUTES, idle_seconds=0.3, max_connections=2)(test)
    assert dropped == b"" and refused == b""
    assert after.startswith(b"HTTP/1.0 200 ")


def test_a_password_in_the_url_never_reaches_an_error_message() -> None:
    """Errors are logged; a user:password in an engine's URL is the scrape's secret (config masks it too). The
    admin client sends its own Authorization instead (a signature), and aiohttp refuses a URL's credentials beside
    it: so the URL it calls has none (it used to raise a ValueError that ended the hook's worker without a word)."""
    url = f"http://ops:s3cret@127.0.0.1:{free_port()}"  # nobody listens

    async def fail() -> list[str]:
        said = []
        with pytest.raises(SourceError) as scraped:
            await HttpGetter().text(url + "/metrics", timeout=2, limit=1024)
        said.append(str(scraped.value))
        async with aiohttp.ClientSession() as session:
            for token in (None, "admin-token"):
                with pytest.raises(AdminCallError) as called:
                    await AdminClient(session, url, token).get()
                said.append(str(called.value))
        return said

    said = run(fail())
    assert all("s3cret" not in line for line in said), said
    assert "ops:***@" in said[0] and "ops:***@" in said[1] and said[2].startswith("GET http://127.0.0.1:"), said


def test_a_token_with_a_newline_is_refused_before_it_is_sent_and_never_quoted() -> None:
    """A Secret made with --from-file ends in a newline; a tenant can put a control character in its own. Neither
    may reach a log line (h11 and aiohttp quote the header they refuse), nor end the hook's worker (aiohttp raises
    ValueError, which the admin client's callers did not expect)."""
    heard: list[bytes] = []

    async def listen(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        heard.append(await reader.read(4096))  # whatever arrives: nothing should
        writer.close()

    async def fail() -> list[str]:
        url, server = await peer(listen)
        said, bad = [], {"Authorization": "Bearer s3cr3t\n"}
        with pytest.raises(SourceError) as scraped:
            await HttpGetter().text(url + "/metrics", timeout=2, limit=1024, headers=bad)
        said.append(str(scraped.value))
        async with aiohttp.ClientSession() as session:
            with pytest.raises(AdminCallError) as called:
                await AdminClient(session, url, "s3cr3t\nX", signed=False).get()  # signed, the token is never sent
            said.append(str(called.value))
            server.close()
            await server.wait_closed()
            with pytest.raises(PrometheusError) as queried:  # a Prometheus URL's password, as the report logs it
                await Prometheus(session, url.replace("//", "//admin:s3cr3t@"), 2.0)._get("/api/v1/query")
            said.append(str(queried.value))
        return said

    said = run(fail())
    assert all("s3cr3t" not in line for line in said), said
    assert "a header is not valid HTTP" in said[0] and "not sent" in said[1] and "admin:***@" in said[2], said
    assert not any(b"s3cr3t" in got for got in heard), heard


def test_the_exporters_own_messages_mask_an_engine_urls_password() -> None:
    engine = Engine(name="e", url="http://u:s3cret@127.0.0.1:9")
    source = VllmSource(engine, HttpGetter(), timeout=1, max_response_bytes=1024, environ={})
    with pytest.raises(SourceError) as unparsed:
        source._digest("this is not an exposition\n", None)
    assert "s3cret" not in str(unparsed.value) and "u:***@" in str(unparsed.value)
