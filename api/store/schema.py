"""The job table, the record the service holds (`JobRow`), and the small value helpers every
part of the store shares. Job ids are UUIDv7, so ordering by id is ordering by creation time and
the list cursor is simply the last id seen.

`JOBS` is the table as the code reads and writes it; the database gets it through the revisions
in migrations/versions/. A change here comes with a new revision (tests/api/test_api_migrations.py
fails while the two differ). Rows are read with Core into plain `JobRow` records (no ORM)."""

from __future__ import annotations

import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Float,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    Row,
    String,
    Table,
    Text,
    UniqueConstraint,
    true,
)

from api.states import ACTIVE


def new_id() -> str:
    """A UUIDv7 (RFC 9562): 48-bit Unix milliseconds, then random bits. Sorts by creation."""
    ms = time.time_ns() // 1_000_000
    rand = int.from_bytes(secrets.token_bytes(10), "big")
    value = (ms & (2**48 - 1)) << 80 | rand
    value = (value & ~(0xF << 76)) | (0x7 << 76)  # version 7
    value = (value & ~(0x3 << 62)) | (0x2 << 62)  # RFC 4122 variant
    return str(uuid.UUID(int=value))


def utcnow() -> datetime:
    return datetime.now(UTC)


METADATA = MetaData()

JOBS = Table(
    "sshapi_jobs",
    METADATA,
    Column("id", String(36), primary_key=True),
    Column("owner_iss", String(512), nullable=False),
    Column("owner_sub", String(512), nullable=False),
    Column("replica", String(255), nullable=False),
    Column("host", String(64), nullable=False),
    # user@host:port the command ran as (the policy's account), for operators.
    Column("target", String(512), nullable=False),
    Column("argv", JSON, nullable=True),
    Column("command", Text, nullable=True),
    Column("template", String(64), nullable=True),
    Column("params", JSON, nullable=True),
    Column("timeout", Float, nullable=False),
    Column("state", String(16), nullable=False),
    Column("error", Text, nullable=True),
    Column("error_kind", String(64), nullable=True),
    Column("exit_status", Integer, nullable=True),
    Column("exit_signal", String(32), nullable=True),
    Column("stdout", LargeBinary, nullable=False, default=b""),
    Column("stderr", LargeBinary, nullable=False, default=b""),
    Column("stdout_bytes", Integer, nullable=False, default=0),
    Column("stderr_bytes", Integer, nullable=False, default=0),
    Column("stdout_truncated", Boolean, nullable=False, default=False),
    Column("stderr_truncated", Boolean, nullable=False, default=False),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("started_at", DateTime(timezone=True), nullable=True),
    Column("finished_at", DateTime(timezone=True), nullable=True),
    # Milliseconds per stage: queue, connect, open, exec.
    Column("timings", JSON, nullable=False, default=dict),
    Column("idempotency_key", String(255), nullable=True),
    Column("request_hash", String(64), nullable=True),
    # Batch jobs (kind "batch"): the request's script and options, and the scheduler's view. NULL
    # kind is "command" (rows written before batch jobs existed).
    Column("kind", String(16), nullable=True),
    Column("batch", JSON(none_as_null=True), nullable=True),
    Column("scheduler_job_id", String(32), nullable=True),
    Column("scheduler_state", String(64), nullable=True),
    Column("scheduler_reason", Text, nullable=True),
    # The remote process group of a started command (the wrapper's `$$`), so that any replica
    # can kill it; and why a replica other than the owner asked to cancel it.
    Column("pgid", Integer, nullable=True),
    Column("cancel_requested", Text, nullable=True),
    # The login node a command started on, on a host with several (`[hosts.X] nodes`): its
    # process group and live output are there.
    Column("node", String(255), nullable=True),
    # The W3C traceparent of the job's span when it was traced (api/tracing.py): its trace id
    # is in the job's JSON, and another replica's cancel joins that trace.
    Column("traceparent", String(55), nullable=True),
    UniqueConstraint("owner_iss", "owner_sub", "idempotency_key", name="sshapi_jobs_idem"),
    Index("sshapi_jobs_owner", "owner_iss", "owner_sub", "id"),
    Index("sshapi_jobs_replica_state", "replica", "state"),
)

