"""Batch jobs: `POST /v1/jobs` with `batch` on a host whose configuration names a scheduler.

The job service admits the request and inserts the job `queued` (durable, keyed by its id) before
anything reaches the host; then, here:

    submit:  sbatch, script on stdin, `--comment` = digest of the job id -> scheduler_job_id
    track:   one Tracker per host: one squeue for all of the host's jobs per interval, backing off
             while nothing changes -> state, scheduler_state, exit status, times
    cancel:  scancel from any replica (the scheduler, not this process, owns the job)
    output:  byte ranges of the job's output files, read over SSH as the job's account

No duplicates: a client's retry with the same Idempotency-Key replays the job row, so the API
never runs sbatch twice for one key; and sbatch's own unknown outcomes (connection lost, timeout)
are settled by looking the job id up in the scheduler (`SlurmClient.submit`). A process that dies
during sbatch leaves the row `queued` without a scheduler id: the next start of the same replica
looks the id up (`recover`) and adopts the job, or records `error` (nothing ran; a retry is safe).

A batch job counts against its owner's `max_concurrent` until it is final, pending or running
(api/quota.py): the process tracking it renews its entry every HOLD_REFRESH seconds for its time
limit plus HOLD_MARGIN, so the entry of a job whose tracking process is gone lapses by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any

from sqlalchemy import func

from api.batchspec import BatchOptions, BatchRequest, batch_options
from api.config import Config
from api.jobs.scheduler import (
    JobStatus,
    SchedulerError,
    SlurmClient,
    SubmissionUnknown,
    SubmitRejected,
    Tracker,
)
from api.metrics import Metrics
from api.output import PIECE, OutputChunk, OutputRange, Stream, pieces
from api.policy import Policy
from api.problems import Problem, log_ssh_failure, retry_after, ssh_detail, ssh_problem
from api.quota import Identity, LocalQuota, Quota
from api.states import FINAL
from api.store import JOBS, JobRow, Store, utcnow
from api.tasks import TaskSet
from sshpool import Pool, SSHPoolError, Target

log = logging.getLogger("sshapi.batch")

CANCEL_WAIT = 15.0  # seconds DELETE waits for the scheduler to report the job cancelled
# A lookup that cannot reach the host is retried this long before the job is called `lost`.
RESOLVE_FOR = 600.0
# Active-job entries of batch jobs: renewed this often by the tracking process, each time for the
# job's time limit (DEFAULT_TIME_LIMIT when it names none: the partition's own is unknown here)
# plus the margin.
HOLD_REFRESH = 300.0
HOLD_MARGIN = 3 * HOLD_REFRESH
DEFAULT_TIME_LIMIT = 86400.0

ERRORS_SAYING = {
    "timed_out": "the job exceeded its time limit",
    "lost": "the scheduler no longer knows the job (finished too long ago, or purged)",
}


def signal_name(number: int | None) -> str | None:
    if number is None:
        return None
    with contextlib.suppress(ValueError):
        return signal.Signals(number).name.removeprefix("SIG")
    return str(number)


def hold_ttl(options: BatchOptions | None) -> float:
    """How long a batch job's active-job entry lasts without renewal."""
    limit = options.time_limit if options is not None else None
    return float(limit or DEFAULT_TIME_LIMIT) + HOLD_MARGIN


def owner_of(row: JobRow) -> Identity:
    return (row.owner_iss, row.owner_sub)


