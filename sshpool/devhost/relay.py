"""A WAN for the rig: a user-space TCP relay on loopback that delays every byte by a fixed time
per direction, with an optional bandwidth cap, between clients (the API, a benchmark's pool)
and one upstream (the local host's sshd). This kernel has no netem (`tc qdisc ... netem` is
refused), so the delay is added in user space.

    python -m sshpool.devhost.relay --upstream 127.0.0.1:2222 --rtt-ms 20 [--mbit 100]

prints `listening on ADDRESS:PORT` once it accepts, and relays until killed.
`LatencyRelay` runs it as a child process (its CPU is its own, apart from sshd's and the
client's); `RelayedHost` is a started LocalHost as seen through one (address, port and a
known_hosts file naming the relay's port), for `sshapi dev --rtt-ms` and `loadtests.bench
--rtt-ms`.

What it models: propagation delay (rtt/2 each way, added to each chunk as it is read) and a
link's serialization time (a chunk leaves after the previous one has, at the capped rate).
What it does not: loss, reordering, jitter, TCP's slow start and window limits over the long
path (the two loopback legs have their own, with near-zero RTT), middleboxes.

Invariants: bytes leave in the order they came, unchanged, each no sooner than its arrival
plus the one-way delay; a connection's queued bytes are bounded (QUEUE_CHUNKS reads of at most
CHUNK bytes), past that the relay stops reading that side; a side that closes (EOF or error)
closes the other once what was queued has left.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

from sshpool.target import Limits, Target

if TYPE_CHECKING:
    from sshpool.devhost.host import LocalHost

CHUNK = 64 << 10
QUEUE_CHUNKS = 256
START_TIMEOUT = 10.0


async def _pump(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    delay: float,
    rate: float | None,
) -> None:
    """Copy reader to writer, each chunk due `delay` s after it was read, at most `rate` B/s."""
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(QUEUE_CHUNKS)

    async def read() -> None:
        try:
            while data := await reader.read(CHUNK):
                await queue.put((time.monotonic() + delay, data))
        except OSError:
            pass
        await queue.put((0.0, b""))

    async def write() -> None:
        free_at = 0.0  # when the capped link has sent what it was given
        while True:
            due, data = await queue.get()
            if not data:
                break
            if rate is not None:
                # Delivered once the link has serialized it, after what it carried before.
                due = free_at = max(due, free_at) + len(data) / rate
            pause = due - time.monotonic()
            if pause > 0:
                await asyncio.sleep(pause)
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()

    reading = asyncio.create_task(read())
    try:
        await write()
    except OSError:
        pass
    finally:
        reading.cancel()
        await asyncio.gather(reading, return_exceptions=True)


async def _serve(
    listen: tuple[str, int], upstream: tuple[str, int], delay: float, rate: float | None
) -> None:
    async def relay(c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        try:
            u_reader, u_writer = await asyncio.open_connection(*upstream)
        except OSError:
            c_writer.close()
            return
        try:
            await asyncio.gather(
                _pump(c_reader, u_writer, delay, rate), _pump(u_reader, c_writer, delay, rate)
            )
        finally:
            for w in (c_writer, u_writer):
                w.close()

    server = await asyncio.start_server(relay, *listen)
    address, port = server.sockets[0].getsockname()[:2]
    print(f"listening on {address}:{port}", flush=True)
    async with server:
        await server.serve_forever()


class LatencyRelay:
    """`python -m sshpool.devhost.relay` as a child process, to `upstream`, delaying each
    direction by rtt_ms / 2 (module docstring)."""

    def __init__(
        self,
        upstream: tuple[str, int],
        rtt_ms: float,
        *,
        mbit: float | None = None,
        address: str = "127.0.0.1",
    ) -> None:
        self.upstream = upstream
        self.rtt_ms = rtt_ms
        self.mbit = mbit
        self.address = address
        self.port = 0
        self._proc: subprocess.Popen[str] | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> Self:
        argv = [
            sys.executable,
            "-m",
            "sshpool.devhost.relay",
            "--listen",
            f"{self.address}:0",
            "--upstream",
            f"{self.upstream[0]}:{self.upstream[1]}",
            "--rtt-ms",
            str(self.rtt_ms),
        ]
        if self.mbit is not None:
            argv += ["--mbit", str(self.mbit)]
        self._proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()  # its first line, once it listens
        if not line.startswith("listening on "):
            self.stop()
            raise RuntimeError(f"the relay did not start: {line!r}")
        self.port = int(line.rsplit(":", 1)[1])
        return self

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class RelayedHost:
    """A started LocalHost reached through `relay`: what a pool or the API's configuration
    needs (address, port, account, keys, a known_hosts naming the relay's port), and the
    host's sshd pid for CPU accounting."""

    def __init__(self, host: LocalHost, relay: LatencyRelay) -> None:
        self.host = host
        self.relay = relay
        self.address = relay.address
        self.port = relay.port
        self.username = host.username
        self.client_key = host.client_key
        path = Path(host.known_hosts).with_name(f"known_hosts.relay-{relay.port}")
        path.write_text(f"[{relay.address}]:{relay.port} {host.host_public_key()}\n")
        os.chmod(path, 0o600)
        self.known_hosts = str(path)

    @property
    def pid(self) -> int | None:
        return self.host.pid

    @property
    def profile(self) -> str:
        return self.host.profile

    @property
    def account(self) -> Any:
        return self.host.account

    def run_local(self, argv: list[str]) -> Any:
        return self.host.run_local(argv)

    def ssh_argv(self, *remote: str) -> list[str]:
        """The host's OpenSSH client argv, through the relay (its port, its known_hosts)."""
        argv = self.host.ssh_argv(*remote)
        at = argv.index("-p")
        argv[at + 1] = str(self.port)
        argv = [
            f"UserKnownHostsFile={self.known_hosts}" if a.startswith("UserKnownHostsFile=") else a
            for a in argv
        ]
        where = f"{self.username}@{self.host.address}"
        argv[argv.index(where)] = f"{self.username}@{self.address}"
        return argv

    def target(self, **limits: object) -> Target:
        return Target(
            host=self.address,
            username=self.username,
            client_keys=(self.client_key,),
            known_hosts=self.known_hosts,
            port=self.port,
            limits=Limits(**limits),  # type: ignore[arg-type]
        )


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--listen", type=_address, default=("127.0.0.1", 0))
    p.add_argument("--upstream", type=_address, required=True)
    p.add_argument("--rtt-ms", type=float, required=True, help="Round trip added (half each way).")
    p.add_argument("--mbit", type=float, help="Bandwidth cap per direction and connection.")
    args = p.parse_args(argv)
    rate = None if args.mbit is None else args.mbit * 1e6 / 8
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(args.listen, args.upstream, args.rtt_ms / 2000.0, rate))


if __name__ == "__main__":
    main()
