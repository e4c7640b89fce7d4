"""The HTTP side of one request: tokens, the connection pool, POST /v1/jobs timed from before the
connection is made until the last byte of the answer is read. Imported by locustfiles (gevent)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from geventhttpclient import URL, HTTPClient
from geventhttpclient.connectionpool import ConnectionPool
from geventhttpclient.response import HTTPParseError

from loadtests.records import Connection, error_kind, parse_server_timing

SUBJECT_PREFIX = "loadtest-"
# Seconds a pooled connection may sit idle and still be reused: below uvicorn's default keep-alive
# timeout (5 s), the shortest this suite is likely to meet, with room for a server whose timer
# fires late under load (see _IdleBoundedPool). The same rule and value as issue 14's.
MAX_IDLE = 2.0


def tokens(subjects: int, ttl: float = 24 * 3600.0) -> list[str]:
    """`subjects` tokens minted from the local secret and configuration with the API's own
    minting, one per subject: the default policy limits each identity's rate and concurrency,
    and a portal's load comes from many users. SSHAPI_TOKEN (which docs/client.md has
    researchers export) is not used: it would silently make the run one identity."""
    # The light seam: neither FastAPI nor SQLAlchemy in a Locust worker.
    from api.local import local_token, resolve_config
    from api.settings import Settings

    settings = Settings()
    config = resolve_config(settings)
    scopes = ["jobs:read", "jobs:write"]
    return [
        local_token(settings, config, f"{SUBJECT_PREFIX}{n}", scopes, ttl) for n in range(subjects)
    ]


@dataclass(frozen=True, slots=True)
class Outcome:
    ok: bool
    status: int
    error: str
    service_ms: float
    length: int
    # time.perf_counter() when the last byte was read (or the request failed): the end of the
    # request's latency, taken before the answer is parsed.
    end: float
    server: dict[str, float]
    exception: BaseException | None


class _IdleBoundedPool(ConnectionPool):
    """geventhttpclient's pool, plus one rule: a connection idle for longer than `max_idle` is
    closed instead of reused. The server closes idle keep-alive connections after its timeout;
    a request sent on one at that moment is lost (reset, or no answer) and would be counted as
    the server's failure. Reusing only connections idle for less than a fraction of that
    timeout leaves the race no room."""

    def __init__(self, *args: Any, max_idle: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.max_idle = max_idle
        self._idle_since: dict[Any, float] = {}

    def get_socket(self) -> Any:
        while True:
            sock = super().get_socket()
            since = self._idle_since.pop(sock, None)  # None: a new connection
            if since is None or time.monotonic() - since <= self.max_idle:
                return sock
            self.release_socket(sock)  # closes it and frees its place in the pool

    def return_socket(self, sock: Any) -> None:
        self._idle_since[sock] = time.monotonic()
        super().return_socket(sock)

    def release_socket(self, sock: Any) -> None:
        self._idle_since.pop(sock, None)
        super().release_socket(sock)


class JobClient:
    """POST /v1/jobs with a fixed body over geventhttpclient (Locust's FastHttpUser client: a C
    HTTP parser and plain gevent sockets, about a tenth of the CPU of requests + urllib3 per
    request). keep-alive reuses pooled connections (up to `pool_size` open at once, none idle
    for longer than `max_idle`); `new` sends `Connection: close`, so every request makes its
    own connection."""

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
        url = URL(base_url.rstrip("/") + "/v1/jobs")
        self.path = url.request_uri
        self.body = json.dumps({"host": host, "argv": argv}).encode()
        self.connection = connection
        self.timeout = timeout
        self.http = HTTPClient(
            url.host,
            url.port,
            ssl=url.scheme == "https",
            connection_timeout=timeout,
            network_timeout=timeout,
            concurrency=pool_size,
        )
        if not self.http.ssl:
            # The same pool with the idle rule (geventhttpclient has no hook for it; its own
            # pool is replaced before any connection exists).
            self.http._connection_pool = _IdleBoundedPool(
                url.host, url.port, url.host, url.port, size=pool_size,
                connection_timeout=timeout, network_timeout=timeout, max_idle=max_idle,
            )  # fmt: skip

    def close(self) -> None:
        """Close the pooled connections."""
        self.http.close()

    def post(self, token: str) -> Outcome:
        """Success is 201 with the job `succeeded`: 202 (not finished within the wait) and any
        other job state are failures of the run, each with its own error kind. Timed from
        before the connection is taken (or made) until the last byte of the body is read."""
        headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        if self.connection == "new":
            headers["Connection"] = "close"
        start = time.perf_counter()
        try:
            # network_timeout bounds each socket operation (connect, send, every read), as
            # requests' timeout did; a socket that failed is closed by geventhttpclient.
            resp = self.http.request("POST", self.path, self.body, headers)
            try:
                content = resp.read()
            finally:
                resp.release()
        except (OSError, TimeoutError, HTTPParseError) as exc:
            end = time.perf_counter()
            return Outcome(False, 0, error_kind(exc), (end - start) * 1000.0, 0, end, {}, exc)
        end = time.perf_counter()
        ms = (end - start) * 1000.0
        timing = resp.get("server-timing")
        server = parse_server_timing(timing if isinstance(timing, str) else None)
        status = resp.status_code
        error = ""
        if status != 201:
            error = f"http {status}"
        else:
            try:
                state = json.loads(content).get("state")
            except ValueError:
                state = "unparsable body"
            if state != "succeeded":
                error = f"job {state}"
        failure = RuntimeError(error) if error else None
        return Outcome(not error, status, error, ms, len(content), end, server, failure)
