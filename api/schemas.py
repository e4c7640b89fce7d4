"""Request and response bodies of the HTTP API, with the examples /docs shows."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from api.batchspec import BatchOptions, BatchRequest, batch_options
from api.states import State
from api.store import JobRow, aware

ParamValue = str | int | float | bool

REQUEST_EXAMPLES = {
    "argv": {
        "summary": "argv: each element arrives byte-exact",
        "value": {"host": "local", "argv": ["echo", "hello world"]},
    },
    "command": {
        "summary": "a raw shell line (only where the policy allows it)",
        "value": {"host": "local", "command": "hostname && uptime", "timeout": 10},
    },
    "template": {
        "summary": "an operator-defined template with typed parameters",
        "value": {"host": "local", "template": "disk_usage", "params": {"path": "/tmp"}},
    },
    "stdin": {
        "summary": "a command reading stdin",
        "value": {"host": "local", "argv": ["wc", "-c"], "stdin": "12345"},
    },
    "batch": {
        "summary": "a batch job for the host's scheduler (Slurm)",
        "value": {
            "host": "local",
            "batch": {
                "script": "#!/bin/bash\nsrun hostname\n",
                "name": "hello",
                "partition": "debug",
                "time_limit": 600,
                "nodes": 1,
                "ntasks": 1,
                "env": {"GREETING": "hi"},
            },
        },
    },
}


def _encodable(value: Any) -> bool:
    """Whether every string in `value` (models, dicts, lists: keys too) encodes to UTF-8."""
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            return False
        return True
    if isinstance(value, BaseModel):
        return all(_encodable(getattr(value, name)) for name in type(value).model_fields)
    if isinstance(value, dict):
        return all(_encodable(k) and _encodable(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return all(_encodable(v) for v in value)
    return True


class JobRequest(BaseModel):
    """Exactly one of `argv`, `command`, `template` (with `params`) or `batch`."""

    model_config = ConfigDict(extra="forbid")

    host: str = Field(min_length=1, max_length=64, description="A configured host name.")
    argv: list[str] | None = Field(
        default=None,
        min_length=1,
        max_length=10_000,
        description="Program and arguments; each element is quoted for the remote shell.",
    )
    command: str | None = Field(
        default=None,
        min_length=1,
        max_length=100_000,
        description="A raw shell line, run by the remote login shell. Needs policy permission.",
    )
    template: str | None = Field(default=None, max_length=64, description="A template name.")
    params: dict[str, ParamValue] | None = Field(default=None, description="Template parameters.")
    timeout: float | None = Field(
        default=None, gt=0, description="Seconds the command may run; capped by the policy."
    )
    stdin: str | None = Field(default=None, description="Sent to the command's stdin (UTF-8).")
    batch: BatchRequest | None = Field(
        default=None,
        description="A batch script and its scheduler options, for a host with a scheduler. "
        "The answer comes once the scheduler took it (202, `scheduler.job_id` set); "
        "`Prefer: wait=N` also waits for the job to finish.",
    )

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        # One error for all unknown keys, found before field validation: `extra="forbid"`
        # alone makes one error object per key (90,000 keys: 0.9 s of CPU for one 422).
        if isinstance(data, dict):
            unknown = [k for k in data if k not in cls.model_fields]
            if unknown:
                shown = ", ".join(repr(str(k)[:64]) for k in unknown[:5])
                more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
                raise ValueError(f"unknown field(s): {shown}{more}")
        return data

    @model_validator(mode="after")
    def _one_kind(self) -> JobRequest:
        kinds = ("argv", "command", "template", "batch")
        given = [k for k in kinds if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of argv, command, template or batch")
        if self.batch is not None and (self.timeout is not None or self.stdin is not None):
            raise ValueError("a batch job takes batch.time_limit, not timeout; no stdin")
        if self.params is not None and self.template is None:
            raise ValueError("params go with a template")
        if self.argv is not None and any("\0" in a for a in self.argv):
            raise ValueError("argv elements cannot contain NUL bytes")
        if self.command is not None and "\0" in self.command:
            raise ValueError("the command cannot contain NUL bytes")
        if not _encodable(self):
            # JSON's \ud800 escapes decode to lone surrogates, which UTF-8 cannot carry to the
            # host or the store: refused here, not a UnicodeEncodeError (500) later.
            raise ValueError("strings must be valid Unicode (no lone surrogates)")
        return self


class SchedulerInfo(BaseModel):
    """A batch job as the scheduler sees it."""

    job_id: str | None = Field(description="The scheduler's job id; null until submitted.")
    state: str | None = Field(
        default=None, description="The scheduler's own state, e.g. PENDING, TIMEOUT, NODE_FAIL."
    )
    reason: str | None = Field(default=None, description="Why pending, or how it ended.")


class JobSummary(BaseModel):
    """A job without its output: what `GET /v1/jobs` lists. Read the output of one job with
    `GET /v1/jobs/{id}` or, in byte ranges, `GET /v1/jobs/{id}/output`: a list stays small
    whatever the jobs printed.

    A batch job (`kind` "batch") has `batch` (its options; the script is not echoed) and
    `scheduler`; its output is in files read with `GET /v1/jobs/{id}/output`, and `exit_status`
    is the batch script's. `stdout_bytes`/`stderr_bytes` count every byte the command wrote,
    including those beyond the policy's output cap (then `*_truncated` is true)."""

    id: str
    owner: str = Field(description="The token's `sub`.")
    issuer: str = Field(description="The token's `iss`: identity is (issuer, owner).")
    host: str
    kind: Literal["command", "batch"] = "command"
    argv: list[str] | None = None
    command: str | None = None
    template: str | None = None
    params: dict[str, Any] | None = None
    batch: BatchOptions | None = None
    scheduler: SchedulerInfo | None = None
    timeout: float | None = Field(description="Seconds the command may run (null: batch job).")
    state: State
    error: str | None = Field(default=None, description="Why the job is in `error` or `lost`.")
    error_kind: str | None = Field(
        default=None,
        description="The kind of `error`, for programs: `node-failed` (`lost`: its login node "
        "failed; the same Idempotency-Key runs it again), the problem type of an `error`...",
    )
    node: str | None = Field(
        default=None,
        description="The login node the command started on, on a host with several (`lost` "
        "with a login node's failure: that node); for admins only, unless "
        "`api.host_details_require_admin` is false.",
    )
    exit_status: int | None = None
    exit_signal: str | None = None
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    created_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None
    timings: dict[str, float] = Field(
        default_factory=dict, description="Milliseconds per stage: queue, connect, open, exec."
    )
    trace_id: str | None = Field(
        default=None,
        description="The OpenTelemetry trace the job's spans are in (32 hex digits; the "
        "caller's own when it sent a `traceparent`); null when the API does not trace.",
    )

    @classmethod
    def of(cls, row: JobRow, details: bool = True) -> Self:
        """Never reads the row's output columns (a listed row does not load them). `details`
        false: without the login node (`api.host_details_require_admin`: a node's name is a
        host name)."""
        batch = row.kind == "batch" and row.batch is not None
        return cls(
            id=row.id,
            owner=row.owner_sub,
            issuer=row.owner_iss,
            host=row.host,
            kind="batch" if batch else "command",
            argv=row.argv,
            command=row.command,
            template=row.template,
            params=row.params,
            batch=batch_options(row.batch or {}) if batch else None,
            scheduler=SchedulerInfo(
                job_id=row.scheduler_job_id,
                state=row.scheduler_state,
                reason=row.scheduler_reason,
            )
            if batch
            else None,
            timeout=None if batch else row.timeout,
            state=row.state,  # type: ignore[arg-type]
            error=row.error,
            exit_status=row.exit_status,
            exit_signal=row.exit_signal,
            stdout_bytes=row.stdout_bytes or 0,
            stderr_bytes=row.stderr_bytes or 0,
            stdout_truncated=bool(row.stdout_truncated),
            stderr_truncated=bool(row.stderr_truncated),
            created_at=aware(row.created_at) or row.created_at,
            started_at=aware(row.started_at),
            finished_at=aware(row.finished_at),
            timings=row.timings or {},
            error_kind=row.error_kind,
            node=row.node if details else None,
            trace_id=row.traceparent[3:35] if row.traceparent else None,
        )


