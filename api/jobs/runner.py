"""One job's life on the pool, once the service (api/jobs/service.py) has admitted and inserted it:

    queued --on_started--> running --> succeeded | failed | timed_out | cancelled | lost
    queued --> error (SSH failed before the command started: nothing ran) | cancelled

The pool.run call runs in its own inner task (`Running.command`) so that cancelling it (DELETE,
shutdown) kills the remote process tree while the outer task (`Running.runner`) still records
the outcome, uncancelled. A batch job's runner runs sbatch only; the scheduler owns the job from
then on (api/jobs/batch.py).

The outcome is recorded after the job's place under the concurrency cap is given back, and a
command killed by another replica's cancel (api/jobs/cancel.py) is recorded `cancelled`, not
`failed`: the runner finds the mark that replica left in the store.

Tasks: every runner is in the Runner's `TaskSet` (api/tasks.py), cancelled and awaited by
`close`; a job's command task and its `running` marker are awaited by its runner.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.trace import Span

from api import tracing
from api.batchspec import BatchRequest
from api.jobs.batch import BatchJobs
from api.live import Feed, LiveHub
from api.metrics import Metrics
from api.problems import error_kind, log_ssh_failure, ssh_detail
from api.quota import Identity, Quota
from api.states import FINAL
from api.store import JobRow, Store, utcnow
from api.tasks import TaskSet
from sshpool import (
    CommandResult,
    CommandTimeout,
    ConnectionLost,
    NodeFailed,
    Pool,
    SSHPoolError,
    Target,
)

log = logging.getLogger("sshapi.jobs")

CANCEL_WAIT = 15.0  # seconds a cancel (or shutdown) waits for a runner to record the outcome


@dataclass(slots=True)
class Running:
    """A job this process is running."""

    row: JobRow
    owner: Identity
    done: asyncio.Event = field(default_factory=asyncio.Event)
    # Set by the pool once the remote command runs (its wrapper's marker line arrived).
    started: asyncio.Event = field(default_factory=asyncio.Event)
    pgid: int | None = None
    # The login node it started on, on a host with several.
    node: str | None = None
    runner: asyncio.Task[None] | None = None
    command: asyncio.Task[CommandResult] | None = None
    cancel_reason: str | None = None
    # Live output of a command, for followers (api/live/).
    feed: Feed | None = None
    # The job's span when it is traced (api/tracing.py): ended in `Runner._finish`.
    span: Span | None = None

    def on_started(self, pgid: int) -> None:
        self.pgid = pgid
        self.started.set()

    def on_node(self, node: str) -> None:
        self.node = node


@dataclass(frozen=True, slots=True)
class Launch:
    """What the pool runs for an admitted command."""

    target: Target
    command: str | Sequence[str]
    stdin: bytes | None
    timeout: float
    acquire_timeout: float
    max_output: int


class Runner:
    """The jobs this process runs: started here, ended here (see the module docstring)."""

    def __init__(
        self,
        store: Store,
        pool: Pool,
        metrics: Metrics,
        quota: Quota,
        batch: BatchJobs,
        live: LiveHub,
    ) -> None:
        self.store = store
        self.pool = pool
        self.metrics = metrics
        self.quota = quota
        self.batch = batch
        self.live = live
        self._running: dict[str, Running] = {}
        self._tasks = TaskSet("job")

    def get(self, job_id: str) -> Running | None:
        return self._running.get(job_id)

    def active_count(self) -> int:
        return len(self._running)

    # ---- starting

    def _admitted(self, row: JobRow, owner: Identity, span: Span | None) -> Running:
        job = Running(row=row, owner=owner, span=span)
        self._running[row.id] = job
        self.metrics.jobs_active.labels(row.host).inc()
        return job

    def start_batch(
        self,
        row: JobRow,
        owner: Identity,
        target: Target,
        request: BatchRequest,
        span: Span | None = None,
    ) -> None:
        job = self._admitted(row, owner, span)
        with tracing.current_or_none(span):
            job.runner = self._tasks.spawn(
                self._submit_batch(job, target, request), f"batch-{row.id}"
            )

    def start_command(
        self, row: JobRow, owner: Identity, launch: Launch, span: Span | None = None
    ) -> None:
        job = self._admitted(row, owner, span)
        with tracing.current_or_none(span):
            self._start_command(job, launch)

    def _start_command(self, job: Running, launch: Launch) -> None:
        row, owner = job.row, job.owner
        # Both tasks exist before the service answers, so a DELETE right after a 202 can always
        # cancel.
        job.feed = self.live.open_command(row, launch.max_output)
        job.command = asyncio.create_task(
            self.pool.run(
                launch.target,
                launch.command,
                stdin=launch.stdin,
                timeout=launch.timeout,
                acquire_timeout=launch.acquire_timeout,
                max_output=launch.max_output,
                on_started=job.on_started,
                on_node=job.on_node,
                on_output=job.feed.append,
                # A saturated host serves identities in turns: one caller's backlog never
                # holds another's single command behind it (sshpool/waiters.py `Waiters`).
                tenant=owner,
            )
        )
        job.runner = self._tasks.spawn(self._run(job, launch.timeout), f"job-{row.id}")

    # ---- running

    async def _submit_batch(self, job: Running, target: Target, request: BatchRequest) -> None:
        """sbatch; counted as active (rate, concurrency cap) until the scheduler has the job."""
        try:
            await self.batch.submit(job.row, target, request)
        except SSHPoolError as exc:
            values = _error_values(exc, job.row)
            await self._record_outcome(job, values | {"finished_at": utcnow()})
        except Exception:
            log.exception("batch job %s failed unexpectedly", job.row.id)
            await self._record_outcome(job, _internal_error())
        finally:
            await self._finish(job)

    async def _record_outcome(self, job: Running, values: dict[str, Any]) -> None:
        """The job's final state, after its place under the concurrency cap is given back: who
        reads that state may submit again at once (a client whose DELETE another replica
        answered once the store said `cancelled`) and must not meet the cap of this job."""
        row = job.row
        await self.quota.leave(job.owner, row.id)
        try:
            await self.store.update(row.id, only_active=True, **values)
        except Exception:
            log.exception("could not record the outcome of job %s", row.id)
        for name, value in values.items():
            setattr(row, name, value)

    async def _run(self, job: Running, timeout: float) -> None:
        row, started = job.row, job.started
        assert job.command is not None

        async def mark_running() -> None:
            await started.wait()
            row.state, row.started_at, row.pgid, row.node = "running", utcnow(), job.pgid, job.node
            if job.feed is not None:
                job.feed.update(row)
            # Written at once, not deferred: other replicas need the pgid to cancel the job
            # (deferring it a second saved a little CPU per request but made such cancels late).
            if not await self.store.update(
                row.id,
                only_active=True,
                unless_cancel_requested=True,
                state="running",
                started_at=row.started_at,
                pgid=job.pgid,
                node=job.node,
            ):
                # Another replica asked to cancel it before it started (api/jobs/cancel.py).
                await self._apply_cancel_request(job)

        marker = asyncio.create_task(mark_running())
        values: dict[str, Any]
        try:
            result = await job.command
            values = _result_values(result, "succeeded" if result.exit_status == 0 else "failed")
        except CommandTimeout as exc:
            values = _result_values(exc.result, "timed_out")
            values["error"] = f"killed after its {timeout:g} s timeout"
        except ConnectionLost as exc:
            values = _lost_or_error(exc, row)
        except SSHPoolError as exc:
            values = _error_values(exc, row)
        except asyncio.CancelledError:
            values = {"state": "cancelled", "error": job.cancel_reason or "cancelled"}
        except Exception:
            log.exception("job %s failed unexpectedly", row.id)
            values = _internal_error()
        finally:
            if started.is_set():
                with contextlib.suppress(Exception):
                    await marker  # `running` (and a cancel request it found) before the final state
            else:
                marker.cancel()
        values["finished_at"] = utcnow()
        if values["state"] in ("failed", "lost"):
            # Killed by another replica's cancel? Then it is `cancelled`, not a failure.
            with contextlib.suppress(Exception):  # unreadable: record what we saw
                current = await self.store.get(row.id)
                if current is not None and current.cancel_requested is not None:
                    values.update(state="cancelled", error=current.cancel_requested)
        await self._record_outcome(job, values)
        await self._finish(job)

    async def _apply_cancel_request(self, job: Running) -> None:
        current = await self.store.get(job.row.id)
        if current is not None and current.state not in FINAL and job.command is not None:
            job.cancel_reason = current.cancel_requested or "cancelled"
            job.command.cancel()

    async def _finish(self, job: Running) -> None:
        row = job.row
        # Its place under the cap was given back with its outcome; a submitted batch job stays
        # counted until the scheduler ends it (api/jobs/batch.py).
        self._running.pop(row.id, None)
        if job.feed is not None:
            self.live.close_command(row)
        self.metrics.jobs_active.labels(row.host).dec()
        if job.span is not None:  # a batch job's ends with its submission (sbatch)
            tracing.end_job_span(job.span, row.state, row.error_kind, row.exit_status)
        if row.state in FINAL:  # a submitted batch job is counted when the scheduler ends it
            self.metrics.jobs.labels(row.host, row.state).inc()
        for name, ms in (row.timings or {}).items():
            self.metrics.stage.labels(name).observe(ms / 1000.0)
        job.done.set()

    # ---- waiting, cancelling, closing

    async def wait(self, row: JobRow, seconds: float, *, batch_until_final: bool = True) -> JobRow:
        """Hold until the job finishes or `seconds` pass; the freshest row this process has.
        A batch job is done here once submitted; with `batch_until_final` the wait goes on
        until the scheduler ends it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        job = self._running.get(row.id)
        if job is not None and seconds > 0:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(seconds):
                    await job.done.wait()
        row = job.row if job is not None else row
        if row.kind == "batch" and batch_until_final and row.state not in FINAL:
            row = await self.batch.wait(row, deadline - loop.time())
        return row

    async def cancel(self, job: Running, reason: str) -> JobRow:
        """Kill a command this process runs; its row once the runner recorded the outcome (or
        CANCEL_WAIT passed)."""
        assert job.command is not None
        job.cancel_reason = reason
        job.command.cancel()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(CANCEL_WAIT):
                await job.done.wait()
        return job.row

    async def close(self, grace: float) -> None:
        """Let running jobs finish for up to `grace` seconds, then cancel (kill) the rest and
        wait for their runners to record it."""
        jobs = list(self._running.values())
        deadline = time.monotonic() + grace
        for job in jobs:
            remaining = deadline - time.monotonic()
            if remaining > 0:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(remaining):
                        await job.done.wait()
        for job in list(self._running.values()):
            job.cancel_reason = "the API shut down"
            if job.command is not None:
                job.command.cancel()
        if len(self._tasks):
            await self._tasks.wait(CANCEL_WAIT)
        await self._tasks.close()


