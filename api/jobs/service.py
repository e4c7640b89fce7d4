"""The job service: running admitted jobs through the pool, their states, idempotency, cancel.

Admission comes first (nothing is created when it fails): `Policy.admit` (api/policy.py) checks
host, kind of command, templates and sizes; then, here, the idempotency replay/conflict, the
caller's token bucket (429) and concurrent-job cap (429). An admitted job is inserted as
`queued` and durable before any answer; then one task per job runs it:

    queued --on_started--> running --> succeeded | failed | timed_out | cancelled | lost
    queued --> error (SSH failed before the command started: nothing ran) | cancelled

The pool.run call runs in its own inner task so that cancelling it (DELETE, shutdown) kills the
remote process tree while the outer task still records the outcome, uncancelled.

A batch job (`batch` in the body) is admitted the same way; its task runs sbatch only, and the
scheduler owns the job from then on (api/batch.py).

Cancelling a job another replica runs (several replicas share PostgreSQL): the store records the
remote process group id when the command starts, so the replica that gets the DELETE marks the
row `cancel_requested` and kills the group itself, over its own pool, as the owner's account. The
owner then sees its command end and, finding the mark, records `cancelled` (not `failed`). A job
still queued on its owner has no process group yet: the owner's `running` write is conditional on
no mark, so it finds the mark there and cancels its own task. One of the two always happens: both
writes are single-row updates the database orders. No replica polls for cancel requests; only the
DELETE itself re-reads the row (backing off) until the owner has recorded the outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.exc import IntegrityError

from api.auth import Principal
from api.config import Config, PolicyRule
from api.jobs.batch import BatchJobs, hold_ttl
from api.live import Feed, LiveHub, Relay
from api.metrics import Metrics
from api.output import MAX_READ, OutputRange, Stream, pieces
from api.policy import Grant, Policy
from api.problems import Problem, error_kind, log_ssh_failure, ssh_detail, ssh_problem
from api.quota import LocalQuota, Quota
from api.schemas import JobRequest
from api.states import FINAL
from api.store import JobRow, Store, new_id, utcnow
from api.timing import stage
from sshpool import CommandResult, CommandTimeout, ConnectionLost, Pool, SSHPoolError

log = logging.getLogger("sshapi.jobs")

# A live follower counts against its owner's follower cap for at most this long (a replica that
# dies with followers cannot block their owner for longer).
FOLLOWER_TTL = 3600.0
CANCEL_WAIT = 15.0  # seconds DELETE waits for the runner to record `cancelled`
# A DELETE of another replica's job re-reads the row from this delay up to the cap, doubling.
CANCEL_POLL = (0.02, 0.5)


@dataclass(slots=True)
class Running:
    """A job this process is running."""

    row: JobRow
    owner: tuple[str, str]
    done: asyncio.Event = field(default_factory=asyncio.Event)
    # Set by the pool once the remote command runs (its wrapper's marker line arrived).
    started: asyncio.Event = field(default_factory=asyncio.Event)
    pgid: int | None = None
    runner: asyncio.Task[None] | None = None
    command: asyncio.Task[CommandResult] | None = None
    cancel_reason: str | None = None
    # Live output of a command, for followers (api/live.py).
    feed: Feed | None = None

    def on_started(self, pgid: int) -> None:
        self.pgid = pgid
        self.started.set()


def request_hash(body: JobRequest) -> str:
    canonical = json.dumps(body.model_dump(exclude_none=True), sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


class JobService:
    def __init__(
        self,
        config: Config,
        policy: Policy,
        store: Store,
        pool: Pool,
        metrics: Metrics,
        replica: str,
        batch: BatchJobs,
        quota: Quota | None = None,
        relay: Relay | None = None,
    ) -> None:
        self.config = config
        self.policy = policy
        self.store = store
        self.pool = pool
        self.metrics = metrics
        self.replica = replica
        self.quota = quota or LocalQuota()
        # Built by the app factory, which also starts it and watches its trackers.
        self.batch = batch
        self._running: dict[str, Running] = {}
        self.live = LiveHub(store.get, self._read_output_file, relay)
        # job id -> the cancel in progress here: concurrent DELETEs of a job share it.
        self._cancels: dict[str, asyncio.Task[JobRow]] = {}

    # ---- reading

    async def take_read(self, who: Principal) -> None:
        """Spend a token of who's bucket for SSH-backed reads (output reads, cancels): the
        rule's rate and burst, a bucket apart from submissions'."""
        rule = self.policy.rule_for(who)
        if rule is None:
            fields = PolicyRule.model_fields
            rate, burst = fields["rate"].default, fields["burst"].default
        else:
            rate, burst = rule.rate, rule.burst
        await self.quota.take(key_of(who), rate, burst, "reads")

    async def get(self, who: Principal, job_id: str) -> JobRow:
        """The job if the caller may see it (owner or admin); 404 otherwise, never 403, so ids
        of other people's jobs are not confirmed. Ids are UUIDs: anything else (NUL, junk) is
        404 without a query (PostgreSQL refuses NUL in text, which was a 500)."""
        try:
            uuid.UUID(job_id)
        except ValueError:
            raise Problem(404, "job-not-found", "No such job", "no such job id") from None
        with stage("store"):
            row = await self.store.get(job_id)
        if row is None or not (who.is_admin or (row.owner_iss, row.owner_sub) == key_of(who)):
            raise Problem(404, "job-not-found", "No such job", f"no job {job_id!r}")
        return row

    async def list_jobs(
        self, who: Principal, *, state: str | None, host: str | None, limit: int, cursor: str | None
    ) -> tuple[list[JobRow], str | None]:
        owner = None if who.is_admin else key_of(who)
        with stage("store"):
            rows = await self.store.list_jobs(
                owner=owner, state=state, host=host, limit=limit + 1, before=cursor
            )
        more = len(rows) > limit
        rows = rows[:limit]
        return rows, (rows[-1].id if more and rows else None)

    # ---- submitting

    async def submit(
        self, who: Principal, body: JobRequest, idempotency_key: str | None
    ) -> tuple[JobRow, bool]:
        """Admit and launch a job, or replay the one made with the same idempotency key.
        Returns (job, replayed)."""
        admission = self.policy.admit(who, body)
        grant, command, stdin, timeout = (
            admission.grant,
            admission.command,
            admission.stdin,
            admission.timeout,
        )
        api = self.config.api
        # Only a replay compares bodies: without a key there is nothing to hash (~1% of CPU).
        digest: str | None = None
        if idempotency_key is not None:
            digest = request_hash(body)
            replay = await self._replay(who, idempotency_key, digest)
            if replay is not None:
                return replay, True
        rule = grant.rule
        owner = key_of(who)
        await self.quota.take(owner, rule.rate, rule.burst)
        batch = body.batch.model_dump() if body.batch is not None else None
        job_id = new_id()
        # Counted before the insert so concurrent submissions see it; never active for longer
        # than it can wait for a channel and run, plus a margin for the kill and the store. A
        # batch job counts until final: its entry is renewed while it is tracked (api/batch.py).
        ttl = (
            hold_ttl(body.batch.options())
            if body.batch is not None
            else api.queue_timeout + timeout + 60
        )
        await self.quota.enter(owner, job_id, rule.max_concurrent, ttl)
        row = JobRow(
            id=job_id,
            owner_iss=who.issuer,
            owner_sub=who.subject,
            replica=self.replica,
            host=body.host,
            target=str(grant.target),
            # A template's rendered argv is stored as what ran (its command is always a list).
            argv=body.argv or (command if isinstance(command, list) and body.template else None),
            command=body.command,
            template=body.template,
            params=body.params,
            timeout=timeout,
            state="queued",
            stdout=b"",
            stderr=b"",
            stdout_bytes=0,
            stderr_bytes=0,
            stdout_truncated=False,
            stderr_truncated=False,
            created_at=utcnow(),
            timings={},
            idempotency_key=idempotency_key,
            request_hash=digest,
            kind="batch" if batch else "command",
            batch=batch,
        )
        try:
            with stage("store"):
                await self.store.insert(row)
        except IntegrityError:
            await self.quota.leave(owner, job_id)
            # A concurrent request with the same key won the insert: answer as its replay.
            assert idempotency_key is not None and digest is not None
            replay = await self._replay(who, idempotency_key, digest)
            if replay is None:
                raise
            return replay, True
        except BaseException:
            await self.quota.leave(owner, job_id)
            raise
        job = Running(row=row, owner=owner)
        self._running[row.id] = job
        self.metrics.jobs_active.labels(row.host).inc()
        if body.batch is not None:
            job.runner = asyncio.create_task(
                self._submit_batch(job, grant, body), name=f"batch-{row.id}"
            )
            return row, False
        # Both tasks exist before we answer, so a DELETE right after a 202 can always cancel.
        job.feed = self.live.open_command(row, rule.max_output)
        job.command = asyncio.create_task(
            self.pool.run(
                grant.target,
                command,
                stdin=stdin,
                timeout=timeout,
                acquire_timeout=api.queue_timeout,
                max_output=rule.max_output,
                on_started=job.on_started,
                on_output=job.feed.append,
                # A saturated host serves identities in turns: one caller's backlog never
                # holds another's single command behind it (sshpool/pool.py `_Waiters`).
                tenant=owner,
            )
        )
        job.runner = asyncio.create_task(self._run(job, timeout), name=f"job-{row.id}")
        return row, False

    async def _replay(self, who: Principal, key: str, digest: str) -> JobRow | None:
        with stage("store"):
            row = await self.store.by_key(who.issuer, who.subject, key)
        if row is None:
            return None
        if row.request_hash != digest:
            raise Problem(
                422,
                "idempotency-key-reused",
                "Idempotency-Key reused with another request",
                "this key was used for a different request body",
                job_id=row.id,
            )
        return row

    # ---- running

    async def _submit_batch(self, job: Running, grant: Grant, body: JobRequest) -> None:
        """sbatch; counted as active (rate, concurrency cap) until the scheduler has the job."""
        assert body.batch is not None
        try:
            await self.batch.submit(job.row, grant.target, body.batch)
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
            row.state, row.started_at, row.pgid = "running", utcnow(), job.pgid
            if job.feed is not None:
                job.feed.update(row)
            # Written at once, not deferred: other replicas need the pgid to cancel the job
            # (deferring it a second saved 3% of CPU per request but made such cancels late).
            if not await self.store.update(
                row.id,
                only_active=True,
                unless_cancel_requested=True,
                state="running",
                started_at=row.started_at,
                pgid=job.pgid,
            ):
                # Another replica asked to cancel it before it started (see the docstring).
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

    async def _finish(self, job: Running) -> None:
        row = job.row
        # Its place under the cap was given back with its outcome; a submitted batch job stays
        # counted until the scheduler ends it (api/batch.py).
        self._running.pop(row.id, None)
        if job.feed is not None:
            self.live.close_command(row)
        self.metrics.jobs_active.labels(row.host).dec()
        if row.state in FINAL:  # a submitted batch job is counted when the scheduler ends it
            self.metrics.jobs.labels(row.host, row.state).inc()
        for name, ms in (row.timings or {}).items():
            self.metrics.stage.labels(name).observe(ms / 1000.0)
        job.done.set()

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

    # ---- cancelling

    async def cancel(self, who: Principal, job_id: str) -> JobRow:
        """Cancel the job; a DELETE while another is in progress here waits for the same
        outcome instead of running its own (scancel, squeue, kill)."""
        await self.take_read(who)
        row = await self.get(who, job_id)
        task = self._cancels.get(job_id)
        if task is None:
            task = asyncio.create_task(self._cancel(who, row), name=f"cancel-{job_id}")
            self._cancels[job_id] = task
            task.add_done_callback(self._cancel_done)
        # Shielded: a caller that goes away does not stop the cancel the others wait for.
        return await asyncio.shield(task)

    def _cancel_done(self, task: asyncio.Task[JobRow]) -> None:
        self._cancels = {k: t for k, t in self._cancels.items() if t is not task}
        if not task.cancelled():
            task.exception()  # retrieved: every waiter may have gone

    async def _cancel(self, who: Principal, row: JobRow) -> JobRow:
        job_id = row.id
        if row.state in FINAL:
            raise _already_finished(row)
        if row.kind == "batch":
            # Let a submission in progress here end first: sbatch itself is never interrupted.
            row = await self.wait(row, CANCEL_WAIT, batch_until_final=False)
            if row.state in FINAL:
                raise _already_finished(row)
            return await self.batch.cancel(row)
        job = self._running.get(job_id)
        if job is None or job.command is None:
            return await self._cancel_elsewhere(who, row)
        job.cancel_reason = f"cancelled by {who.subject}"
        job.command.cancel()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(CANCEL_WAIT):
                await job.done.wait()
        if job.row.state != "cancelled":
            raise _already_finished(job.row)
        return job.row

    async def _apply_cancel_request(self, job: Running) -> None:
        current = await self.store.get(job.row.id)
        if current is not None and current.state not in FINAL and job.command is not None:
            job.cancel_reason = current.cancel_requested or "cancelled"
            job.command.cancel()

    async def _cancel_elsewhere(self, who: Principal, row: JobRow) -> JobRow:
        """Cancel a job another replica runs (see the module docstring). A running job is
        killed here and answered once its owner recorded `cancelled` (still active after
        CANCEL_WAIT: its owner is down; it turns `cancelled` when that replica restarts). A
        queued job is answered at once, as it is: its owner cancels it when it would start."""
        reason = f"cancelled by {who.subject}"
        with stage("store"):
            marked = await self.store.update(row.id, only_active=True, cancel_requested=reason)
            current = await self.store.get(row.id)
        if current is None or not marked:
            raise _already_finished(current or row)
        if current.pgid is None:
            return current
        target = self.policy.target_of(current.host, current.target)
        if target is None:  # its host or account left the configuration: nothing to reach
            return current
        try:
            await self.pool.kill(target, current.pgid)
        except SSHPoolError as exc:
            raise ssh_problem(exc, host=row.host, job_id=row.id) from exc
        except TimeoutError as exc:
            detail = f"the kill of job {row.id} did not finish in time; retry"
            raise ssh_problem(None, "pool-timeout", detail=detail, job_id=row.id) from exc
        delay, cap = CANCEL_POLL
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(CANCEL_WAIT):
                while current.state not in FINAL:
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, cap)
                    current = await self.store.get(row.id) or current
        if current.state in FINAL and current.state != "cancelled":
            raise _already_finished(current)
        return current

    # ---- output

    async def output(
        self, who: Principal, job_id: str, stream: Stream, offset: int, limit: int
    ) -> tuple[JobRow, OutputRange]:
        """A byte range of a job's stdout or stderr: a batch job's output file, read over SSH
        and streamed; a command's stored (capped) output."""
        await self.take_read(who)
        row = await self.get(who, job_id)
        if row.kind == "batch":
            return row, await self.batch.output(row, stream, offset, min(limit, MAX_READ))
        stored = (row.stdout if stream == "stdout" else row.stderr) or b""
        if row.state not in FINAL:
            return row, OutputRange(offset, None, 0, pieces())
        data = stored[offset : offset + limit]
        return row, OutputRange(offset, len(stored), len(data), pieces(data))

    async def _read_output_file(
        self, row: JobRow, stream: Stream, offset: int, limit: int
    ) -> tuple[bytes, int | None]:
        chunk = await self.batch.read_chunk(row, stream, offset, limit)
        return chunk.data, chunk.size

    @contextlib.asynccontextmanager
    async def following(self, who: Principal, job_id: str) -> AsyncIterator[Feed]:
        """The live feed of a job the caller may see, for one follower: counted against the
        caller's follower cap (like the active-job cap: shared through Redis when configured)
        for as long as it follows."""
        row = await self.get(who, job_id)
        cap = self.config.api.max_followers
        counted = (f"follow:{who.issuer}", who.subject)
        follower = new_id()
        try:
            await self.quota.enter(counted, follower, cap, FOLLOWER_TTL)
        except Problem as exc:
            raise Problem(
                429,
                "too-many-followers",
                "Too many followers",
                f"at most {cap} live followers at once per identity",
                headers=exc.headers,
            ) from None
        try:
            async with self.live.feed_for(row) as feed:
                yield feed
        finally:
            await self.quota.leave(counted, follower)

    async def close(self, grace: float) -> None:
        """Let running jobs finish for up to `grace` seconds, then cancel (kill) the rest.
        Batch jobs go on in the scheduler; their trackers stop."""
        await self.batch.close()
        await self.live.close()
        jobs = list(self._running.values())
        if not jobs:
            return
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
        runners = [j.runner for j in self._running.values() if j.runner is not None]
        if runners:
            await asyncio.wait(runners, timeout=CANCEL_WAIT)

    def active_count(self) -> int:
        return len(self._running)


def key_of(who: Principal) -> tuple[str, str]:
    return (who.issuer, who.subject)


def _already_finished(row: JobRow) -> Problem:
    return Problem(409, "job-finished", "Job already finished", f"job {row.id} is {row.state}")


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
    if exc.started:
        log_ssh_failure(exc, row.host, row.id)
        error = f"the connection to host {row.host!r} was lost after the command started"
        if exc.remote_pgid is not None:
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