class Job(JobSummary):
    """A job: the request, its state and, once finished, its result.

    stdout and stderr are the command's bytes decoded as UTF-8; invalid sequences are replaced
    by U+FFFD (`encoding` says so); at most the policy's `max_output` bytes each."""

    stdout: str = ""
    stderr: str = ""
    encoding: Literal["utf-8; invalid bytes replaced by U+FFFD"] = (
        "utf-8; invalid bytes replaced by U+FFFD"
    )

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "id": "01933c4e-8a5b-7c1e-9f00-2b6d5e1a7c3d",
                    "owner": "alice",
                    "issuer": "sshapi-local",
                    "host": "local",
                    "argv": ["echo", "hello world"],
                    "timeout": 300.0,
                    "state": "succeeded",
                    "exit_status": 0,
                    "stdout": "hello world\n",
                    "stderr": "",
                    "encoding": "utf-8; invalid bytes replaced by U+FFFD",
                    "stdout_bytes": 12,
                    "stderr_bytes": 0,
                    "stdout_truncated": False,
                    "stderr_truncated": False,
                    "created_at": "2026-01-01T12:00:00.000000Z",
                    "started_at": "2026-01-01T12:00:00.002000Z",
                    "finished_at": "2026-01-01T12:00:00.006000Z",
                    "timings": {"queue": 0.02, "connect": 0.0, "open": 0.9, "exec": 3.1},
                }
            ]
        }
    )

    @classmethod
    def of(cls, row: JobRow, details: bool = True) -> Self:
        job = super().of(row, details)
        job.stdout = (row.stdout or b"").decode("utf-8", "replace")
        job.stderr = (row.stderr or b"").decode("utf-8", "replace")
        return job