# Identities (issuer and subject) or accounts whose requests are refused at once, on every
# replica (api/admin/revocations.py); deleting the row lifts it. A few rows: every replica reads
# them all each second.
REVOCATIONS = Table(
    "sshapi_revocations",
    METADATA,
    Column("id", String(36), primary_key=True),
    Column("issuer", String(512), nullable=True),
    Column("subject", String(512), nullable=True),
    Column("account", String(64), nullable=True),
    Column("created_at", DateTime(timezone=True), nullable=False),
    # Who revoked: the admin's issuer and subject.
    Column("created_by_iss", String(512), nullable=False),
    Column("created_by_sub", String(512), nullable=False),
    # Whether every replica also ends its running jobs (false: they finish; nothing new starts).
    Column("end_running", Boolean, nullable=False, server_default=true()),
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Revocation:
    """One row of REVOCATIONS: an identity (issuer and subject) or an account."""

    id: str
    issuer: str | None
    subject: str | None
    account: str | None
    created_at: datetime
    created_by_iss: str
    created_by_sub: str
    end_running: bool = True


# Login nodes an admin drained (POST /v1/admin/hosts/{host}/nodes/{node}/drain): no new work
# goes there, on any replica (each reads them every second), until undrained.
NODE_DRAINS = Table(
    "sshapi_node_drains",
    METADATA,
    Column("host", String(64), primary_key=True),
    Column("node", String(255), primary_key=True),
    Column("drained_at", DateTime(timezone=True), nullable=False),
    Column("drained_by_iss", String(512), nullable=False),
    Column("drained_by_sub", String(512), nullable=False),
)


# Every state change of every job (issue 43: one change feed per identity), in commit order:
# `seq` is the feed's event id (Last-Event-ID). Written in the transaction that changes the job's
# state (api/store/store.py), so an event exists exactly when the change does; on PostgreSQL
# those transactions take one advisory lock first, so that a higher seq never commits before a
# lower one (a follower reading "after 41" must not pass 42 still uncommitted). Kept for the
# feed's resume window (`[api] change_window`), then pruned.
JOB_EVENTS = Table(
    "sshapi_job_events",
    METADATA,
    Column(
        "seq",
        BigInteger().with_variant(Integer, "sqlite"),
        primary_key=True,
        autoincrement=True,
    ),
    Column("owner_iss", String(512), nullable=False),
    Column("owner_sub", String(512), nullable=False),
    Column("job_id", String(36), nullable=False),
    Column("state", String(16), nullable=False),
    Column("at", DateTime(timezone=True), nullable=False),
    Index("sshapi_job_events_owner", "owner_iss", "owner_sub", "seq"),
    Index("sshapi_job_events_at", "at"),
    sqlite_autoincrement=True,  # never reuse a pruned seq: a resumed feed would skip events
)

# Job handles (issue 43): bearer tokens that read one job. Only the SHA-256 of the token is kept
# (`digest`): the store never holds what would let its reader act as the handle. The creator's
# identity and token account are kept so that a revocation of either ends the handle.
JOB_HANDLES = Table(
    "sshapi_job_handles",
    METADATA,
    Column("id", String(36), primary_key=True),
    Column("job_id", String(36), nullable=False),
    Column("digest", String(64), nullable=False, unique=True),
    Column("owner_iss", String(512), nullable=False),
    Column("owner_sub", String(512), nullable=False),
    Column("owner_account", String(64), nullable=True),
    Column("cancel", Boolean, nullable=False, default=False),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("expires_at", DateTime(timezone=True), nullable=False),
    Index("sshapi_job_handles_job", "job_id"),
)


@dataclass(frozen=True, slots=True, kw_only=True)
class JobHandle:
    """One row of JOB_HANDLES."""

    id: str
    job_id: str
    digest: str
    owner_iss: str
    owner_sub: str
    owner_account: str | None
    cancel: bool
    created_at: datetime
    expires_at: datetime


# Webhooks (api/webhooks/): where an identity's job state changes are POSTed, signed with the
# webhook's secret (kept: every delivery is signed with it). The last delivery's outcome and the
# count of deliveries given up are kept on the row, for GET /v1/webhooks/{id}.
WEBHOOKS = Table(
    "sshapi_webhooks",
    METADATA,
    Column("id", String(36), primary_key=True),
    Column("owner_iss", String(512), nullable=False),
    Column("owner_sub", String(512), nullable=False),
    Column("url", String(2048), nullable=False),
    # ",job.succeeded,job.failed,": one LIKE '%,<type>,%' selects the webhooks of an event in
    # SQLite and PostgreSQL alike, inside the state change's own transaction.
    Column("events", String(512), nullable=False),
    Column("secret", String(128), nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("last_attempt_at", Float, nullable=True),  # Unix seconds
    Column("last_status", Integer, nullable=True),  # the receiver's HTTP status, if it answered
    Column("last_error", String(512), nullable=True),
    Column("delivered", Integer, nullable=False, default=0),
    Column("failed", Integer, nullable=False, default=0),  # deliveries given up
    # The creator's account claim, if their token had one: a revocation of that account holds
    # the webhook's deliveries too (api/webhooks/deliver.py).
    Column("owner_account", String(64), nullable=True),
    Index("sshapi_webhooks_owner", "owner_iss", "owner_sub"),
)

# Resumable uploads (api/files/resumable.py): one row per upload, so that any replica (or the
# same one after a restart) takes its next chunk. `received`: the bytes confirmed written to the
# temporary file `temp` on the host (the host may hold more: a chunk cut or refused, overwritten
# by the next one). A chunk holds the row's lease (`busy_until`, `busy_by`) while it is written;
# the expiry sweep takes the same lease. Times are Unix seconds (Float).
UPLOADS = Table(
    "sshapi_uploads",
    METADATA,
    Column("id", String(36), primary_key=True),
    Column("owner_iss", String(512), nullable=False),
    Column("owner_sub", String(512), nullable=False),
    Column("owner_account", String(64), nullable=True),  # the token's account claim
    Column("host", String(64), nullable=False),
    Column("path", Text, nullable=False),  # as the client gave it (answers name it)
    Column("resolved", Text, nullable=False),  # where it lands on the host (confined)
    Column("temp", Text, nullable=False),
    Column("length", BigInteger, nullable=False),
    Column("received", BigInteger, nullable=False),
    Column("if_match", Text, nullable=True),
    Column("create_only", Boolean, nullable=False),
    Column("state", String(16), nullable=False),  # open, complete
    Column("created_at", Float, nullable=False),
    Column("expires_at", Float, nullable=False),
    Column("busy_until", Float, nullable=True),
    Column("busy_by", String(36), nullable=True),
    # A complete upload's answer, kept until it expires (HEAD and GET after a lost answer).
    Column("sha256", String(64), nullable=True),
    Column("etag", String(64), nullable=True),
    Column("replaced", Boolean, nullable=True),
    Index("sshapi_uploads_owner", "owner_iss", "owner_sub"),
    Index("sshapi_uploads_expiry", "expires_at"),
)

# The outbox: one row per (event, webhook), inserted in the transaction that changed the job's
# state; any replica delivers it under a lease (`lease_until`, `lease_by`). Times are Unix
# seconds (Float): compared in SQL on both dialects without conversions.
WEBHOOK_DELIVERIES = Table(
    "sshapi_webhook_deliveries",
    METADATA,
    Column("id", String(80), primary_key=True),  # "<event id>:<webhook id>"
    Column("event_id", String(36), nullable=False),  # the `webhook-id` header
    Column("webhook_id", String(36), nullable=False),
    Column("owner_iss", String(512), nullable=False),
    Column("owner_sub", String(512), nullable=False),
    Column("job_id", String(36), nullable=False),
    Column("type", String(32), nullable=False),
    Column("created_at", Float, nullable=False),
    Column("next_at", Float, nullable=False),
    Column("attempts", Integer, nullable=False, default=0),
    # pending -> delivered | failed (given up after the retry window)
    Column("status", String(16), nullable=False),
    Column("lease_until", Float, nullable=True),
    Column("lease_by", String(255), nullable=True),
    Column("last_status", Integer, nullable=True),
    Column("last_error", String(512), nullable=True),
    Index("sshapi_webhook_deliveries_due", "status", "next_at"),
    Index("sshapi_webhook_deliveries_webhook", "webhook_id"),
)


@dataclass(slots=True, kw_only=True)
class JobRow:
    """One job as the service holds it: a row of JOBS as a plain record. Not an ORM-mapped
    class: SQLAlchemy's attribute instrumentation (a descriptor call and an event check on every
    read and write, over a hundred per job) was a tenth of the API's Python calls per job
    (docs/benchmarks.md, "Figures behind the code"). The store reads
    rows with Core and builds these from them; writes are statements (`Store.update`), so a
    field set here changes only this copy."""

    id: str
    owner_iss: str
    owner_sub: str
    replica: str
    host: str
    target: str
    timeout: float
    state: str
    created_at: datetime
    argv: list[str] | None = None
    command: str | None = None
    template: str | None = None
    params: dict[str, Any] | None = None
    error: str | None = None
    error_kind: str | None = None
    exit_status: int | None = None
    exit_signal: str | None = None
    stdout: bytes = b""
    stderr: bytes = b""
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    started_at: datetime | None = None
    finished_at: datetime | None = None
    timings: dict[str, float] = field(default_factory=dict)
    idempotency_key: str | None = None
    request_hash: str | None = None
    kind: str | None = None
    batch: dict[str, Any] | None = None
    scheduler_job_id: str | None = None
    scheduler_state: str | None = None
    scheduler_reason: str | None = None
    pgid: int | None = None
    cancel_requested: str | None = None
    node: str | None = None
    traceparent: str | None = None


FIELDS = tuple(c.key for c in JOBS.columns)
# What a list selects: never the output columns (up to the policy's max_output each).
LISTED = [c for c in JOBS.columns if c.key not in ("stdout", "stderr")]


def job_row(row: Row[Any]) -> JobRow:
    return JobRow(**row._mapping)


# Writes are DB-API calls on the writer's sqlite3 connection (SQLite), text statements on its
# asyncpg connection (PostgreSQL) or Core statements (any other URL): building a statement per
# write cost about as much CPU as running it (py-spy).
Write = Callable[[Any], Any]
ACTIVE_SQL = ", ".join(f"'{state}'" for state in sorted(ACTIVE))


def aware(value: datetime | None) -> datetime | None:
    """SQLite returns naive datetimes; every time here is UTC."""
    if value is not None and value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value
