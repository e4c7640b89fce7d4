"""The job service: admission, the insert, and the hand-off to the runner.

Admission comes first (nothing is created when it fails): `Policy.admit` (api/policy.py) checks
host, kind of command, templates and sizes; then, here, the idempotency replay/conflict, the
caller's token bucket (429) and concurrent-job cap (429). An admitted job is inserted as
`queued` and durable before any answer; then the runner (api/jobs/runner.py) runs it: a command
on the pool, or sbatch for a batch job (`batch` in the body), after which the scheduler owns it
(api/jobs/batch.py). Cancels are api/jobs/cancel.py's, live followers the hub's (api/live/);
the service is their one face for the routes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import uuid
from collections.abc import AsyncIterator

from sqlalchemy.exc import IntegrityError

from api import tracing
from api.accounts import AccountLookups
from api.auth import Principal
from api.config import Config, PolicyRule
from api.jobs.batch import BatchJobs, hold_ttl, owner_of
from api.jobs.cancel import Cancels
from api.jobs.runner import Launch, Runner
from api.live import Feed, LiveHub, Relay, Spend
from api.metrics import Metrics
from api.output import MAX_READ, OutputRange, Stream, stored_range
from api.policy import Policy
from api.problems import Problem
from api.quota import LocalQuota, Quota
from api.schemas import JobRequest
from api.states import FINAL
from api.store import JobRow, Store, new_id, utcnow
from api.tasks import Supervisor
from api.timing import stage
from sshpool import Pool


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
        accounts: AccountLookups,
        quota: Quota | None = None,
        relay: Relay | None = None,
    ) -> None:
        self.config = config
        self.policy = policy
        self.store = store
        self.replica = replica
        self.quota = quota or LocalQuota()
        # Built and started by api/services.py, whose supervisor runs its trackers.
        self.batch = batch
        self.accounts = accounts
        self.live = LiveHub(
            store.get, batch.read_bytes, self.quota, config.api.max_followers, relay
        )
        self.runner = Runner(store, pool, metrics, self.quota, batch, self.live)
        self.cancels = Cancels(policy, store, pool, self.runner, batch, replica)

    def start(self, tasks: Supervisor) -> None:
        """Start what runs for the process's life under `tasks` (the live relay's listener)."""
        self.live.start(tasks)

    # ---- reading

    def _read_rate(self, who: Principal) -> tuple[float, int]:
        rule = self.policy.rule_for(who.accountable)
        if rule is None:
            fields = PolicyRule.model_fields
            return fields["rate"].default, fields["burst"].default
        return rule.rate, rule.burst

    async def take_read(self, who: Principal) -> None:
        """Spend a token of who's bucket for SSH-backed reads (output reads, cancels, a live
        follower's reads of a batch job's files): the rule's rate and burst, a bucket apart from
        submissions'."""
        rate, burst = self._read_rate(who)
        # A job handle's reads are its creator's: many handles are no way around the rate.
        await self.quota.take(who.accountable.key, rate, burst, "reads")

    def read_spend(self, who: Principal) -> Spend:
        """How a live follower of `who` pays for its SSH reads (api/live/feeds.py `Cursor.pay`): a
        token of the reads bucket, or, beyond the rate, the time until the next one."""
        rate, _ = self._read_rate(who)

        async def spend() -> float:
            try:
                await self.take_read(who)
            except Problem as exc:
                if exc.status != 429:
                    raise
                return 1.0 / rate  # the bucket gains a token in that time
            return 0.0

        return spend

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
        granted = who.handle is not None and who.handle.job_id == job_id
        if row is None or not (who.is_admin or owner_of(row) == who.key or granted):
            raise Problem(404, "job-not-found", "No such job", f"no job {job_id!r}")
        return row

    async def list_jobs(
        self, who: Principal, *, state: str | None, host: str | None, limit: int, cursor: str | None
    ) -> tuple[list[JobRow], str | None]:
        owner = None if who.is_admin else who.key
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
        with tracing.span("admission", {"sshapi.host": body.host}):
            admission = self.policy.admit(who, body)
            grant, command, stdin, timeout = (
                admission.grant,
                admission.command,
                admission.stdin,
                admission.timeout,
            )
            # Only a replay compares bodies: without a key there is nothing to hash (CPU).
            digest: str | None = None
            if idempotency_key is not None:
                digest = request_hash(body)
                replay = await self._replay(who, idempotency_key, digest)
                if replay is not None:
                    return replay, True
            rule = grant.rule
            owner = who.key
            await self.quota.take(owner, rule.rate, rule.burst)
            await self.accounts.check(grant)  # after the rate token: lookups cost the caller
        api = self.config.api
        batch = body.batch.model_dump() if body.batch is not None else None
        job_id = new_id()
        # The job's span (None untraced): ended by the runner once the outcome is recorded.
        span = tracing.job_span(job_id, "batch" if batch else "command", body.host, self.replica)
        # Counted before the insert so concurrent submissions see it; never active for longer
        # than it can wait for a channel and run, plus a margin for the kill and the store. A
        # batch job counts until final: its entry is renewed while it is tracked
        # (api/jobs/batch.py).
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
            traceparent=tracing.traceparent(span),
        )
        try:
            with stage("store"):
                await self.store.insert(row)
        except IntegrityError:
            if span is not None:
                span.end()  # the replayed job's trace is its own
            await self.quota.leave(owner, job_id)
            # A concurrent request with the same key won the insert: answer as its replay.
            assert idempotency_key is not None and digest is not None
            replay = await self._replay(who, idempotency_key, digest)
            if replay is None:
                raise
            return replay, True
        except BaseException as exc:
            if span is not None:
                tracing.failed(span, exc)
                span.end()
            await self.quota.leave(owner, job_id)
            raise
        if body.batch is not None:
            self.runner.start_batch(row, owner, grant.target, body.batch, span)
        else:
            launch = Launch(
                grant.target,
                command,
                stdin,
                timeout,
                acquire_timeout=api.queue_timeout,
                max_output=rule.max_output,
            )
            self.runner.start_command(row, owner, launch, span)
        return row, False

    async def _replay(self, who: Principal, key: str, digest: str) -> JobRow | None:
        with stage("store"):
            row = await self.store.by_key(*who.key, key)
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

    # ---- the job's life, its cancel, its output: the runner's, the cancels', the readers'

    async def wait(self, row: JobRow, seconds: float, *, batch_until_final: bool = True) -> JobRow:
        """Hold until the job finishes or `seconds` pass (api/jobs/runner.py `Runner.wait`)."""
        return await self.runner.wait(row, seconds, batch_until_final=batch_until_final)

    async def cancel(self, who: Principal, job_id: str) -> JobRow:
        """Cancel the caller's job (api/jobs/cancel.py)."""
        await self.take_read(who)
        row = await self.get(who, job_id)
        return await self.cancels.cancel(who, row)

    async def output(
        self, who: Principal, job_id: str, stream: Stream, offset: int, limit: int
    ) -> tuple[JobRow, OutputRange]:
        """A byte range of a job's stdout or stderr: a batch job's output file, read over SSH
        and streamed; a command's kept (capped) output, once it is final."""
        await self.take_read(who)
        row = await self.get(who, job_id)
        if row.kind == "batch":
            return row, await self.batch.output(row, stream, offset, min(limit, MAX_READ))
        kept = (row.stdout if stream == "stdout" else row.stderr) or b""
        return row, stored_range(kept, row.state in FINAL, offset, limit)

    @contextlib.asynccontextmanager
    async def following(self, who: Principal, job_id: str) -> AsyncIterator[Feed]:
        """The live feed of a job the caller may see, for one follower (api/live/hub.py)."""
        row = await self.get(who, job_id)
        async with self.live.following(who.accountable.key, row) as feed:
            yield feed

    async def close(self, grace: float) -> None:
        """Batch jobs go on in the scheduler (their trackers are the supervisor's, stopped
        before this); live feeds stop; running jobs finish for up to `grace` seconds, then are
        cancelled (killed); the cancels in progress end."""
        await self.batch.close()
        await self.live.close()
        await self.runner.close(grace)
        await self.cancels.close()

    def active_count(self) -> int:
        return self.runner.active_count()
