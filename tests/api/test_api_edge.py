"""The HTTP edge under a hostile client (`sshapi serve`, api/server.py and api/gate.py): half-sent
bodies cannot lock a valid user out, one address cannot hold every connection, the token is
checked before a body is read, and the header cap holds for a header sent in one piece.
Figures are printed as `FIGURE name: value`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path

import httpx
from api_helpers import Api, Keys, make_settings, server_process
from faults import figure

from api.config import load_config
from api.server import EdgeLimits, address_key
from api.settings import proxy_networks

# A job whose JSON body is large enough to take seconds at the test's pace.
SLOW_JOB = json.dumps({"host": "local", "argv": ["true", "x" * (16 << 10)]}).encode()


def post_head(port: int, length: int, token: str | None) -> bytes:
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    return (
        f"POST /v1/jobs HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{auth}"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


async def status_of(reader: asyncio.StreamReader, timeout: float) -> bytes:
    """The status line the server answers with, b"" if it closes without one, b"timeout"."""
    try:
        async with asyncio.timeout(timeout):
            return await reader.readline()
    except TimeoutError:
        return b"timeout"
    except ConnectionError:
        return b""


async def test_half_sent_bodies_cannot_lock_out_a_valid_user(
    config_file: Path, secret: str, keys: Keys, tmp_path: Path
) -> None:
    """At most 48 connections, against 216 that each send a POST header and one byte of a
    1,000-byte body (half with a valid token of their own, half with none): the 12 requests a
    valid user makes meanwhile, each on a new connection, all succeed, and a slow but honest
    upload (16 KiB sent at 3.4 KiB/s, above the 2 KiB/s minimum rate) is never the one closed
    to make room: it gets its answer."""
    settings_ = make_settings(tmp_path, config_file, "sqlite", None)
    extra = {
        "SSHAPI_MAX_CONNECTIONS": "48",
        "SSHAPI_BODY_TIMEOUT": "20",
        "SSHAPI_BODY_MIN_RATE": "2048",
    }
    with server_process(settings_, extra_env=extra) as (_, url):
        port = int(url.rsplit(":", 1)[1])
        async with httpx.AsyncClient(timeout=10) as client:
            api = Api(url, client, secret, load_config(config_file), settings_, keys)
            mallory = api.token("mallory")
            alice = api.auth("alice")
        held: list[asyncio.StreamWriter] = []

        async def attack(count: int) -> None:
            for n in range(count):
                with contextlib.suppress(OSError):
                    _, writer = await asyncio.open_connection("127.0.0.1", port)
                    writer.write(post_head(port, 1000, mallory if n % 2 else None) + b"{")
                    held.append(writer)

        async def upload() -> bytes:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(post_head(port, len(SLOW_JOB), api.token("alice")))
            with contextlib.suppress(ConnectionError):
                for start in range(0, len(SLOW_JOB), 1024):
                    writer.write(SLOW_JOB[start : start + 1024])
                    await writer.drain()
                    await asyncio.sleep(0.3)
            answer = await status_of(reader, 10)
            writer.close()
            return answer

        # No keep-alive: every request of the valid user needs a connection of its own.
        user = httpx.AsyncClient(timeout=5, limits=httpx.Limits(max_keepalive_connections=0))
        try:
            uploading = asyncio.create_task(upload())
            await attack(120)
            await asyncio.sleep(1.5)  # the attackers fall behind; the upload keeps up
            statuses: list[int] = []
            for _ in range(12):
                await attack(8)
                try:
                    statuses.append((await user.get(f"{url}/v1/jobs", headers=alice)).status_code)
                except httpx.HTTPError:
                    statuses.append(0)
                await asyncio.sleep(0.1)
            uploaded = await uploading
        finally:
            await user.aclose()
            for writer in held:
                writer.close()
    figure("valid user's 12 requests among 216 half-sent bodies (max 48): statuses", statuses)
    figure("slow honest upload's answer", uploaded.strip().decode())
    assert statuses == [200] * 12
    assert uploaded.startswith((b"HTTP/1.1 201", b"HTTP/1.1 202")), uploaded


async def test_one_address_cannot_hold_every_connection(config_file: Path, tmp_path: Path) -> None:
    """At most 8 connections from one address: the 9th from 127.0.0.1 is answered 429 and
    closed, while 127.0.0.3 is served, and 127.0.0.2 (a trusted proxy: its connections carry
    many clients) holds 12. Once 127.0.0.1's connections close, it is served again."""
    settings_ = make_settings(tmp_path, config_file, "sqlite", None)
    extra = {"SSHAPI_MAX_CONNECTIONS_PER_ADDRESS": "8", "SSHAPI_TRUSTED_PROXIES": "127.0.0.2"}

    def client(source: str) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            timeout=5, transport=httpx.AsyncHTTPTransport(local_address=source)
        )

    with server_process(settings_, extra_env=extra) as (_, url):
        port = int(url.rsplit(":", 1)[1])

        async def connect(source: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
            return await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))

        first = [await connect("127.0.0.1") for _ in range(8)]
        reader, writer = await connect("127.0.0.1")
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        ninth = await status_of(reader, 5)
        writer.close()
        async with client("127.0.0.3") as other:
            other_status = (await other.get(f"{url}/healthz")).status_code
        proxied = [await connect("127.0.0.2") for _ in range(12)]
        async with client("127.0.0.2") as proxy:
            proxy_status = (await proxy.get(f"{url}/healthz")).status_code
        for _, w in first + proxied:
            w.close()
        await asyncio.sleep(0.3)
        async with client("127.0.0.1") as again:
            again_status = (await again.get(f"{url}/healthz")).status_code
    figure("9th connection from one address (cap 8)", ninth.strip().decode())
    assert ninth.startswith(b"HTTP/1.1 429"), ninth
    assert (other_status, proxy_status, again_status) == (200, 200, 200)


