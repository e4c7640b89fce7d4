"""The HTTP server's edge: what uvicorn does not bound by itself.

uvicorn (with httptools, its fast parser) reads a request's header for as long as the client
takes and as large as the client sends (llhttp has no size limit; the 16 KiB bound of h11 does
not apply to httptools), never times out a client that sends nothing or half a request (its
only timer is the keep-alive one, armed after a response), and accepts connections until the
process runs out of file descriptors, after which it answers nobody. `GuardedHttp` is its
httptools protocol with four bounds added:

- header size: more than `max_header_bytes` received before the header is complete -> 431 and
  close (memory bounded by that plus one socket read);
- header deadline: the header complete within `header_timeout` seconds of the connection (or
  of the request's first byte on a kept-alive connection), else 408 and close;
- body deadline: the body complete within `body_timeout` seconds of the header plus one second
  per `body_min_rate` bytes received (Apache mod_reqtimeout's `body=...,MinRate=...`), else 408
  and close: a client sending at least `body_min_rate` bytes a second is never cut off, however
  large its upload, while one that stalls or trickles is closed after `body_timeout` plus what its
  few bytes bought. The time the server itself stops reading (its buffer full while the app
  waits on the host) is not held against the client;
- connections: at most `max_connections` open; a new one beyond it closes the oldest connection
  with no request in progress (idle, or still sending its header), or itself if there is none,
  so that descriptors never run out and a client that sends its request at once is served.

The app's own limits (body size, token size) come after these, in api/middleware.py and
api/auth.py.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from dataclasses import dataclass
from typing import Any, ClassVar

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

log = logging.getLogger("sshapi.server")

# Descriptors `connection_limit` keeps free for everything but client connections: the
# listening socket, the event loop, the store (SQLite: 3 per connection), Redis, log files.
FD_RESERVE = 64


@dataclass(frozen=True, slots=True)
class EdgeLimits:
    max_header_bytes: int
    header_timeout: float
    body_timeout: float
    body_min_rate: int
    max_connections: int


def connection_limit(wanted: int, ssh_connections: int) -> int:
    """`wanted`, lowered to what the descriptor limit leaves after the reserve and the SSH
    pools' own connections (warned about: raise LimitNOFILE or lower SSHAPI_MAX_CONNECTIONS)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    room = max(16, soft - FD_RESERVE - ssh_connections)
    if room < wanted:
        log.warning(
            "%d client connections allowed, not %d: the descriptor limit is %d (%d reserved, "
            "%d for SSH connections); raise it (LimitNOFILE) to allow more",
            room,
            wanted,
            soft,
            FD_RESERVE,
            ssh_connections,
        )
        return room
    return wanted


class GuardedHttp(HttpToolsProtocol):
    """uvicorn's httptools protocol with a header size bound, header and body deadlines and a
    connection limit (see the module docstring). `limits` is set by `guarded_protocol`."""

    limits: ClassVar[EdgeLimits]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._opened = time.monotonic()
        self._reading_header = False
        self._header_bytes = 0
        self._deadline: asyncio.TimerHandle | None = None
        # The body being read: when its header was complete, and its bytes counted so far.
        self._body_since: float | None = None
        self._body_bytes = 0

    # ---- connection limit

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._start_header()
        if len(self.connections) > self.limits.max_connections:
            self._evict()

    def _idle(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _evict(self) -> None:
        idle = [
            c
            for c in self.connections
            if isinstance(c, GuardedHttp) and c._idle() and not c.transport.is_closing()
        ]
        victim = min(idle, key=lambda c: c._opened, default=self)
        log.warning("more than %d connections: closing one", self.limits.max_connections)
        victim.transport.close()

    # ---- header size and deadline

    def _start_header(self) -> None:
        if not self._reading_header:
            self._reading_header = True
            self._body_since = None
            self._header_bytes = 0
            self._arm(self.limits.header_timeout)

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        started = self.cycle is not None and self.cycle.response_started
        if not started and self._body_since is not None and self._body_time_left() > 0:
            return  # the client's bytes bought it more time: re-armed for it
        if started or (self._reading_header and not self._header_bytes):
            self.transport.close()  # answered already, or sent nothing: nothing to say
        else:
            self._refuse(408, "Request header or body not received in time.")

    def _refuse(self, status: int, message: str) -> None:
        body = message.encode("ascii")
        self.transport.write(
            STATUS_LINE[status]
            + b"content-type: text/plain; charset=utf-8\r\n"
            + b"content-length: "
            + str(len(body)).encode("ascii")
            + b"\r\nconnection: close\r\n\r\n"
            + body
        )
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self._reading_header:
            self._header_bytes += len(data)
        super().data_received(data)
        if (
            self._reading_header
            and self._header_bytes > self.limits.max_header_bytes
            and not self.transport.is_closing()
        ):
            self._disarm()
            self._refuse(431, "Request header too large.")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._start_header()

    # ---- body deadline

    def _body_time_left(self) -> float:
        """Re-arms the body deadline and returns the seconds left if the client has earned more
        time since the timer was armed, else 0. The deadline is extended lazily, here when its
        timer fires, not on every read: a timer per 64 KiB read would cost a hot path. While the
        server has paused reading (the app has not taken what it was sent), the client cannot
        send: its budget starts afresh from here."""
        assert self._body_since is not None
        now = time.monotonic()
        if self.flow.read_paused:
            self._body_since, self._body_bytes = now, 0
        allowed = self.limits.body_timeout + self._body_bytes / self.limits.body_min_rate
        left = self._body_since + allowed - now
        if left > 0:
            self._arm(left)
        return max(left, 0.0)

    def on_headers_complete(self) -> None:
        self._reading_header = False
        self._body_since, self._body_bytes = time.monotonic(), 0
        self._arm(self.limits.body_timeout)
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)  # a count only: the deadline catches up when it fires
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._body_since = None
        self._disarm()
        super().on_message_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


def guarded_protocol(limits: EdgeLimits) -> type[GuardedHttp]:
    """The protocol class to pass to uvicorn as `http=`."""
    return type("GuardedHttp", (GuardedHttp,), {"limits": limits})
