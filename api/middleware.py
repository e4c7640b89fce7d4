"""One pure ASGI middleware for what every response needs: X-Request-ID, Server-Timing, the
request metrics, the body size cap (413 before the body is read, for both a declared
Content-Length and a streamed body that runs over) and, when traces are on, the request's
server span (api/tracing.py: our own, not the FastAPI instrumentation, which cost more CPU per
request: docs/benchmarks.md)."""

from __future__ import annotations

import re
import secrets
import time

from fastapi import HTTPException
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api import tracing
from api.metrics import Metrics
from api.numbers import read_count
from api.problems import Problem
from api.timing import TIMING, Timing

# A client's request id is echoed only when it is short and printable (it ends up in logs).
REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


# Uploads stream their body to the host under the policy's own caps (api/files/), not this one:
# a PUT of a whole file, and a resumable upload's chunk (a PATCH, max_upload_chunk).
STREAMED_BODY = re.compile(r"^/v1/hosts/[^/]+/files/content$")
STREAMED_CHUNK = re.compile(r"^/v1/hosts/[^/]+/files/uploads/[^/]+$")


class RequestContext:
    def __init__(self, app: ASGIApp, metrics: Metrics, max_body: int, traced: bool = False) -> None:
        self.app = app
        self.metrics = metrics
        self.max_body = max_body
        self.traced = traced

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        given = headers.get(b"x-request-id", b"").decode("latin-1")
        # 128 random bits as hex, as uuid4().hex was, without building a UUID object.
        request_id = given if REQUEST_ID.match(given) else secrets.token_hex(16)
        scope.setdefault("state", {})["request_id"] = request_id
        timing = Timing()
        token = TIMING.set(timing)
        status = 500
        start = time.perf_counter()
        span = None
        if self.traced:
            span = tracing.server_span(headers, scope["method"], scope["path"])
            if span is not None and span.is_recording():
                span_token = tracing.attach(span)
            else:
                span = None  # not sampled: nothing below makes a span either

        async def send_with_headers(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                out = MutableHeaders(scope=message)
                out["X-Request-ID"] = request_id
                if timing.ms:
                    out["Server-Timing"] = timing.header()
            await send(message)

        received = 0
        max_body = self.max_body
        if (scope["method"] == "PUT" and STREAMED_BODY.match(scope["path"])) or (
            scope["method"] == "PATCH" and STREAMED_CHUNK.match(scope["path"])
        ):
            max_body = 1 << 62

        async def capped_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > max_body:
                    # FastAPI re-raises HTTPException from body reading (other errors become 400).
                    raise HTTPException(413, f"at most {max_body} bytes")
            return message

        try:
            declared = headers.get(b"content-length")
            size = None if declared is None else read_count(declared, saturate=True)
            if size is not None and size > max_body:
                await _too_large(max_body).response(scope["path"])(
                    scope, receive, send_with_headers
                )
            else:
                await self.app(scope, capped_receive, send_with_headers)
        finally:
            TIMING.reset(token)
            route = scope.get("route")
            # The route template, never the raw path: bounded label values (RELIABILITY.md).
            template = getattr(route, "path_format", None) or getattr(route, "path", None)
            if span is not None:
                tracing.detach(span_token)
                route_name = str(template or "unmatched")
                tracing.end_server_span(span, scope["method"], route_name, status, request_id)
            self.metrics.request(scope["method"], template, status, time.perf_counter() - start)


def _too_large(limit: int) -> Problem:
    return Problem(413, "too-large", "Request body too large", f"at most {limit} bytes")
