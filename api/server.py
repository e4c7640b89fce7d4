"""The HTTP server's edge: what uvicorn does not bound by itself.

uvicorn (with httptools, its fast parser) reads a request's header for as long as the client
takes and as large as the client sends (llhttp has no size limit; the 16 KiB bound of h11 does
not apply to httptools), never times out a client that sends nothing or half a request (its
only timer is the keep-alive one, armed after a response), and accepts connections until the
process runs out of file descriptors, after which it answers nobody. `GuardedHttp` is its
httptools protocol with these bounds added:

- header size: more than `max_header_bytes` -> 431 and close, counted twice: the bytes received
  before the header is complete (a header sent slowly over many reads; memory bounded by that
  plus one socket read), and the request line and header fields as the parser hands them over
  (a header that arrives whole in one read, which the first count never sees unfinished);
- header deadline: the header complete within `header_timeout` seconds of the connection (or
  of the request's first byte on a kept-alive connection), else 408 and close;
- body deadline: the body complete within `body_timeout` seconds of the header plus one second
  per `body_min_rate` bytes received (Apache mod_reqtimeout's `body=...,MinRate=...`), else 408
  and close: a client sending at least `body_min_rate` bytes a second is never cut off, however
  large its upload, while one that stalls or trickles is closed after `body_timeout` plus what its
  few bytes bought. The time the server itself stops reading (its buffer full while the app
  waits on the host) is not held against the client;
- connections: at most `max_connections` open. A new one beyond it closes, first, connections
  whose request was answered (idle between requests, or answered early while its body is still
  arriving), oldest first; then connections whose request is still arriving behind what is
  due: a header at once (any wait counts), a body at `body_min_rate` (more than `KEEPING_UP`
  seconds behind it), the one most behind first (the oldest of those sending nothing, or
  trickling a byte). A body keeping up (an upload at `body_min_rate` or faster) is never closed
  for a newcomer, nor a connection whose request is complete (the app is on it, or its
  response has started): if only such remain, the newcomer is closed itself. While
  full, `max_connections // 64` go at once, so that the scan over all connections runs once per
  that many newcomers, not for each;
- connections per client address: at most `max_per_address` from one address (an IPv6 client:
  its /64), beyond which a new one is answered 429 and closed, except from the trusted proxies,
  whose connections carry many clients (the shipped nginx caps those per address itself). The
  address is the TCP peer's: X-Forwarded-For is a header, read later, and only believed from the
  trusted proxies (uvicorn's proxy headers, `forwarded_allow_ips`).

The app's own limits (body size, token size) come after these, in api/middleware.py and
api/auth.py.
"""

from __future__ import annotations

import asyncio
import heapq
import ipaddress
import logging
import resource
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, ClassVar

from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from api.settings import IPNetwork

log = logging.getLogger("sshapi.server")

# Descriptors `connection_limit` keeps free for everything but client connections: the
# listening socket, the event loop, the store (SQLite: 3 per connection), Redis, log files.
FD_RESERVE = 64
# Seconds a body may fall behind `body_min_rate` and still count as keeping up: never closed to
# make room. An honest client sends its body at least at the minimum rate, so it is behind by
# no more than the pause between two of its writes. The smaller this is, the more connections a
# second it takes a flood of half-sent bodies to keep every one counted as keeping up:
# `max_connections / KEEPING_UP` (16,384 a second by default). A header has no such allowance:
# it is due at once, so any connection still waiting for one can make room, the oldest first.
KEEPING_UP = 0.25
# Seconds between two log lines about closed or refused connections (with the count between).
LOG_EVERY = 10.0


@dataclass(frozen=True, slots=True)
class EdgeLimits:
    max_header_bytes: int
    header_timeout: float
    body_timeout: float
    body_min_rate: int
    max_connections: int
    max_per_address: int = 1 << 30
    # None: every address is a trusted proxy ("*").
    trusted_proxies: tuple[IPNetwork, ...] | None = ()

    def trusted(self, host: str) -> bool:
        if self.trusted_proxies is None:
            return True
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return False
        return any(address in network for network in self.trusted_proxies)


