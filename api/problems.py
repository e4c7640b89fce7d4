"""Errors as `application/problem+json` (RFC 9457) and the one table from sshpool errors to HTTP.

Every error the API answers is a `Problem`: routes and services raise it, the handlers below
render it. Unexpected exceptions become a bare 500 problem; their text is logged, never sent.
"""

from __future__ import annotations

import logging
import math
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as StorePoolTimeout
from starlette.exceptions import HTTPException as StarletteHTTPException

from sshpool import (
    AuthenticationFailed,
    ConnectError,
    ConnectionLost,
    ConnectTimeout,
    HostKeyMismatch,
    HostUnavailable,
    NodeFailed,
    NotAdmitted,
    PoolFull,
    PoolTimeout,
    RemoteFileFailure,
    RemoteNoSpace,
    RemoteNotFound,
    RemotePermissionDenied,
    RemoteUnsupported,
    SSHPoolError,
)

if TYPE_CHECKING:
    from api.store import JobRow

log = logging.getLogger("sshapi")

MEDIA_TYPE = "application/problem+json"
# A URN rather than a URL: stable identifiers that point at no server we do not run. Listed in
# docs/http-api.md (tests/docs/test_docs.py checks the list against every kind answered here).
TYPE_BASE = "urn:sshapi:problem:"


class Problem(Exception):
    """An error answer: status, a short stable `kind` (the end of the type URI), and details."""

    def __init__(
        self,
        status: int,
        kind: str,
        title: str,
        detail: str | None = None,
        *,
        headers: dict[str, str] | None = None,
        **extensions: Any,
    ) -> None:
        super().__init__(detail or title)
        self.status = status
        self.kind = kind
        self.title = title
        self.detail = detail
        self.headers = headers or {}
        self.extensions = extensions

    def body(self, instance: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "type": TYPE_BASE + self.kind,
            "title": self.title,
            "status": self.status,
        }
        if self.detail:
            body["detail"] = self.detail
        if instance:
            body["instance"] = instance
        body.update(self.extensions)
        return body

    def response(self, instance: str | None = None) -> JSONResponse:
        return JSONResponse(
            self.body(instance),
            status_code=self.status,
            headers=self.headers,
            media_type=MEDIA_TYPE,
        )


# A 422 lists at most this many errors (`errors_total` counts them all), each string clipped:
# a body of many small mistakes (or one huge key name) must not make an answer larger than it.
MAX_ERRORS = 20
MAX_ERROR_TEXT = 200
MAX_LOC_TEXT = 64


def _clip(value: Any, limit: int = MAX_LOC_TEXT) -> Any:
    if isinstance(value, str) and len(value) > limit:
        return value[:limit] + "..."
    return value


def unauthorized(detail: str, *, error: str = "invalid_token") -> Problem:
    # RFC 6750: the error code tells a client whether to refresh its token or fetch one.
    challenge = f'Bearer realm="sshapi", error="{error}"'
    return Problem(
        401, "unauthorized", "Unauthorized", detail, headers={"WWW-Authenticate": challenge}
    )


# Seconds a client is told to wait when the job store cannot be reached.
STORE_RETRY_AFTER = 5


def revoked() -> Problem:
    """403 `identity-revoked`: not 401, the token is valid; its holder has been cut off
    (api/admin/revocations.py)."""
    return Problem(403, "identity-revoked", "Revoked", "an administrator revoked your access")


def store_is_down(exc: Exception) -> bool:
    """The job store cannot take the request: unreachable (refused, reset, gone) or saturated
    (SQLite "database is locked", no free store connection), as opposed to a query bug. The
    store is the only thing a request reaches over the network outside SSH, whose errors the
    backends translate."""
    if isinstance(exc, StorePoolTimeout):
        return True
    if isinstance(exc, DBAPIError):
        return isinstance(exc, (OperationalError, InterfaceError)) or exc.connection_invalidated
    return isinstance(exc, OSError)


def retry_after(seconds: float) -> dict[str, str]:
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


# The one mapping from the sshpool error tree to HTTP: (status, kind, title). Looked up along the
# exception's MRO, so subclasses not listed fall back to their parent's row.
SSH_ERRORS: dict[type[SSHPoolError], tuple[int, str, str]] = {
    PoolFull: (503, "pool-full", "Host saturated: too many requests waiting"),
    PoolTimeout: (503, "pool-timeout", "Host saturated: no SSH channel became free in time"),
    HostUnavailable: (503, "host-unavailable", "Host unavailable: recent connections failed"),
    ConnectTimeout: (504, "connect-timeout", "Connecting to the host timed out"),
    AuthenticationFailed: (502, "ssh-auth-failed", "The host refused the SSH credentials"),
    HostKeyMismatch: (502, "host-key-mismatch", "The host key does not match known_hosts"),
    ConnectError: (502, "connect-failed", "Could not connect to the host"),
    NodeFailed: (502, "node-failed", "The login node failed while the command ran there"),
    ConnectionLost: (502, "connection-lost", "The SSH connection dropped before the command ran"),
    # The pool's gate (api/admin/revocations.py `admits`): revoked after the request was admitted.
    NotAdmitted: (403, "identity-revoked", "Revoked"),
    SSHPoolError: (502, "ssh-error", "SSH failed"),
    # Files (api/files/): the host answered an SFTP request with an error.
    RemoteNotFound: (404, "file-not-found", "No such file or directory"),
    RemotePermissionDenied: (403, "file-permission-denied", "The host refused access"),
    RemoteNoSpace: (507, "no-space", "No space left on the host's filesystem"),
    RemoteUnsupported: (501, "not-supported", "This host's SSH backend cannot do that"),
    RemoteFileFailure: (409, "file-conflict", "The host refused the file operation"),
}


