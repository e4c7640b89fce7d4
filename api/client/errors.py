"""The errors the client raises (one tree, as httpx's: see the package's docstring) and
the warning it gives."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NoReturn

import httpx

from api.client.models import Job


class SshapiError(Exception):
    """Base of every error this client raises."""


class TransportError(SshapiError):
    """The server could not be reached, or dropped the connection, after the retries."""


class UnexpectedAnswer(SshapiError):
    """The server answered, but not with the JSON this client reads (not JSON, another shape:
    a proxy's page, another version of the API)."""


class InsecureHTTPWarning(UserWarning):
    """A token goes over plain HTTP to another host than this one, as opted in to."""


class JobFailed(SshapiError):
    """`run(check=True)`: the job ended in another state than `succeeded`."""

    def __init__(self, job: Job) -> None:
        super().__init__(f"job {job.id} {job.state} (exit status {job.exit_status})")
        self.job = job


class ProblemError(SshapiError):
    """The API answered an `application/problem+json` error."""

    def __init__(self, status: int, body: Mapping[str, Any], headers: Mapping[str, str]) -> None:
        self.status = status
        self.type: str = str(body.get("type", "about:blank"))
        self.kind = self.type.rsplit(":", 1)[-1]  # "rate-limited", "job-not-found", ...
        self.title: str = str(body.get("title", ""))
        self.detail: str | None = body.get("detail")
        self.job_id: str | None = body.get("job_id")
        self.body = dict(body)
        self.retry_after = _retry_after(headers)
        super().__init__(f"{status} {self.kind}: {self.detail or self.title}")


class Unauthorized(ProblemError):
    """401: no token, or one the server does not accept."""


class Forbidden(ProblemError):
    """403: the token's scopes or the policy do not allow it."""


class NotFound(ProblemError):
    """404: no such job (or not yours)."""


class Conflict(ProblemError):
    """409: the job is not in a state that allows it (finished, not submitted yet)."""


class InvalidRequest(ProblemError):
    """413, 416, 422: the request itself is wrong."""


class RateLimited(ProblemError):
    """429: a rate limit or a cap, still there after the retries."""


class Unavailable(ProblemError):
    """503: saturated or down, still after the retries; nothing ran."""


class SSHFailed(ProblemError):
    """502, 504: SSH failed before the command started; nothing ran."""


BY_STATUS: dict[int, type[ProblemError]] = {
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    413: InvalidRequest,
    416: InvalidRequest,
    422: InvalidRequest,
    429: RateLimited,
    502: SSHFailed,
    503: Unavailable,
    504: SSHFailed,
}


def _retry_after(headers: Mapping[str, str]) -> float | None:
    try:
        return float(headers["retry-after"])
    except (KeyError, ValueError):
        return None


def raise_for_problem(response: httpx.Response) -> None:
    """Raise the ProblemError subclass of a 4xx/5xx answer."""
    if response.status_code < 400:
        return
    try:
        body = response.json()
    except ValueError:
        body = {"title": response.reason_phrase, "detail": response.text[:500]}
    if not isinstance(body, dict):
        body = {"title": response.reason_phrase}
    cls = BY_STATUS.get(response.status_code, ProblemError)
    raise cls(response.status_code, body, response.headers)


def _raise(response: httpx.Response) -> NoReturn:
    raise_for_problem(response)
    raise SshapiError(f"unexpected answer {response.status_code}")
