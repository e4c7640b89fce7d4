"""Batch jobs on Slurm over the pool: submit, find by idempotency key, cancel, track, read output.

Everything runs as the pool's account on a login host through ``Pool.run`` with argv (each element
quoted by sshpool, never pasted into a shell line); the batch script goes in on stdin.

No duplicates. Every submission carries ``--comment=sshapi-key:<sha256 of the key>`` (a digest, so
a client's key never shows in other users' ``squeue``). A submission whose outcome is unknown (the
connection dropped after sbatch started, or it timed out and was killed) is resolved by looking
the comment up with ``squeue --me --states=all``: a job found is adopted; only when none turns up
within ``settle`` seconds is sbatch run again, once. A keyed submission also looks first, so a
request retried after the API died right after sbatch adopts the job instead of making a second.
Without a key, a random one is used: unknown outcomes stay resolvable.

Lookups use squeue, not sacct: without slurmdbd there is no sacct. slurmctld keeps finished jobs
for ``MinJobAge`` seconds (default 300; the local Slurm uses 3600): keys older than that are
forgotten, and a tracked job that vanishes from squeue is reported ``lost``.

Tracking costs one ``squeue --jobs=<all tracked ids>`` per poll (state and reason), plus one
command running ``scontrol show job`` for the jobs that just became final (exit codes: squeue does
not show them). At most two SSH commands per poll, whatever the number of jobs.

Output: sbatch gets ``--output``/``--error`` of ``sshapi-%j-<key digest>.out|err`` as absolute
paths in the job's ``workdir``, else in the account's home (where SSH sessions start, resolved
at submission), overriding any ``#SBATCH --output`` in the script and unmoved by an ``#SBATCH
--chdir``, so the paths are known without asking Slurm. Every shell line runs under /bin/sh
with its values as arguments, whatever the account's login shell (tcsh included).
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
from collections.abc import Awaitable, Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass

from api import tracing
from api.batchspec import BatchOptions, key_digest, validate_script
from api.output import MAX_READ, OutputChunk
from api.states import FINAL, State
from sshpool import CommandResult, CommandTimeout, ConnectionLost, Pool, SSHPoolError, Target

log = logging.getLogger("sshapi.scheduler")


# Slurm's job states (base states, as squeue %T and scontrol JobState print them) onto the API's.
# COMPLETING is still running: the final state is known once epilogs end. NODE_FAIL, OOM and
# preemption are failures the job did not survive; BOOT_FAIL means it never started.
STATE_MAP: dict[str, State] = {
    "PENDING": "queued",
    "REQUEUED": "queued",
    "REQUEUE_HOLD": "queued",
    "REQUEUE_FED": "queued",
    "RESV_DEL_HOLD": "queued",
    "CONFIGURING": "queued",
    "RUNNING": "running",
    "COMPLETING": "running",
    "SUSPENDED": "running",
    "STOPPED": "running",
    "SIGNALING": "running",
    "STAGE_OUT": "running",
    "RESIZING": "running",
    "COMPLETED": "succeeded",
    "FAILED": "failed",
    "NODE_FAIL": "failed",
    "OUT_OF_MEMORY": "failed",
    "PREEMPTED": "failed",
    "SPECIAL_EXIT": "failed",
    "CANCELLED": "cancelled",
    "REVOKED": "cancelled",
    "TIMEOUT": "timed_out",
    "DEADLINE": "timed_out",
    "BOOT_FAIL": "error",
}

JOB_ID_RE = re.compile(r"^\d+$")
# squeue --jobs takes a comma list; keep one argument well below any ARG_MAX.
IDS_PER_SQUEUE = 5000

# A job Slurm ends at its time limit is signalled: its exit code is the signal (0:15, or 0:9
# after KillWait), or the script's own status if it caught TERM. slurmctld may clear the job's
# COMPLETING flag before slurmstepd's report of the script's end reaches it; for that moment
# `scontrol` says TIMEOUT with ExitCode 0:0, and the real code lands with the report. A tracker
# holds such a status back this long (seconds), polling at its shortest interval, before it
# reports it as it is: a script that caught TERM and exited 0 is reported that much later.
# 5 s was not enough on a loaded 2-core box (the suite in 3 processes): the report came later.
EXIT_SETTLE = 15.0


class SchedulerError(Exception):
    """A scheduler command failed: ``argv``, exit status and stderr say how."""

    def __init__(self, message: str, *, stderr: str = "", exit_status: int | None = None) -> None:
        super().__init__(message)
        self.stderr = stderr
        self.exit_status = exit_status


class SubmitRejected(SchedulerError):
    """sbatch refused the submission (unknown partition, limits, bad script): nothing was
    submitted. The API answers 4xx with the scheduler's message."""