def address_key(host: str) -> str:
    """The address a connection counts against: an IPv6 client's /64 (one host commonly has a
    whole /64, so its single addresses say nothing), an IPv4 one's own address."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return host


@dataclass(slots=True)
class EdgeState:
    """What the connections of one server share besides uvicorn's connection set."""

    per_address: Counter[str] = field(default_factory=Counter)
    # Connections closed here (evicted or refused) whose connection_lost has not come yet: no
    # longer counted as open, so that newcomers arriving in the same loop turn do not evict more.
    closing: int = 0
    # Closed or refused since the last log line, and when that was.
    evicted: int = 0
    refused: int = 0
    logged: float = -LOG_EVERY

    def log(self, limits: EdgeLimits) -> None:
        now = time.monotonic()
        if now - self.logged < LOG_EVERY:
            return
        if self.evicted:
            log.warning(
                "more than %d connections: closed %d to make room",
                limits.max_connections,
                self.evicted,
            )
        if self.refused:
            log.warning(
                "more than %d connections from one address: refused %d",
                limits.max_per_address,
                self.refused,
            )
        self.logged, self.evicted, self.refused = now, 0, 0


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


class TimedFlow(FlowControl):
    """uvicorn's flow control, adding up the seconds reading was paused: the server stops reading
    while the app has not taken what it was sent (an upload waiting on the host), and that time
    is not the client's to make up when it is compared with `body_min_rate`."""

    def __init__(self, transport: asyncio.Transport) -> None:
        super().__init__(transport)
        self._paused_at = 0.0
        self._paused_before = 0.0

    def paused_seconds(self, now: float) -> float:
        """Seconds reading has been paused on this connection so far."""
        return self._paused_before + (now - self._paused_at if self.read_paused else 0.0)

    def pause_reading(self) -> None:
        if not self.read_paused:
            self._paused_at = time.monotonic()
        super().pause_reading()

    def resume_reading(self) -> None:
        if self.read_paused:
            self._paused_before += time.monotonic() - self._paused_at
        super().resume_reading()


