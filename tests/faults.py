"""What the fault and hostile-input tests share: a TCP proxy that can fail on command, and the
`FIGURE name: value` lines RELIABILITY.md quotes (`pytest -s ... | grep FIGURE`)."""

from __future__ import annotations

import asyncio
import contextlib
from types import TracebackType
from typing import Self


def figure(name: str, value: object) -> None:
    print(f"FIGURE {name}: {value}")


class Proxy:
    """A TCP proxy on 127.0.0.1: forwards to a real server until told to black-hole (keep every
    socket open, forward nothing: a cut network path) or to cut (reset every connection and
    refuse new ones: the server is gone).

    Each accepted connection is one task that owns both of its sockets and aborts them when it
    ends; `cut` cancels them all and waits for them. A connection accepted just before a cut,
    its upstream connect still in flight, is cut too, and none outlives the test's event loop
    (an unclosed socket there is a ResourceWarning in a later test)."""

    def __init__(self, host: str, port: int) -> None:
        self.upstream = (host, port)
        self.port = 0
        self.connections = 0
        self.holed = False
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> Self:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType
    ) -> None:
        await self.cut()

    def blackhole(self) -> None:
        """From now on, bytes in either direction are read and dropped; nothing is closed."""
        self.holed = True

    async def cut(self) -> None:
        """Reset every connection and stop listening (connects are refused)."""
        if self._server is not None:
            self._server.close()
            self._server = None
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def restore(self) -> None:
        """Listen again on the same port, forwarding."""
        self.holed = False
        if self._server is None:
            self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        if self._server is None:  # accepted as the listener closed: refused
            writer.transport.abort()
            return
        self._tasks.add(task)
        up_writer: asyncio.StreamWriter | None = None
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        except OSError:
            pass
        finally:
            writer.transport.abort()
            if up_writer is not None:
                up_writer.transport.abort()
            self._tasks.discard(task)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One direction, until its reader ends; then its writer is reset, which ends the
        other direction too."""
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                if not self.holed:
                    writer.write(data)
                    await writer.drain()
        writer.transport.abort()
