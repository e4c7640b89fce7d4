"""A job as the API answers it (GET /v1/jobs/{id}), read into attributes; its exit code.

The server's schema (api/schemas.py) is the contract and this its reader: the same fields in the
same order, so `--json` prints what the server sent; tests/api/test_client.py checks that the two
agree. The client keeps its own copy rather than the server's models because those carry the
server (its store, its scheduler): a notebook that imports the client loads no database layer.
The constraints on values (patterns, ranges) are the server's to enforce, not re-checked here.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# The job states (api/states.py is the server's copy), and those a job never leaves.
State = Literal[
    "queued", "running", "succeeded", "failed", "timed_out", "cancelled", "lost", "error"
]
FINAL: tuple[State, ...] = ("succeeded", "failed", "timed_out", "cancelled", "lost", "error")
Stream = Literal["stdout", "stderr"]


class BatchOptions(BaseModel):
    """A batch job's sbatch options (its script is not echoed)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str | None = None
    partition: str | None = None
    time_limit: int | None = None
    nodes: int | None = None
    ntasks: int | None = None
    workdir: str | None = None
    env: dict[str, str] = Field(default_factory=dict)


class SchedulerInfo(BaseModel):
    """A batch job as the scheduler sees it: its id, its own state, why pending or how ended."""

    job_id: str | None
    state: str | None = None
    reason: str | None = None


class Job(BaseModel):
    """A job: the request, its state and, once finished, its result (`stdout`, `stderr`: the
    command's bytes decoded as UTF-8, invalid sequences replaced). A listed job has no output."""

    id: str
    owner: str
    issuer: str
    host: str
    kind: Literal["command", "batch"] = "command"
    argv: list[str] | None = None
    command: str | None = None
    template: str | None = None
    params: dict[str, Any] | None = None
    batch: BatchOptions | None = None
    scheduler: SchedulerInfo | None = None
    timeout: float | None
    state: State
    error: str | None = None
    # `node-failed` (a login node failed under it: the same Idempotency-Key runs it again), ...
    error_kind: str | None = None
    node: str | None = None  # the login node it started on, on a host with several
    exit_status: int | None = None
    exit_signal: str | None = None
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    created_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None
    timings: dict[str, float] = Field(default_factory=dict)
    trace_id: str | None = None  # the job's OpenTelemetry trace; null when the API does not trace
    stdout: str = ""
    stderr: str = ""
    encoding: Literal["utf-8; invalid bytes replaced by U+FFFD"] = (
        "utf-8; invalid bytes replaced by U+FFFD"
    )


def exit_code(job: Job) -> int:
    """A shell's exit status for a job: the command's status, 128+n for a signal, 124 for a
    timeout (as timeout(1)), 130 cancelled, 255 when nothing ran or the outcome is unknown."""
    import signal

    if job.exit_signal:
        try:
            return 128 + signal.Signals[f"SIG{job.exit_signal}"].value
        except KeyError:
            return 255
    if job.state == "timed_out":
        return 124
    if job.state == "cancelled":
        return 130
    if job.exit_status is not None and job.exit_status >= 0:
        return job.exit_status
    return 255
