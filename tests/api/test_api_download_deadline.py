"""A download whose client stops reading ends after SSHAPI_SEND_TIMEOUT, letting go of its SFTP
channel and transfer slot; a slow client that keeps reading is not cut off (F9 of issue 33).
The client is a raw socket with a small receive buffer, against the real server and sshd."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from api_helpers import Api, Keys, config_toml, make_settings, running_api

from sshpool.devhost import LocalHost

POLICY = """
[[policy]]
subject = "dl-*"
issuer = "*"
hosts = ["local"]
file_roots = { "*" = ["~/sshapi-files/{sub}"] }
max_transfers = 1
rate = 1000
burst = 1000

"""
SEND_TIMEOUT = 2.0
SIZE = 64 << 20  # well past what the kernel buffers of a loopback connection hold


@pytest.fixture
async def api(
    tuned_host: LocalHost, secret_file: Path, secret: str, keys: Keys, tmp_path: Path
) -> AsyncIterator[Api]:
    text = config_toml(tuned_host, secret_file, keys).replace(
        "[[policy]]", POLICY + "[[policy]]", 1
    )
    path = tmp_path / "sshapi.toml"
    path.write_text(text)
    settings = make_settings(tmp_path, path, "sqlite", None).model_copy(
        update={"send_timeout": SEND_TIMEOUT}
    )
    async with running_api(settings, keys, secret) as running:
        yield running


@pytest.fixture
def sub(tuned_host: LocalHost) -> Iterator[str]:
    """A subject whose root holds `big` (SIZE bytes, sparse: read at memory speed)."""
    sub = f"dl-{uuid.uuid4().hex[:10]}"
    root = Path(tuned_host.account.home) / "sshapi-files" / sub
    tuned_host.run_local(["mkdir", "-p", str(root)])
    tuned_host.run_local(["truncate", "-s", str(SIZE), str(root / "big")])
    try:
        yield sub
    finally:
        subprocess.run(["rm", "-rf", str(root)], check=False)


def raw_download(api: Api, sub: str) -> socket.socket:
    """A GET of `big` on a socket with a small receive buffer; the answer is left unread."""
    host, port = api.url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    token = api.auth(sub, "files:read")["Authorization"]
    sock.sendall(
        f"GET /v1/hosts/local/files/content?path=sshapi-files/{sub}/big HTTP/1.1\r\n"
        f"Host: {host}\r\nAuthorization: {token}\r\n\r\n".encode()
    )
    return sock


def read_until_closed(sock: socket.socket, timeout: float) -> int:
    """Bytes read until the server closes the connection (raises TimeoutError if it does not)."""
    sock.settimeout(timeout)
    total = 0
    while data := sock.recv(1 << 20):
        total += len(data)
    return total


async def one_byte(api: Api, sub: str) -> int:
    """The status of a one-byte download of `big` (the transfer slot taken and given back)."""
    r = await api.client.get(
        f"{api.url}/v1/hosts/local/files/content",
        params={"path": f"sshapi-files/{sub}/big"},
        headers={**api.auth(sub, "files:read"), "Range": "bytes=0-0"},
    )
    return r.status_code


async def test_a_stalled_download_ends_after_the_send_timeout_and_frees_its_slot(
    api: Api, sub: str
) -> None:
    """max_transfers = 1: while a client that reads nothing holds the one slot, another download
    gets 429; SEND_TIMEOUT later its answer is cut short (the connection closed, far fewer bytes
    than Content-Length) and the next download gets through."""
    sock = raw_download(api, sub)
    try:
        head = await asyncio.to_thread(lambda: sock.recv(4096))
        assert head.startswith(b"HTTP/1.1 200"), head
        assert f"content-length: {SIZE}".encode() in head.lower()
        stalled_at = time.monotonic()  # it reads nothing from here on
        await asyncio.sleep(0.5)
        assert await one_byte(api, sub) == 429  # the slot is held
        while (status := await one_byte(api, sub)) == 429:
            assert time.monotonic() - stalled_at < SEND_TIMEOUT + 5, "the slot was never freed"
            await asyncio.sleep(0.2)
        freed = time.monotonic() - stalled_at
        assert status == 206
        # Not before the deadline: the buffers fill at once, then SEND_TIMEOUT of nothing taken.
        assert freed >= SEND_TIMEOUT - 0.5, freed
        received = await asyncio.to_thread(read_until_closed, sock, 10.0)
        print(f"slot freed {freed:.2f} s after the stall; the stalled client got {received} bytes")
        assert received < SIZE // 2, received  # cut short: the client knows it is incomplete
    finally:
        sock.close()


async def test_a_slow_client_that_keeps_reading_is_not_cut_off(api: Api, sub: str) -> None:
    """A client taking 8 KiB every 50 ms (160 KiB/s, through a 4 KiB receive buffer) for three
    times the send timeout keeps its download: bytes keep arriving, the connection stays open."""
    sock = raw_download(api, sub)

    def trickle() -> tuple[int, float]:
        sock.settimeout(SEND_TIMEOUT)
        total, longest, last = 0, 0.0, time.monotonic()
        until = last + 3 * SEND_TIMEOUT
        while time.monotonic() < until:
            data = sock.recv(8192)
            assert data, f"closed after {total} bytes"
            now = time.monotonic()
            total, longest, last = total + len(data), max(longest, now - last), now
            time.sleep(0.05)
        return total, longest

    try:
        total, longest = await asyncio.to_thread(trickle)
    finally:
        sock.close()
    print(f"slow reader: {total} bytes in {3 * SEND_TIMEOUT:g} s, longest wait {longest:.2f} s")
    assert total > 3 * SEND_TIMEOUT * (64 << 10), total  # it kept moving all along
    assert longest < SEND_TIMEOUT, longest