# Starlette's own errors (no route, wrong method, a body over the cap) by status; others are
# `http-error`.
HTTP_KINDS = {404: "not-found", 405: "method-not-allowed", 413: "too-large"}


def _ssh_row(exc: SSHPoolError) -> tuple[int, str, str]:
    return next(SSH_ERRORS[c] for c in type(exc).__mro__ if c in SSH_ERRORS)


def ssh_detail(exc: SSHPoolError, host: str) -> str:
    """What a client is told (and a job stores) about an SSH failure: the host and the kind of
    failure. The exception's own text names the remote account, address, key and known_hosts
    paths: it goes to the log (`log_ssh_failure`), never into an answer."""
    title = _ssh_row(exc)[2]
    return f"host {host!r}: {title[0].lower()}{title[1:]}"


def log_ssh_failure(exc: SSHPoolError, host: str, job_id: str) -> None:
    log.warning("job %s on host %s: %s: %s", job_id, host, type(exc).__name__, exc)


def ssh_problem(
    exc: SSHPoolError | None,
    kind: str | None = None,
    *,
    host: str | None = None,
    detail: str | None = None,
    **extensions: Any,
) -> Problem:
    """The Problem for an SSH failure before the command started; `kind` re-creates one from a
    stored job (the exception is gone by then). The detail names `host`, never the target."""
    row = _ssh_row(exc) if exc else None
    if row is None:
        row = next((r for r in SSH_ERRORS.values() if r[1] == kind), SSH_ERRORS[SSHPoolError])
    status, kind, title = row
    headers = retry_after(getattr(exc, "retry_after", 1.0)) if status == 503 else None
    if detail is None and exc is not None:
        detail = ssh_detail(exc, host or "?")
        log_ssh_failure(exc, host or "?", str(extensions.get("job_id")))
    return Problem(status, kind, title, detail, headers=headers, **extensions)


def error_kind(exc: SSHPoolError) -> str:
    return _ssh_row(exc)[1]


def install(app: FastAPI) -> None:
    """Render every error the app can raise as problem+json."""

    async def on_problem(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, Problem)
        return exc.response(request.url.path)

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        found = exc.errors()
        errors = [
            {
                "loc": [_clip(part) for part in e.get("loc", ())],
                "msg": _clip(e.get("msg", ""), MAX_ERROR_TEXT),
                "type": _clip(e.get("type", "")),
            }
            for e in found[:MAX_ERRORS]
        ]
        problem = Problem(
            422,
            "invalid-request",
            "Invalid request",
            errors[0]["msg"] if errors else None,
            errors=errors,
            errors_total=len(found),
        )
        return problem.response(request.url.path)

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        code = exc.status_code
        title = HTTPStatus(code).phrase if code in HTTPStatus._value2member_map_ else "HTTP error"
        detail = str(exc.detail) if exc.detail and exc.detail != title else None
        problem = Problem(
            code, HTTP_KINDS.get(code, "http-error"), title, detail, headers=dict(exc.headers or {})
        )
        return problem.response(request.url.path)

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return Problem(500, "internal", "Internal server error").response(request.url.path)

    async def on_store_error(request: Request, exc: Exception) -> JSONResponse:
        if not store_is_down(exc):
            return await on_unexpected(request, exc)
        # Every job is written before it is launched, so nothing ran: a retry is safe.
        log.warning("job store unavailable on %s %s: %r", request.method, request.url.path, exc)
        problem = Problem(
            503,
            "store-unavailable",
            "Job store unavailable",
            "the job store cannot be reached; nothing was run, retry later",
            headers=retry_after(STORE_RETRY_AFTER),
        )
        return problem.response(request.url.path)

    app.add_exception_handler(Problem, on_problem)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    # Registered by class, not under `Exception`: Starlette re-raises what its catch-all handler
    # answered, and the server would log every store outage as a crash.
    for store_error in (DBAPIError, StorePoolTimeout, OSError):
        app.add_exception_handler(store_error, on_store_error)
    app.add_exception_handler(Exception, on_unexpected)


BATCH_ERRORS = {
    "batch-rejected": (422, "The scheduler refused the batch job"),
    "batch-not-submitted": (502, "The batch job did not reach the scheduler"),
}


def error_problem(row: JobRow) -> Problem:
    """The answer for a job in state `error`: the SSH failure's status, naming the job."""
    if row.error_kind == "internal":
        return Problem(500, "internal", "Internal error", row.error, job_id=row.id)
    if row.error_kind in BATCH_ERRORS:
        status, title = BATCH_ERRORS[row.error_kind]
        return Problem(status, row.error_kind, title, row.error, job_id=row.id)
    return ssh_problem(None, row.error_kind, detail=row.error, job_id=row.id, job_state=row.state)