class BatchJobs:
    """The batch jobs of every host with a scheduler, for one API process."""

    def __init__(
        self,
        config: Config,
        policy: Policy,
        store: Store,
        pool: Pool,
        metrics: Metrics,
        quota: Quota | None = None,
    ) -> None:
        self.config = config
        self.policy = policy
        self.store = store
        self.pool = pool
        self.metrics = metrics
        self.quota = quota or LocalQuota()
        self.trackers: dict[str, Tracker] = {}
        # (host, scheduler job id) -> job id, for the jobs this process tracks.
        self._jobs: dict[tuple[str, str], str] = {}
        # Job id -> (owner, entry ttl): the active-job entries this process renews.
        self._held: dict[str, tuple[Identity, float]] = {}
        # Lookups of submissions whose outcome is unknown, one per job.
        self._tasks = TaskSet("batch")

    def client(self, host_name: str, target: Target, owner: Identity | None = None) -> SlurmClient:
        """The scheduler's commands on `target`, waiting in `owner`'s turns on a saturated host
        (the job's owner, as for its commands; None: the host's tracker, for every job)."""
        scheduler = self.config.hosts[host_name].scheduler
        assert scheduler is not None
        return SlurmClient(
            self.pool,
            target,
            acquire_timeout=self.config.api.queue_timeout,
            settle=scheduler.settle,
            tenant=owner,
        )

    # ---- lifecycle

    async def start(self, replica: str) -> None:
        """A tracker per host with a scheduler (idle, no SSH, while it tracks nothing: `loops`
        are run by api/services.py's supervisor); the jobs an earlier run of this replica left
        active are tracked again or resolved."""
        for name, host in self.config.hosts.items():
            if host.scheduler is None:
                continue
            tracker = Tracker(
                self.client(name, host.target()),
                interval=host.scheduler.poll_interval,
                max_interval=host.scheduler.max_poll_interval,
                on_change=functools.partial(self._record, name),
            )
            self.trackers[name] = tracker
        for row in await self.store.active_batch(replica):
            if row.host not in self.trackers:
                await self._update(row, state="lost", error="the host has no scheduler any more")
                continue
            # Counted again (this process's local counts started empty), whatever the cap.
            await self.hold(row)
            if row.scheduler_job_id is not None:
                self._track(row.host, row.scheduler_job_id, row.id)
            else:
                self._tasks.spawn(self._resolve(row), f"resolve-{row.id}")

    def loops(self) -> dict[str, Callable[[], Coroutine[Any, Any, None]]]:
        """The long-lived tasks of batch jobs, by name, for the supervisor to run until
        shutdown: a tracker per host, and the renewal of the active-job entries."""
        loops: dict[str, Callable[[], Coroutine[Any, Any, None]]] = {
            f"track-{name}": tracker.run for name, tracker in self.trackers.items()
        }
        loops["renew-batch-holds"] = self._renew
        return loops

    async def hold(self, row: JobRow) -> None:
        """Count an admitted batch job as active until it is final (renewed by `_renew`)."""
        ttl = hold_ttl(batch_options(row.batch) if row.batch else None)
        self._held[row.id] = (owner_of(row), ttl)
        await self.quota.hold(owner_of(row), row.id, ttl)

    async def _release(self, job_id: str, owner: Identity | None) -> None:
        held = self._held.pop(job_id, None)
        owner = owner or (held[0] if held else None)
        if owner is not None:
            await self.quota.leave(owner, job_id)

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(HOLD_REFRESH)
            for job_id, (owner, ttl) in list(self._held.items()):
                await self.quota.hold(owner, job_id, ttl)

    async def close(self) -> None:
        await self._tasks.close()

    # ---- submit

    async def submit(self, row: JobRow, target: Target, request: BatchRequest) -> None:
        """Run sbatch for an admitted job and record the outcome in the store and in ``row``.
        An SSHPoolError means sbatch never ran (the pool retries a connection lost before the
        start; a later loss is settled here): the caller records it like any command's."""
        client = self.client(row.host, target, owner_of(row))
        try:
            submitted = await client.submit(
                request.script, request.options(), row.id, look_first=False
            )
        except SubmitRejected as exc:
            await self._update(row, **_rejected(exc))
            return
        except (SubmissionUnknown, SchedulerError) as exc:
            # sbatch may have run: only the scheduler can tell, later.
            log.warning("job %s: submission outcome unknown (%s); resolving", row.id, exc)
            self._held[row.id] = (owner_of(row), hold_ttl(request.options()))
            self._tasks.spawn(self._resolve(row), f"resolve-{row.id}")
            return
        await self._update(row, scheduler_job_id=submitted.job_id)
        self._held[row.id] = (owner_of(row), hold_ttl(request.options()))
        self._track(row.host, submitted.job_id, row.id)

    async def _resolve(self, row: JobRow) -> None:
        """Settle a submission whose outcome is unknown: adopt the scheduler's job carrying the
        job id, or record that nothing ran. Retried while the host cannot be asked."""
        client = self.client(row.host, self.target_of(row), owner_of(row))
        delay, waited = 1.0, 0.0
        while True:
            try:
                found = await client.find_by_key(row.id)
                break
            except (SSHPoolError, SchedulerError) as exc:
                if waited >= RESOLVE_FOR:
                    if isinstance(exc, SSHPoolError):
                        log_ssh_failure(exc, row.host, row.id)
                        why = ssh_detail(exc, row.host)
                    else:
                        why = str(exc)
                    await self._update(row, state="lost", error=f"submission unknown: {why}")
                    return
                await asyncio.sleep(delay)
                waited += delay
                delay = min(delay * 2, 30.0)
        if found is None:
            await self._update(
                row,
                state="error",
                error="sbatch did not go through (no scheduler job carries this job's id)",
                error_kind="batch-not-submitted",
                idempotency_key=None,
                finished_at=utcnow(),
            )
            return
        log.info("job %s: adopted scheduler job %s", row.id, found)
        await self._update(row, scheduler_job_id=found)
        self._track(row.host, found, row.id)

    # ---- tracking

    def _track(self, host: str, scheduler_job_id: str, job_id: str) -> None:
        self._jobs[(host, scheduler_job_id)] = job_id
        self.trackers[host].track(scheduler_job_id)

    async def _record(self, host: str, status: JobStatus) -> None:
        job_id = self._jobs.get((host, status.job_id))
        if job_id is None:
            return
        values: dict[str, Any] = {
            "state": status.state,
            "scheduler_state": status.scheduler_state,
            "scheduler_reason": status.reason,
        }
        if status.state != "queued":
            values["started_at"] = func.coalesce(JOBS.c.started_at, utcnow())
        if status.final:
            del self._jobs[(host, status.job_id)]
            await self._release(job_id, None)
            values |= {
                "exit_status": status.exit_code,
                "exit_signal": signal_name(status.signal),
                "finished_at": utcnow(),
                "error": ERRORS_SAYING.get(status.state),
            }
        # only_active: a final state recorded first (by a cancel on any replica) stays.
        changed = await self.store.update(job_id, only_active=True, **values)
        if changed and status.final:
            self.metrics.jobs.labels(host, status.state).inc()

    async def wait(self, row: JobRow, seconds: float) -> JobRow:
        """Hold until the scheduler reports the job final or ``seconds`` pass; the stored row."""
        tracker = self.trackers.get(row.host)
        if seconds <= 0 or row.scheduler_job_id is None or tracker is None:
            return row
        with contextlib.suppress(TimeoutError):
            await tracker.wait(row.scheduler_job_id, seconds)
        return await self.store.get(row.id) or row

    # ---- cancel and output

    def target_of(self, row: JobRow) -> Target:
        target = self.policy.target_of(row.host, row.target, owner_of(row))
        if target is None:
            raise Problem(
                409,
                "account-gone",
                "The job's account is no longer configured",
                f"host {row.host!r} has no account {row.target!r} in the configuration",
            )
        return target

    async def cancel(self, row: JobRow) -> JobRow:
        """scancel, then wait (bounded) for the scheduler to report the job final; 409 if it had
        finished already or was not submitted yet."""
        with answered_as_problem(row):
            return await self._cancel(row)

    async def _cancel(self, row: JobRow) -> JobRow:
        if row.scheduler_job_id is None:
            raise Problem(
                409,
                "not-submitted-yet",
                "Job not submitted yet",
                f"job {row.id} has no scheduler job yet; try again",
                headers=retry_after(1),
            )
        client = self.client(row.host, self.target_of(row), owner_of(row))
        job = row.scheduler_job_id
        status = (await client.states([job]))[job]
        if not status.final:
            await client.cancel(job)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + CANCEL_WAIT
            while not status.final and loop.time() < deadline:
                await asyncio.sleep(0.2)
                status = (await client.states([job]))[job]
        if status.final:
            self._jobs.setdefault((row.host, job), row.id)
            await self._release(row.id, owner_of(row))
            await self._record(row.host, status)
        fresh = await self.store.get(row.id) or row
        if status.state != "cancelled":
            raise Problem(
                409,
                "job-finished",
                "Job already finished",
                f"job {row.id} is {fresh.state} (scheduler: {status.scheduler_state})",
            )
        return fresh

    async def read_bytes(self, row: JobRow, stream: Stream, offset: int, limit: int) -> bytes:
        """One read of the job's output file over SSH (at most `limit` bytes from `offset`):
        what the live feed of a batch job polls (api/live/hub.py)."""
        if row.scheduler_job_id is None or row.batch is None:
            return b""
        path = batch_options(row.batch).output_path(row.scheduler_job_id, row.id, stream)
        client = self.client(row.host, self.target_of(row), owner_of(row))
        with answered_as_problem(row):
            return (await client.read_output(path, offset, limit)).data

    async def output(self, row: JobRow, stream: Stream, offset: int, limit: int) -> OutputRange:
        """The range, read over SSH a PIECE at a time: the first piece before answering (its
        size line tells whether there is a file), the rest while the answer is sent."""
        if row.scheduler_job_id is None or row.batch is None:
            return OutputRange(offset, None, 0, pieces())
        path = batch_options(row.batch).output_path(row.scheduler_job_id, row.id, stream)
        client = self.client(row.host, self.target_of(row), owner_of(row))
        with answered_as_problem(row):
            first = await client.read_output(path, offset, min(limit, PIECE))
        if first.size is None:
            return OutputRange(offset, None, 0, pieces())
        # Output files only grow: the range is fixed by the size read first.
        end = offset + min(limit, max(0, first.size - offset))
        return OutputRange(
            offset, first.size, end - offset, self._rest(row, client, path, first, end)
        )

    @staticmethod
    async def _rest(
        row: JobRow, client: SlurmClient, path: str, first: OutputChunk, end: int
    ) -> AsyncIterator[bytes]:
        yield first.data
        at = first.next_offset
        while at < end:
            # Failing here, after the answer started, cuts the connection short of its
            # Content-Length: the client sees an incomplete body, never a short "whole" one.
            with answered_as_problem(row):
                chunk = await client.read_output(path, at, min(PIECE, end - at))
            if not chunk.data:
                raise RuntimeError(f"output of job {row.id} shrank while read")
            yield chunk.data
            at = chunk.next_offset

    async def _update(self, row: JobRow, **values: Any) -> None:
        final = values.get("state") in FINAL
        if final:
            values.setdefault("finished_at", utcnow())
            # Given back before the state is readable (as api/jobs/runner.py `_record_outcome`).
            await self._release(row.id, owner_of(row))
        changed = await self.store.update(row.id, only_active=True, **values)
        if changed and final:
            self.metrics.jobs.labels(row.host, values["state"]).inc()
        for name, value in values.items():
            setattr(row, name, value)


@contextlib.contextmanager
def answered_as_problem(row: JobRow) -> Iterator[None]:
    """SSH and scheduler failures of a request about a job, as its HTTP answer."""
    try:
        yield
    except SSHPoolError as exc:
        raise ssh_problem(exc, host=row.host, job_id=row.id) from exc
    except SchedulerError as exc:
        raise Problem(
            502, "scheduler-error", "The scheduler command failed", str(exc), job_id=row.id
        ) from exc


def _rejected(exc: SubmitRejected) -> dict[str, Any]:
    # Nothing was submitted: release the key so that a corrected request may reuse it.
    return {
        "state": "error",
        "error": str(exc),
        "error_kind": "batch-rejected",
        "idempotency_key": None,
    }
