"""Cancelling a job: a command this process runs, a command another replica runs, a batch job.

A command here: its runner kills it (api/jobs/runner.py) and records `cancelled`.

A command another replica runs (several replicas share PostgreSQL): the store records the remote
process group id when the command starts, so the replica that gets the DELETE marks the row
`cancel_requested` and kills the group itself, over its own pool, as the owner's account. The
owner then sees its command end and, finding the mark, records `cancelled` (not `failed`). A job
still queued on its owner has no process group yet: the owner's `running` write is conditional on
no mark, so it finds the mark there and cancels its own task. One of the two always happens: both
writes are single-row updates the database orders. No replica polls for cancel requests; only the
DELETE itself re-reads the row (backing off) until the owner has recorded the outcome.

A batch job: scancel, from any replica (api/jobs/batch.py).

Concurrent DELETEs of one job here share one cancel task (a `TaskSet` of api/tasks.py, cancelled
and awaited on close).
"""

from __future__ import annotations

import asyncio
import contextlib

from api import tracing
from api.auth import Principal
from api.jobs.batch import BatchJobs, owner_of
from api.jobs.runner import CANCEL_WAIT, Runner
from api.policy import Policy
from api.problems import Problem, ssh_problem
from api.states import FINAL
from api.store import JobRow, Store
from api.tasks import TaskSet
from api.timing import stage
from sshpool import Pool, SSHPoolError

# A DELETE of another replica's job re-reads the row from this delay up to the cap, doubling.
CANCEL_POLL = (0.02, 0.5)


def canceller(who: Principal) -> str:
    """Who cancelled, as the job's `error` says: a handle's bearer by its creator's name."""
    if who.handle is not None:
        return f"{who.handle.creator.subject} (handle {who.handle.id})"
    return who.subject


def already_finished(row: JobRow) -> Problem:
    return Problem(409, "job-finished", "Job already finished", f"job {row.id} is {row.state}")


class Cancels:
    """The cancels in progress in this process."""

    def __init__(
        self,
        policy: Policy,
        store: Store,
        pool: Pool,
        runner: Runner,
        batch: BatchJobs,
        replica: str = "",
    ) -> None:
        self.replica = replica
        self.policy = policy
        self.store = store
        self.pool = pool
        self.runner = runner
        self.batch = batch
        # job id -> the cancel in progress here: concurrent DELETEs of a job share it.
        self._cancels: dict[str, asyncio.Task[JobRow]] = {}
        self._tasks = TaskSet("cancel", expected=(Problem,))

    async def cancel(self, who: Principal, row: JobRow) -> JobRow:
        """Cancel the job (the caller may see it); a DELETE while another is in progress here
        waits for the same outcome instead of running its own (scancel, squeue, kill)."""
        task = self._cancels.get(row.id)
        if task is None:
            task = self._tasks.spawn(self._cancel(who, row), f"cancel-{row.id}")
            self._cancels[row.id] = task
            task.add_done_callback(self._cancel_done)
        # Shielded: a caller that goes away does not stop the cancel the others wait for.
        return await asyncio.shield(task)

    def _cancel_done(self, task: asyncio.Task[JobRow]) -> None:
        self._cancels = {k: t for k, t in self._cancels.items() if t is not task}

    async def _cancel(self, who: Principal, row: JobRow) -> JobRow:
        """The cancel, traced as `job cancel` in the job's own trace (whichever replica runs
        it: the row keeps the job's span context), linked to the DELETE's span."""
        with tracing.in_job(row.traceparent, "job cancel", row.id) as span:
            if span is not None:
                span.set_attribute("sshapi.replica", self.replica)
            return await self._cancel_here_or_elsewhere(who, row)

    async def _cancel_here_or_elsewhere(self, who: Principal, row: JobRow) -> JobRow:
        if row.state in FINAL:
            raise already_finished(row)
        if row.kind == "batch":
            # Let a submission in progress here end first: sbatch itself is never interrupted.
            row = await self.runner.wait(row, CANCEL_WAIT, batch_until_final=False)
            if row.state in FINAL:
                raise already_finished(row)
            return await self.batch.cancel(row)
        job = self.runner.get(row.id)
        if job is None or job.command is None:
            return await self._cancel_elsewhere(who, row)
        done = await self.runner.cancel(job, f"cancelled by {canceller(who)}")
        if done.state != "cancelled":
            raise already_finished(done)
        return done

    async def _cancel_elsewhere(self, who: Principal, row: JobRow) -> JobRow:
        """Cancel a job another replica runs (see the module docstring). A running job is
        killed here and answered once its owner recorded `cancelled` (still active after
        CANCEL_WAIT: its owner is down; it turns `cancelled` when that replica restarts). A
        queued job is answered at once, as it is: its owner cancels it when it would start."""
        reason = f"cancelled by {canceller(who)}"
        with stage("store"):
            marked = await self.store.update(row.id, only_active=True, cancel_requested=reason)
            current = await self.store.get(row.id)
        if current is None or not marked:
            raise already_finished(current or row)
        if current.pgid is None:
            return current
        target = self.policy.target_of(current.host, current.target, owner_of(current))
        if target is None:  # its host or account left the configuration: nothing to reach
            return current
        if target.nodes and current.node not in target.nodes:
            return current  # a group id means nothing on another login node
        try:
            await self.pool.kill(target, current.pgid, current.node)
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
            raise already_finished(current)
        return current

    async def close(self) -> None:
        await self._tasks.close()