async def test_a_request_without_a_token_is_refused_before_its_body_is_read(api: Api) -> None:
    """A POST /v1/jobs announcing 60,000 bytes of body (under the cap) and sending 10, with no
    token or a forged one, is answered 401 (problem+json, `WWW-Authenticate`) at once: the
    server does not wait for a body it has no reason to read."""
    port = int(api.url.rsplit(":", 1)[1])
    answers = []
    for token in (None, "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJ4In0.c2ln"):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post_head(port, 60_000, token) + b'{"host": "')
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(5):
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(headers_of(head)["content-length"])
                body = json.loads(await reader.readexactly(length))
        finally:
            writer.close()
        answers.append((head, body, time.perf_counter() - t0))
    figure("401 before the body, after (ms)", [round(ms * 1000, 1) for *_, ms in answers])
    (missing, missing_body, _), (forged, forged_body, _) = answers
    assert missing.startswith(b"HTTP/1.1 401"), missing
    assert headers_of(missing)["www-authenticate"] == 'Bearer realm="sshapi"'
    assert headers_of(missing)["content-type"] == "application/problem+json"
    assert missing_body["type"] == "urn:sshapi:problem:unauthorized"
    assert missing_body["instance"] == "/v1/jobs"
    assert forged.startswith(b"HTTP/1.1 401"), forged
    assert 'error="invalid_token"' in headers_of(forged)["www-authenticate"]
    assert forged_body["type"] == "urn:sshapi:problem:unauthorized"


def headers_of(head: bytes) -> dict[str, str]:
    lines = head.decode("latin-1").split("\r\n")[1:]
    return {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines if line)}


async def test_a_header_over_the_cap_in_one_read_is_431(config_file: Path, tmp_path: Path) -> None:
    """A 60,000-byte header sent in one piece is refused 431 (the cap is 32 KiB), as one sent
    over several reads is; a 20,000-byte one is served."""
    settings_ = make_settings(tmp_path, config_file, "sqlite", None)
    with server_process(settings_) as (_, url):
        port = int(url.rsplit(":", 1)[1])

        async def send(pad: int, pieces: int) -> bytes:
            request = f"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: {'a' * pad}\r\n\r\n".encode()
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            step = -(-len(request) // pieces)
            for start in range(0, len(request), step):
                writer.write(request[start : start + step])
                await writer.drain()
                if pieces > 1:
                    await asyncio.sleep(0.05)
            answer = await status_of(reader, 5)
            writer.close()
            return answer

        whole = await send(60_000, 1)
        pieces = await send(60_000, 4)
        small = await send(20_000, 1)
    figure("60,000-byte header in one send / in 4 / 20,000 bytes",
           [s.strip().decode() for s in (whole, pieces, small)])  # fmt: skip
    assert whole.startswith(b"HTTP/1.1 431"), whole
    assert pieces.startswith(b"HTTP/1.1 431"), pieces
    assert small.startswith(b"HTTP/1.1 200"), small


def test_addresses_count_by_host_and_ipv6_by_64_and_proxies_by_network() -> None:
    """What a connection counts against: an IPv4 address, an IPv6 /64 (one host commonly holds
    a whole one), an IPv4-mapped IPv6 address as its IPv4; and which peers are trusted proxies."""
    assert address_key("203.0.113.7") == "203.0.113.7"
    assert (
        address_key("2001:db8:1:2::1")
        == address_key("2001:db8:1:2:ffff::9")
        == ("2001:db8:1:2::/64")
    )
    assert address_key("2001:db8:1:3::1") != address_key("2001:db8:1:2::1")
    assert address_key("::ffff:203.0.113.7") == "203.0.113.7"
    limits = EdgeLimits(1024, 10, 30, 65536, 4096, 64, proxy_networks("10.0.0.0/8, ::1"))
    assert limits.trusted("10.1.2.3") and limits.trusted("::1")
    assert not limits.trusted("127.0.0.1") and not limits.trusted("11.0.0.1")
    assert EdgeLimits(1024, 10, 30, 65536, 4096, 64, proxy_networks("*")).trusted("11.0.0.1")
    assert not EdgeLimits(1024, 10, 30, 65536, 4096, 64, proxy_networks("")).trusted("127.0.0.1")