# ---- outcomes


def _result_values(result: CommandResult, state: str) -> dict[str, Any]:
    return {
        "state": state,
        "exit_status": result.exit_status,
        "exit_signal": result.exit_signal,
        "stdout": result.stdout,
        "stderr": result.stderr,
        "stdout_bytes": result.stdout_bytes,
        "stderr_bytes": result.stderr_bytes,
        "stdout_truncated": result.stdout_truncated,
        "stderr_truncated": result.stderr_truncated,
        "timings": {k: round(v * 1000.0, 3) for k, v in result.timings.items()},
    }


def _lost_or_error(exc: ConnectionLost, row: JobRow) -> dict[str, Any]:
    if isinstance(exc, NodeFailed):
        # The node is gone, the outcome unknown: never re-run here, but the same Idempotency-Key
        # may run it again (on a node that is up) once the client decides to.
        log_ssh_failure(exc, row.host, row.id)
        # The node is named in the job's `node` (shown as host details are: api/policy.py
        # `host_details`), not in its error, which everyone who sees the job reads.
        error = f"a login node of host {row.host!r} failed while the command ran there"
        return {
            "state": "lost",
            "error": error,
            "error_kind": "node-failed",
            "idempotency_key": None,
        }
    if exc.started:
        log_ssh_failure(exc, row.host, row.id)
        error = f"the connection to host {row.host!r} was lost after the command started"
        if exc.remote_pgid is not None and exc.remote_killed:
            error += f"; its remote process group {exc.remote_pgid} was killed"
        elif exc.remote_pgid is not None:
            # The command may outlive its connection: tell the operator where to look.
            error += f"; its remote process group {exc.remote_pgid} may still be running"
        return {"state": "lost", "error": error}
    return _error_values(exc, row)


def _internal_error() -> dict[str, Any]:
    return {
        "state": "error",
        "error": "internal error",
        "error_kind": "internal",
        "idempotency_key": None,
        "finished_at": utcnow(),
    }


def _error_values(exc: SSHPoolError, row: JobRow) -> dict[str, Any]:
    # Nothing ran, so a retry is safe: release the idempotency key so that the same key works.
    log_ssh_failure(exc, row.host, row.id)
    return {
        "state": "error",
        "error": ssh_detail(exc, row.host),
        "error_kind": error_kind(exc),
        "idempotency_key": None,
    }
