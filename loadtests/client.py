"""The HTTP side of one request: tokens, the session, POST /v1/jobs timed from before the
connection is made until the last byte of the answer is read.

Idle keep-alive connections: a server closes a connection that stayed idle for its keep-alive
timeout (uvicorn's default 5 s; `sshapi serve` SSHAPI_KEEPALIVE_TIMEOUT, 75 s). A request sent on
a connection just as the server closes it fails ("Remote end closed connection without
response") although the server never saw it: measured, 270 of 1,230 burst requests with 6 s
between bursts against a 5 s server. So a pooled connection idle longer than `max_idle` (below
any server's timeout) is closed and reconnected instead of reused; the reconnect is part of the
request's time, as a new connection is in any case."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any

import requests
from requests.adapters import HTTPAdapter
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

from loadtests.records import Connection, error_kind, parse_server_timing

SUBJECT_PREFIX = "loadtest-"
# Seconds a pooled connection may sit idle and still be reused: below uvicorn's default keep-alive
# timeout (5 s), the shortest this suite is likely to meet, with room for a server whose timer
# fires late under load.
MAX_IDLE = 2.0


def tokens(subjects: int, ttl: float = 24 * 3600.0) -> list[str]:
    """SSHAPI_TOKEN when set (one identity), else `subjects` tokens minted from the local secret
    and configuration with the API's own minting, one per subject: the default policy limits
    each identity's rate and concurrency, and a portal's load comes from many users."""
    given = os.environ.get("SSHAPI_TOKEN")
    if given:
        return [given]
    # The light seam: neither FastAPI nor SQLAlchemy in a Locust worker.
    from api.local import local_token, resolve_config
    from api.settings import Settings

    settings = Settings()
    config = resolve_config(settings)
    scopes = ["jobs:read", "jobs:write"]
    return [
        local_token(settings, config, f"{SUBJECT_PREFIX}{n}", scopes, ttl) for n in range(subjects)
    ]


class IdleLimitedConnection(HTTPConnection):
    """A connection that reports itself dropped once idle longer than `max_idle`: urllib3's
    pool then closes it and connects afresh instead of reusing it (`is_connected` is what the
    pool asks before reuse). Idle counts from the end of the last answer's headers; the answers
    here are small, read with their headers."""

    max_idle = MAX_IDLE

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.idle_since = time.monotonic()

    def getresponse(self) -> Any:  # urllib3's BaseHTTPResponse
        try:
            return super().getresponse()
        finally:
            self.idle_since = time.monotonic()

    @property
    def is_connected(self) -> bool:
        if time.monotonic() - self.idle_since > self.max_idle:
            return False
        return super().is_connected


def idle_limited_adapter(pool_size: int, max_idle: float) -> HTTPAdapter:
    """An adapter whose pools close connections idle longer than `max_idle` seconds instead of
    reusing them."""
    limit = {"max_idle": max_idle}
    plain = type("Connection", (IdleLimitedConnection,), limit)
    tls = type("TLSConnection", (IdleLimitedConnection, HTTPSConnection), limit)
    adapter = HTTPAdapter(pool_connections=1, pool_maxsize=pool_size, max_retries=0)
    adapter.poolmanager.pool_classes_by_scheme = {
        "http": type("Pool", (HTTPConnectionPool,), {"ConnectionCls": plain}),
        "https": type("TLSPool", (HTTPSConnectionPool,), {"ConnectionCls": tls}),
    }
    return adapter


@dataclass(frozen=True, slots=True)
class Outcome:
    ok: bool
    status: int
    error: str
    service_ms: float
    length: int
    server: dict[str, float]
    exception: BaseException | None


class JobClient:
    """POST /v1/jobs with a fixed body. keep-alive reuses pooled connections (up to `pool_size`
    open at once) idle at most `max_idle` seconds; `new` sends `Connection: close` so every
    request makes its own connection."""

    def __init__(
        self,
        base_url: str,
        host: str,
        argv: list[str],
        connection: Connection,
        timeout: float,
        pool_size: int,
        max_idle: float = MAX_IDLE,
    ) -> None:
        self.url = base_url.rstrip("/") + "/v1/jobs"
        self.body = json.dumps({"host": host, "argv": argv})
        self.connection = connection
        self.timeout = timeout
        self.session = requests.Session()
        adapter = idle_limited_adapter(pool_size, max_idle)
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)

    def post(self, token: str) -> Outcome:
        """Success is 201 with the job `succeeded`: 202 (not finished within the wait) and any
        other job state are failures of the run, each with its own error kind."""
        headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        if self.connection == "new":
            headers["Connection"] = "close"
        start = time.perf_counter()
        try:
            # stream=False (the default): returns once the whole body has been read.
            resp = self.session.post(
                self.url, data=self.body, headers=headers, timeout=self.timeout
            )
        except requests.RequestException as exc:
            ms = (time.perf_counter() - start) * 1000.0
            return Outcome(False, 0, error_kind(exc), ms, 0, {}, exc)
        ms = (time.perf_counter() - start) * 1000.0
        server = parse_server_timing(resp.headers.get("Server-Timing"))
        error = ""
        if resp.status_code != 201:
            error = f"http {resp.status_code}"
        else:
            try:
                state = resp.json().get("state")
            except ValueError:
                state = "unparsable body"
            if state != "succeeded":
                error = f"job {state}"
        failure = RuntimeError(error) if error else None
        return Outcome(not error, resp.status_code, error, ms, len(resp.content), server, failure)
