"""The rig's WAN (sshpool/devhost/relay.py): the relay adds its round trip, caps bandwidth,
carries bytes intact, and an SSH pool works through it."""

from __future__ import annotations

import asyncio
import os
import socket
import statistics
import time
from collections.abc import AsyncIterator

import psutil
import pytest

from sshpool import Pool
from sshpool.devhost import LatencyRelay, LocalHost, RelayedHost


@pytest.fixture
async def echo() -> AsyncIterator[tuple[str, int]]:
    """A TCP echo server on loopback."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    async with server:
        yield server.sockets[0].getsockname()[:2]


async def round_trips(port: int, n: int) -> list[float]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    times = []
    for _ in range(n):
        start = time.perf_counter()
        writer.write(b"x")
        await reader.readexactly(1)
        times.append((time.perf_counter() - start) * 1000)
    writer.close()
    return times


async def test_relay_adds_its_round_trip_and_carries_bytes_intact(echo: tuple[str, int]) -> None:
    """40 ms of RTT: a one-byte round trip takes 40 ms and then some (loopback alone: well
    under 1 ms); 4 MiB of random bytes come back through it unchanged."""
    with LatencyRelay(echo, 40) as relay:
        p50 = statistics.median(await round_trips(relay.port, 5))
        assert 40 <= p50 < 80, p50
        data = os.urandom(4 << 20)
        reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
        writer.write(data)
        writer.write_eof()
        back = await asyncio.wait_for(reader.read(-1), 30)
        writer.close()
    assert back == data
    direct = statistics.median(await round_trips(echo[1], 5))
    assert direct < 5, direct


async def test_relay_caps_bandwidth(echo: tuple[str, int]) -> None:
    """At 8 Mbit/s (1 MB/s) each way, 300 kB take 0.3 s to come back, not milliseconds."""
    with LatencyRelay(echo, 0, mbit=8) as relay:
        reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
        start = time.perf_counter()
        writer.write(b"y" * 300_000)
        writer.write_eof()
        back = await asyncio.wait_for(reader.read(-1), 30)
        elapsed = time.perf_counter() - start
        writer.close()
    assert len(back) == 300_000 and elapsed >= 0.3, elapsed


async def test_a_pool_runs_commands_through_the_relay(stock_host: LocalHost) -> None:
    """SSH through 20 ms of RTT: the host key is known under the relay's port, the command's
    output is intact, and a command on an open connection costs at least one RTT."""
    with LatencyRelay((stock_host.address, stock_host.port), 20) as relay:
        target = RelayedHost(stock_host, relay).target()
        async with Pool() as pool:
            await pool.run(target, ["true"])
            start = time.perf_counter()
            result = await pool.run(target, ["echo", "through the WAN"])
            elapsed = time.perf_counter() - start
    assert result.stdout == b"through the WAN\n"
    assert elapsed >= 0.020, elapsed


async def test_relay_survives_an_upstream_that_is_down() -> None:
    """Nothing listens upstream: the client's connection is closed at once (EOF), and the
    relay goes on serving."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    with LatencyRelay(("127.0.0.1", closed_port), 10) as relay:
        for _ in range(3):
            reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
            assert await asyncio.wait_for(reader.read(), 5) == b""
            writer.close()
        assert relay.pid is not None and psutil.pid_exists(relay.pid)