class SubmissionUnknown(SchedulerError):
    """sbatch may or may not have run and the key lookup could not tell (the host is
    unreachable). The job is ``lost`` until a later ``find_by_key`` settles it."""


def key_comment(key: str) -> str:
    """What --comment holds for an idempotency key."""
    return "sshapi-key:" + key_digest(key)


def _check_job_id(job_id: str) -> str:
    if not JOB_ID_RE.match(job_id):
        raise ValueError(f"not a Slurm job id: {job_id!r}")
    return job_id


@dataclass(frozen=True, slots=True)
class Submitted:
    """A batch job in the scheduler: its id, whether an earlier submission was adopted, and
    where its output goes."""

    job_id: str
    adopted: bool
    stdout_path: str
    stderr_path: str


@dataclass(frozen=True, slots=True)
class JobStatus:
    """A job's state as the API sees it, with the scheduler's own beside it."""

    job_id: str
    state: State
    scheduler_state: str | None  # e.g. "TIMEOUT"; None when the scheduler no longer knows it
    reason: str | None = None  # squeue's reason (why pending, NonZeroExitCode...)
    exit_code: int | None = None  # the batch script's exit status, once final
    signal: int | None = None  # the signal that ended it, if any

    @property
    def final(self) -> bool:
        return self.state in FINAL

    @property
    def exit_unsettled(self) -> bool:
        """Ended at its time limit with no signal and status 0 read: maybe not yet reported."""
        return self.state == "timed_out" and self.exit_code == 0 and self.signal is None


def api_state(scheduler_state: str) -> State:
    """The API state of a Slurm state (flags such as ``+`` suffixes or ``CANCELLED by 0``
    ignored). An unknown state is ``lost``: its outcome cannot be told."""
    base = re.split(r"[ +]", scheduler_state.strip(), maxsplit=1)[0].upper()
    return STATE_MAP.get(base, "lost")


def parse_exit_code(text: str) -> tuple[int | None, int | None]:
    """``ExitCode=3:0`` -> (3, None); ``0:9`` -> (0, 9)."""
    match = re.fullmatch(r"(\d+):(\d+)", text.strip())
    if match is None:
        return None, None
    code, sig = int(match.group(1)), int(match.group(2))
    return code, sig or None


