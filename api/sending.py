"""A streamed answer whose client must keep taking it: the send deadline of downloads.

uvicorn writes a response body into the connection's buffer and, once the buffer is above its
high-water mark, waits (flow control) until the client has read it down. A client that stops
reading therefore parks the sender forever, and with it what the sender holds: a download's
SFTP channel and transfer slot. `DeadlineResponse` sends the body in SLICE-sized pieces, each
within `send_timeout` seconds, as nginx's `send_timeout` bounds the time between two successive
writes, not the whole answer: a client that has taken less than one slice in that time is
stalled and its answer ends there (the connection is closed, short of its Content-Length, so
the client knows it is incomplete); a slow client that keeps taking is never cut off, however
large the file.

Why slices: a send returns once the buffer is below the low-water mark again, so its duration
is the time the client takes to read what was sent before it. One 4 MiB piece would make a
client moving at a few KiB/s look stalled; a 128 KiB slice asks for about 2 KiB a second at
the default deadline, at one more ASGI message per 128 KiB sent (what that costs in CPU:
docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

log = logging.getLogger("sshapi.sending")

SLICE = 128 << 10  # bytes per send: the most a client must take within the deadline


class ClientStalled(Exception):
    """The client took nothing for `send_timeout` seconds."""


class Stopped(Exception):
    """`stop()` said so (the client's identity was revoked)."""


class DeadlineResponse(StreamingResponse):
    """A streaming response whose client must take each SLICE within `send_timeout` seconds,
    else it ends there (see the module docstring); the body iterator is closed whatever way
    the answer ends, and `release` awaited, so what the answer holds is let go of at once (also
    when its body never started: a generator closed before its first step runs no `finally`).
    `stop()`, asked before each SLICE, ends it there too (a revocation:
    api/admin/revocations.py)."""

    def __init__(
        self,
        body: AsyncGenerator[bytes, None],
        *,
        release: Callable[[], Awaitable[Any]],
        send_timeout: float,
        what: str,
        stop: Callable[[], bool] = lambda: False,
        **kw: Any,
    ) -> None:
        super().__init__(body, **kw)
        self._body = body
        self._release = release
        self.send_timeout = send_timeout
        self.what = what
        self._stop = stop

    async def _send(self, send: Send, message: dict[str, Any]) -> None:
        if self._stop():
            raise Stopped
        try:
            async with asyncio.timeout(self.send_timeout):
                await send(message)
        except TimeoutError:
            raise ClientStalled from None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # Here, out of starlette's task group (whose cancellation, when the client
            # disconnects, would cut the body's own clean-up short).
            try:
                await self._body.aclose()
            finally:
                await self._release()

    async def stream_response(self, send: Send) -> None:
        start = {"type": "http.response.start", "status": self.status_code}
        try:
            await self._send(send, {**start, "headers": self.raw_headers})
            async for chunk in self._body:
                view = memoryview(chunk)
                for at in range(0, len(view), SLICE):
                    piece = view[at : at + SLICE]
                    await self._send(
                        send, {"type": "http.response.body", "body": piece, "more_body": True}
                    )
            await self._send(send, {"type": "http.response.body", "body": b"", "more_body": False})
        except ClientStalled:
            # Ended short of its length: the server closes the connection (uvicorn logs that
            # the answer was incomplete), and the client sees a truncated body.
            log.warning(
                "%s: the client took nothing for %g s; answer ended", self.what, self.send_timeout
            )
        except Stopped:
            # Ended short of its length the same way: the identity was revoked meanwhile.
            log.info("%s: revoked; answer ended", self.what)