class JobList(BaseModel):
    items: list[JobSummary] = Field(description="Jobs without their output: see JobSummary.")
    next_cursor: str | None = Field(description="Pass as `cursor` for the next (older) page.")


class HostInfo(BaseModel):
    name: str
    hostname: str | None = Field(
        default=None,
        description="For admins only, unless `api.host_details_require_admin` is false.",
    )
    port: int | None = Field(default=None, description="As `hostname`.")
    description: str = ""
    shell: bool = Field(description="Whether the caller may send raw shell lines here.")
    health: Literal["ok", "down", "unknown"] = Field(
        description="`down`: the circuit breaker is open after failed connects; `unknown`: no "
        "connection made yet."
    )
    pool: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Pool statistics: admins get one per remote account, with its `target`; "
        "others get only the pool of their own account, without it (and without `sshd`, the "
        "login host's address, where host details are admin-only).",
    )
    exec_mode: Literal["channel", "agent", "auto"] = Field(
        default="auto",
        description="How the host is configured to run commands: `auto` (the default: one "
        "executor per connection where the host's python3 answers, a channel per command on "
        "the others), `agent` or `channel`.",
    )
    connections_by_mode: dict[str, int] = Field(
        default_factory=dict,
        description="The live connections of the pools shown (an admin's: every account's; "
        "anyone else's: their own account's) by the mode each is in: `agent` (commands "
        "through its executor) and `channel`.",
    )
    nodes: list[dict[str, Any]] = Field(
        default_factory=list,
        description="A host with several login nodes: each node's `name` and `state` (`up`, "
        "`down`, `draining`: drained with commands still running, `drained`); admins also get "
        "why it is down, its connections, channels in use and waiters over all accounts, "
        "`breaker_open` (any account's) and its routing `counters`.",
    )


class HostAccount(BaseModel):
    name: str
    account: str | None = Field(
        default=None,
        description="The Unix account you run as there: your token's own (a certificate "
        "host); any account for admins; null where it is the operator's (a shared or mapped "
        "account) or where you may not run (then `refused` says why).",
    )
    refused: str | None = None


class WhoAmI(BaseModel):
    """Who the server takes the caller for: what `sshapi whoami` prints."""

    subject: str
    issuer: str
    scopes: list[str]
    admin: bool
    account: str | None = Field(
        default=None, description="The account your token's claim names (null: none)."
    )
    hosts: list[HostAccount] = Field(description="The hosts you may use.")


class NodeInfo(BaseModel):
    """A login node after a drain or undrain."""

    host: str
    node: str
    drained: bool
    state: Literal["up", "down", "draining", "drained"] = Field(
        description="`draining`: drained, commands still running there; `drained`: no "
        "connection left."
    )


class NodeProbe(BaseModel):
    """A login node after a probe asked by an admin."""

    host: str
    node: str
    answered: bool = Field(
        description="The node answered the probe (over the host's service account): a node "
        "that was down is up again."
    )
    state: Literal["up", "down", "draining", "drained"]
