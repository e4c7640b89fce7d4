"""The HTTP side of one request: tokens, the session, POST /v1/jobs timed from before the
connection is made until the last byte of the answer is read."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

import requests
from requests.adapters import HTTPAdapter

from loadtests.records import Connection, error_kind, parse_server_timing

SUBJECT_PREFIX = "loadtest-"


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
    open at once); `new` sends `Connection: close` so every request makes its own connection."""

    def __init__(
        self,
        base_url: str,
        host: str,
        argv: list[str],
        connection: Connection,
        timeout: float,
        pool_size: int,
    ) -> None:
        self.url = base_url.rstrip("/") + "/v1/jobs"
        self.body = json.dumps({"host": host, "argv": argv})
        self.connection = connection
        self.timeout = timeout
        self.session = requests.Session()
        adapter = HTTPAdapter(pool_connections=1, pool_maxsize=pool_size, max_retries=0)
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