class SlurmClient:
    """Slurm's commands on one login host, over the pool.

    ``commands`` counts the SSH commands this client ran (for tests and metrics)."""

    def __init__(
        self,
        pool: Pool,
        target: Target,
        *,
        timeout: float = 30.0,
        acquire_timeout: float | None = 10.0,
        settle: float = 5.0,
        tenant: Hashable = None,
    ) -> None:
        self.pool = pool
        self.target = target
        # Whose turn its commands wait for on a saturated host (`Pool.run`): the job's owner;
        # None for the tracker's squeue, which serves every job of the host.
        self.tenant = tenant
        self.timeout = timeout
        self.acquire_timeout = acquire_timeout
        # How long an unknown-outcome sbatch may still land: looked up that long before a retry.
        self.settle = settle
        self.commands = 0

    async def _run(
        self,
        argv: str | Sequence[str],
        *,
        stdin: bytes | None = None,
        max_output: int = 1 << 20,
        starts: bool = False,
    ) -> CommandResult:
        """`starts`: the command starts the owner's work (sbatch), so the pool's gate is asked
        (a revoked owner's is refused); the others read or end it (squeue, scancel, output)."""
        self.commands += 1
        # Traced as its program alone (sbatch, squeue, scancel...): never its arguments.
        program = (argv.split(maxsplit=1) or [""])[0] if isinstance(argv, str) else argv[0]
        with tracing.span(f"slurm {program}", {"sshapi.slurm.program": program}):
            return await self.pool.run(
                self.target,
                argv,
                stdin=stdin,
                timeout=self.timeout,
                acquire_timeout=self.acquire_timeout,
                max_output=max_output,
                tenant=self.tenant,
                gated=starts,
            )

    # ---- submit

    async def submit(
        self,
        script: str,
        options: BatchOptions,
        idempotency_key: str | None = None,
        *,
        look_first: bool = True,
    ) -> Submitted:
        """Submit ``script`` with ``options``; the scheduler's job id.

        With a key and ``look_first``, a job already carrying the key is adopted instead; pass
        ``look_first=False`` for a key known to be new (saves one SSH command).

        Raises ValueError (bad script), SubmitRejected (sbatch said no: nothing submitted),
        SubmissionUnknown (cannot tell whether it was submitted) or a pool error raised before
        sbatch started (nothing submitted)."""
        validate_script(script)
        key = idempotency_key if idempotency_key is not None else secrets.token_hex(16)
        if idempotency_key is not None and look_first:
            found = await self.find_by_key(key)
            if found is not None:
                return self._submitted(found, options, key, adopted=True)
        argv = self._sbatch_argv(options, key)
        for attempt in (1, 2):
            try:
                result = await self._run(argv, stdin=script.encode(), starts=True)
            except (ConnectionLost, CommandTimeout) as exc:
                if isinstance(exc, ConnectionLost) and not exc.started:
                    raise  # the pool retried once already; sbatch never ran
                log.warning("sbatch outcome unknown (%s): looking key up", exc)
                found = await self._resolve(key)
                if found is not None:
                    return self._submitted(found, options, key, adopted=True)
                if attempt == 2:
                    raise SubmissionUnknown(
                        "sbatch outcome unknown twice and no job carries the key"
                    ) from exc
                continue
            return self._submitted(self._parse_sbatch(result), options, key, adopted=False)
        raise AssertionError("unreachable")

    def _sbatch_argv(self, options: BatchOptions, key: str) -> list[str]:
        env = [f"{name}={value}" for name, value in sorted(options.env.items())]
        out = options.output_path("%j", key, "stdout")
        err = options.output_path("%j", key, "stderr")
        sbatch = [
            *(["env", *env] if env else []),
            "sbatch",
            "--parsable",
            f"--comment={key_comment(key)}",
            *options.sbatch_args(),
        ]
        # Output paths are absolute, so an `#SBATCH --chdir` in the script cannot move the
        # files away from where `read_output` looks: without `workdir`, the directory the SSH
        # session starts in (the account's home) is resolved there, by /bin/sh (any login
        # shell: argv is quoted for it), and the paths arrive as arguments, never as code.
        script = 'o=$1 e=$2; shift 2; d=$(pwd) && exec "$@" --output="$d/$o" --error="$d/$e"'
        if options.workdir is not None:
            return [*sbatch, f"--output={out}", f"--error={err}"]
        return ["/bin/sh", "-c", script, "sh", out, err, *sbatch]

    @staticmethod
    def _submitted(job_id: str, options: BatchOptions, key: str, *, adopted: bool) -> Submitted:
        return Submitted(
            job_id=job_id,
            adopted=adopted,
            stdout_path=options.output_path(job_id, key, "stdout"),
            stderr_path=options.output_path(job_id, key, "stderr"),
        )

    @staticmethod
    def _parse_sbatch(result: CommandResult) -> str:
        stderr = result.stderr.decode(errors="replace").strip()
        if result.exit_status != 0:
            raise SubmitRejected(
                f"sbatch refused the job: {stderr or 'exit status ' + str(result.exit_status)}",
                stderr=stderr,
                exit_status=result.exit_status,
            )
        # --parsable prints "id" or "id;cluster".
        first = result.stdout.decode(errors="replace").strip().split(";")[0]
        if not JOB_ID_RE.match(first):
            raise SchedulerError(f"sbatch printed no job id: {first!r}", stderr=stderr)
        return first

    async def _resolve(self, key: str) -> str | None:
        """Look the key up until ``settle`` seconds have passed (an sbatch cut off mid-RPC may
        land late). Raises SubmissionUnknown when the host cannot be asked."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settle
        delay = 0.25
        while True:
            try:
                found = await self.find_by_key(key)
            except (SSHPoolError, SchedulerError) as exc:
                if loop.time() >= deadline:
                    raise SubmissionUnknown(f"cannot look the key up: {exc}") from exc
                found = None
            if found is not None or loop.time() >= deadline:
                return found
            await asyncio.sleep(min(delay, max(0.0, deadline - loop.time())))
            delay *= 2

    async def find_by_key(self, key: str) -> str | None:
        """The id of the account's job submitted with this idempotency key, if slurmctld still
        knows it (pending, running or finished less than MinJobAge ago); the oldest if several."""
        result = await self._run(["squeue", "--me", "--states=all", "--noheader", "--format=%i|%k"])
        self._check(result, "squeue")
        comment = key_comment(key)
        ids = []
        for line in result.stdout.decode(errors="replace").splitlines():
            job_id, _, found = line.partition("|")
            if found.strip() == comment and JOB_ID_RE.match(job_id.strip()):
                ids.append(int(job_id))
        if len(ids) > 1:
            log.error("key %s matches several jobs: %s", comment, ids)
        return str(min(ids)) if ids else None

    # ---- cancel, states, output

    async def cancel(self, job_id: str) -> None:
        """scancel the job (pending: removed; running: its processes are signalled). Cancelling a
        finished job does nothing; check states() first to tell the caller."""
        result = await self._run(["scancel", _check_job_id(job_id)])
        self._check(result, "scancel")

    async def states(self, job_ids: Iterable[str]) -> dict[str, JobStatus]:
        """The status of every job id, from one squeue call (one per IDS_PER_SQUEUE ids), plus
        one call for the exit codes of those that are final. Jobs the scheduler no longer knows
        are ``lost``."""
        ids = sorted({_check_job_id(j) for j in job_ids}, key=int)
        statuses: dict[str, JobStatus] = {}
        for start in range(0, len(ids), IDS_PER_SQUEUE):
            chunk = ids[start : start + IDS_PER_SQUEUE]
            result = await self._run(
                [
                    "squeue",
                    "--states=all",
                    "--noheader",
                    "--format=%i|%T|%r",
                    "--jobs=" + ",".join(chunk),
                ],
                max_output=64 * len(chunk) + 4096,
            )
            stderr = result.stderr.decode(errors="replace")
            # One unknown id alone makes squeue fail with this; several unknown ids print nothing.
            if result.exit_status != 0 and "Invalid job id" not in stderr:
                self._check(result, "squeue")
            for line in result.stdout.decode(errors="replace").splitlines():
                parts = line.split("|")
                if len(parts) != 3 or parts[0] not in chunk:
                    continue
                job_id, slurm_state, reason = (p.strip() for p in parts)
                statuses[job_id] = JobStatus(
                    job_id,
                    api_state(slurm_state),
                    slurm_state,
                    None if reason == "None" else reason,
                )
        final = [s.job_id for s in statuses.values() if s.final]
        if final:
            codes = await self._exit_codes(final)
            for job_id, (code, sig) in codes.items():
                old = statuses[job_id]
                statuses[job_id] = JobStatus(
                    job_id, old.state, old.scheduler_state, old.reason, code, sig
                )
        for job_id in ids:
            statuses.setdefault(job_id, JobStatus(job_id, "lost", None, "unknown to squeue"))
        return statuses

    async def _exit_codes(self, job_ids: Sequence[str]) -> dict[str, tuple[int | None, int | None]]:
        """Exit codes from ``scontrol show job`` (squeue has none): one SSH command for all,
        a shell loop over ids that are digits only."""
        # Under /bin/sh whatever the login shell (tcsh has no `for ... do`); ids as arguments.
        loop = 'for j in "$@"; do scontrol --oneliner show job "$j"; done'
        result = await self._run(
            ["/bin/sh", "-c", loop, "sh", *job_ids], max_output=4096 * len(job_ids) + 4096
        )
        codes: dict[str, tuple[int | None, int | None]] = {}
        for line in result.stdout.decode(errors="replace").splitlines():
            job = re.search(r"\bJobId=(\d+)", line)
            code = re.search(r"\bExitCode=(\S+)", line)
            if job is not None and code is not None:
                codes[job.group(1)] = parse_exit_code(code.group(1))
        return codes

    async def read_output(self, path: str, offset: int = 0, limit: int = 1 << 20) -> OutputChunk:
        """Bytes ``[offset, offset+limit)`` of an output file (a Submitted path), and its size."""
        if offset < 0 or not 0 < limit <= MAX_READ:
            raise ValueError(f"offset must be >= 0 and limit in 1..{MAX_READ}")
        if not path or "\0" in path or "\n" in path:
            raise ValueError("bad output path")
        # The size on the first line, then the range; tail seeks on regular files. The pipeline's
        # status is head's (dash has no pipefail), so readability is checked before. Run by
        # /bin/sh whatever the login shell (tcsh expands `!` even inside single quotes), with
        # the path as an argument: argv is quoted safely for every login shell.
        script = (
            'stat -c %s -- "$1" || exit 3; test -r "$1" || exit 4; '
            'tail -c +"$2" -- "$1" | head -c "$3"'
        )
        relative = path if path.startswith("/") else "./" + path
        argv = ["/bin/sh", "-c", script, "sh", relative, str(offset + 1), str(limit)]
        result = await self._run(argv, max_output=limit + 64)
        if result.exit_status == 3:
            return OutputChunk(b"", offset, None)
        self._check(result, "reading output")
        size_line, _, data = result.stdout.partition(b"\n")
        return OutputChunk(data, offset, int(size_line))

    @staticmethod
    def _check(result: CommandResult, what: str) -> None:
        if result.exit_status != 0:
            stderr = result.stderr.decode(errors="replace").strip()
            raise SchedulerError(
                f"{what} failed ({result.exit_status}): {stderr}",
                stderr=stderr,
                exit_status=result.exit_status,
            )


OnChange = Callable[[JobStatus], Awaitable[None] | None]


class Tracker:
    """Follows the jobs of one host with one ``states()`` call per interval.

    The interval starts at ``interval``, doubles (up to ``max_interval``) after a poll where
    nothing changed and drops back when something changes or a job is added. Final jobs are
    reported once and dropped. ``commands`` counts the SSH commands its polls ran."""

    def __init__(
        self,
        client: SlurmClient,
        *,
        interval: float = 1.0,
        max_interval: float = 30.0,
        on_change: OnChange | None = None,
    ) -> None:
        self.client = client
        self.min_interval = interval
        self.max_interval = max_interval
        self.interval = interval
        self.on_change = on_change
        self.commands = 0
        self.polls = 0
        self._last: dict[str, JobStatus | None] = {}
        # Jobs whose exit code may not be reported yet (`EXIT_SETTLE`): when first seen so.
        self._unsettled: dict[str, float] = {}
        self._waiters: dict[str, list[asyncio.Future[JobStatus]]] = {}
        self._wake = asyncio.Event()

    @property
    def tracked(self) -> list[str]:
        return list(self._last)

    def track(self, job_id: str) -> None:
        _check_job_id(job_id)
        if job_id not in self._last:
            self._last[job_id] = None
            self.interval = self.min_interval
            self._wake.set()

    @property
    def waiting(self) -> int:
        """Callers waiting for a job to end (each a future until its job ends or it times out)."""
        return sum(len(futures) for futures in self._waiters.values())

    def status(self, job_id: str) -> JobStatus | None:
        """The last status seen of a tracked job (None before its first poll)."""
        return self._last.get(job_id)

    async def wait(self, job_id: str, timeout: float | None = None) -> JobStatus:
        """Track ``job_id`` until final and return that status (a job already final is
        reported by the next poll)."""
        self.track(job_id)
        future: asyncio.Future[JobStatus] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(job_id, []).append(future)
        try:
            async with asyncio.timeout(timeout):
                return await future
        finally:
            # Timed out or cancelled: forget this waiter, or every replay with `Prefer: wait`
            # would leave one behind until the job ends (5,000 replays: 5,000 futures).
            futures = self._waiters.get(job_id)
            if futures is not None and future in futures:
                futures.remove(future)
                if not futures:
                    del self._waiters[job_id]

    async def poll(self) -> list[JobStatus]:
        """One poll of every tracked job; the statuses that changed."""
        ids = list(self._last)
        if not ids:
            return []
        before = self.client.commands
        try:
            current = await self.client.states(ids)
        finally:
            self.commands += self.client.commands - before
            self.polls += 1
        now = asyncio.get_running_loop().time()
        held = False
        changed = []
        for job_id, status in current.items():
            if job_id not in self._last or self._last[job_id] == status:
                continue
            if status.exit_unsettled:
                first = self._unsettled.setdefault(job_id, now)
                if now - first < EXIT_SETTLE:
                    held = True
                    continue
            self._unsettled.pop(job_id, None)
            changed.append(status)
        # Recorded before waiters wake, so a waiter reading the store sees the new state.
        for status in changed:
            if self.on_change is not None:
                outcome = self.on_change(status)
                if outcome is not None:
                    await outcome
        for status in changed:
            job_id = status.job_id
            if status.final:
                del self._last[job_id]
                for future in self._waiters.pop(job_id, []):
                    if not future.done():
                        future.set_result(status)
            else:
                self._last[job_id] = status
        busy = changed or held
        self.interval = self.min_interval if busy else min(self.interval * 2, self.max_interval)
        return changed

    async def run(self) -> None:
        """Poll until cancelled; idle (no SSH at all) while nothing is tracked. A failed poll is
        logged and retried at the next interval."""
        while True:
            if not self._last:
                self._wake.clear()
                await self._wake.wait()
            try:
                await self.poll()
            except (SSHPoolError, SchedulerError) as exc:
                log.warning("polling %d jobs failed: %s", len(self._last), exc)
                self.interval = min(self.interval * 2, self.max_interval)
            self._wake.clear()
            try:
                async with asyncio.timeout(self.interval):
                    await self._wake.wait()
            except TimeoutError:
                pass
