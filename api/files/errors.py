"""The problems of file operations: the 403s of confinement, and an SSH failure's answer
without the host's details."""

from __future__ import annotations

from api.problems import Problem, retry_after, ssh_problem
from sshpool import ConnectionLost, RemoteFileError, SSHPoolError


def outside(given: str) -> Problem:
    return Problem(
        403, "outside-roots", "Path outside your file roots", f"{given!r} is not under your roots"
    )


def protected(given: str) -> Problem:
    return Problem(
        403,
        "protected-path",
        "Will not write where sshd or a login shell reads",
        f"{given!r} is (or holds, or lies in) a path the host's sshd or shells run or trust",
    )


def root_refused(given: str, what: str) -> Problem:
    return Problem(
        403, "root-refused", f"Will not {what} a file root", f"{given!r} is or holds a file root"
    )


def too_many_listings(cap: int) -> Problem:
    return Problem(
        429,
        "too-many-listings",
        "Too many listings at once",
        f"at most {cap} directory listings at once; their next pages are not counted",
        headers=retry_after(1),
    )


def file_problem(exc: SSHPoolError, host: str | None = None) -> Problem:
    """The problem for an SSH failure during a file operation, without the host's details
    (absolute paths, account names): the title says what happened; a 503 names `host` (the
    configured name the caller used)."""
    if isinstance(exc, ConnectionLost):
        return Problem(
            502,
            "connection-lost",
            "The SSH connection to the host dropped",
            "the operation may be incomplete; an upload never leaves a partial file under its name",
        )
    problem = ssh_problem(exc, host=host)
    if isinstance(exc, RemoteFileError):
        problem.detail = None
    return problem