class GuardedHttp(HttpToolsProtocol):
    """uvicorn's httptools protocol with a header size bound, header and body deadlines and
    connection limits (see the module docstring). `limits` and `edge` are set by
    `guarded_protocol`, one pair per server."""

    limits: ClassVar[EdgeLimits]
    edge: ClassVar[EdgeState]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._opened = time.monotonic()
        self._reading_header = False
        self._header_since = self._opened
        self._header_bytes = 0
        # The request line and header fields as parsed, and whether they ran over the cap.
        self._header_parsed = 0
        self._header_too_large = False
        self._deadline: asyncio.TimerHandle | None = None
        # The body being read: when its header was complete, and its bytes counted so far.
        self._body_since: float | None = None
        self._body_bytes = 0
        # The connection's paused seconds (TimedFlow) when `_body_since` was set.
        self._body_paused = 0.0
        self._address: str | None = None
        self._closed_here = False

    # ---- connection limits

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.flow = TimedFlow(transport)  # before any request: each takes it from here
        self._start_header()
        if self.client is not None and not self.limits.trusted(self.client[0]):
            self._address = address_key(self.client[0])
            self.edge.per_address[self._address] += 1
            if self.edge.per_address[self._address] > self.limits.max_per_address:
                self.edge.refused += 1
                self.edge.log(self.limits)
                self._close_here()
                self._refuse(429, "Too many connections from your address.")
                return
        if len(self.connections) - self.edge.closing > self.limits.max_connections:
            self._evict()

    def _close_here(self) -> None:
        if not self._closed_here:
            self._closed_here = True
            self.edge.closing += 1

    def _behind(self, now: float) -> tuple[int, float] | None:
        """How much this connection deserves to be closed to make room, compared as tuples
        (larger first); None if it must not be. (2, age): its request was answered; (1, seconds
        behind): its request is still arriving that far behind what is due (a header at once;
        a body at `body_min_rate`, less the KEEPING_UP allowance and the time the server itself
        stopped reading); (0, 0): keeping up, as a newcomer is."""
        cycle = self.cycle
        if self.pipeline:
            return None  # a request waits behind one the app is on
        if cycle is not None and not cycle.response_complete:
            if cycle.response_started or self._body_since is None:
                return None  # its request is complete and the app is on it, or answering
            if self.flow.read_paused:
                behind = 0.0
            else:
                paused = self._paused_seconds(now) - self._body_paused
                due = self._body_since + paused + self._body_bytes / self.limits.body_min_rate
                behind = now - due - KEEPING_UP
        elif self._reading_header:
            behind = now - self._header_since
        else:
            return 2, now - self._opened
        return (1, behind) if behind > 0 else (0, 0.0)

    def _evict(self) -> None:
        now = time.monotonic()
        scored = []
        for c in self.connections:
            if isinstance(c, GuardedHttp) and c is not self and not c.transport.is_closing():
                score = c._behind(now)
                if score is not None and score[0] > 0:
                    scored.append((score, c))
        batch = max(1, self.limits.max_connections // 64)
        victims = [c for _, c in heapq.nlargest(batch, scored, key=lambda sc: sc[0])] or [self]
        self.edge.evicted += len(victims)
        self.edge.log(self.limits)
        for victim in victims:
            victim._close_here()
            victim.transport.close()

    # ---- header size and deadline

    def _start_header(self) -> None:
        if not self._reading_header:
            self._reading_header = True
            self._header_since = time.monotonic()
            self._body_since = None
            self._header_bytes = 0
            self._header_parsed = 0
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

    def _count_header(self, size: int) -> None:
        """Adds parsed header bytes; past the cap, stops the parser (uvicorn answers a parser
        error with `send_400_response`, which answers 431 instead)."""
        self._header_parsed += size
        if self._header_parsed > self.limits.max_header_bytes:
            self._header_too_large = True
            raise HeaderTooLarge

    def on_url(self, url: bytes) -> None:
        self._count_header(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_header(len(name) + len(value) + 4)  # ": " and CRLF
        super().on_header(name, value)

    def send_400_response(self, msg: str) -> None:
        if self._header_too_large:
            self._disarm()
            self._refuse(431, "Request header too large.")
        else:
            super().send_400_response(msg)

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
            self._body_paused = self._paused_seconds(now)
        allowed = self.limits.body_timeout + self._body_bytes / self.limits.body_min_rate
        left = self._body_since + allowed - now
        if left > 0:
            self._arm(left)
        return max(left, 0.0)

    def _paused_seconds(self, now: float) -> float:
        return self.flow.paused_seconds(now) if isinstance(self.flow, TimedFlow) else 0.0

    def on_headers_complete(self) -> None:
        self._reading_header = False
        self._body_since, self._body_bytes = time.monotonic(), 0
        self._body_paused = self._paused_seconds(self._body_since)
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
        if self._address is not None:
            self.edge.per_address[self._address] -= 1
            if not self.edge.per_address[self._address]:
                del self.edge.per_address[self._address]
            self._address = None
        if self._closed_here:
            self.edge.closing -= 1
        super().connection_lost(exc)


class HeaderTooLarge(Exception):
    """Raised from a parser callback to stop parsing a header over the cap."""


def guarded_protocol(limits: EdgeLimits) -> type[GuardedHttp]:
    """The protocol class to pass to uvicorn as `http=` (one per server: its connections share
    the per-address counts)."""
    return type("GuardedHttp", (GuardedHttp,), {"limits": limits, "edge": EdgeState()})
