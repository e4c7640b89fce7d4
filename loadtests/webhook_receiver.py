"""A webhook receiver on 127.0.0.1 for the webhook tests and benchmark: a real HTTP/1.1 server
(asyncio streams) that verifies each delivery's signature with the `standardwebhooks` package
and records it with its arrival time. It can be stopped and started again on the same port
(the receiver that is down), answer slowly, with a status of choice, a redirect or a huge
body (the hostile receivers of RELIABILITY.md)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

from standardwebhooks.webhooks import Webhook, WebhookVerificationError


@dataclass
class Received:
    id: str
    headers: dict[str, str]
    body: bytes
    at: float  # time.time() on arrival
    valid: bool  # the signature checked against the receiver's secret

    @property
    def message(self) -> Any:
        return json.loads(self.body)


@dataclass
class Receiver:
    secret: str | None = None
    status: int = 204
    delay: float = 0.0
    location: str | None = None  # answered with a redirect to this
    body_bytes: int = 0  # answered with this many bytes
    port: int = 0
    received: list[Received] = field(default_factory=list)
    sent: int = 0  # body bytes written (a huge body: until the client hangs up)
    _server: asyncio.Server | None = None
    _writers: set[asyncio.StreamWriter] = field(default_factory=set)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        """Down: the port refuses connections (and the open ones are cut)."""
        if self._server is not None:
            self._server.close()
            for writer in list(self._writers):
                writer.close()
            await self._server.wait_closed()
            self._server = None

    async def __aenter__(self) -> Receiver:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def ids(self, kind: str | None = None) -> list[str]:
        return [r.id for r in self.received if kind is None or r.message["type"] == kind]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                headers = {}
                for line in lines[1:]:
                    if ":" in line:
                        name, value = line.split(":", 1)
                        headers[name.strip().lower()] = value.strip()
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                self._record(headers, body)
                if self.delay:
                    await asyncio.sleep(self.delay)
                await self._answer(writer)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    def _record(self, headers: dict[str, str], body: bytes) -> None:
        valid = False
        if self.secret is not None:
            with contextlib.suppress(WebhookVerificationError, ValueError):
                Webhook(self.secret).verify(body, headers)
                valid = True
        self.received.append(
            Received(headers.get("webhook-id", ""), headers, body, time.time(), valid)
        )

    async def _answer(self, writer: asyncio.StreamWriter) -> None:
        extra = f"Location: {self.location}\r\n" if self.location else ""
        if self.body_bytes:
            extra += f"Content-Length: {self.body_bytes}\r\n"
            writer.write(f"HTTP/1.1 {self.status} X\r\n{extra}\r\n".encode())
            chunk = b"x" * 65536
            left = self.body_bytes
            while left > 0:  # until the client stops reading (it closes: ConnectionError)
                writer.write(chunk[: min(left, len(chunk))])
                left -= len(chunk)
                await writer.drain()
                self.sent += min(left + len(chunk), len(chunk))
            return
        writer.write(f"HTTP/1.1 {self.status} X\r\n{extra}Content-Length: 0\r\n\r\n".encode())
        await writer.drain()
