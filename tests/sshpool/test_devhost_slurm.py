"""Batch jobs against a real Slurm (sshpool.devhost.slurm) reached over a real sshd.

One LocalSlurm for the session (``slurm``, 16 CPUs on one node, in tests/conftest.py) and one
LocalHost whose sessions see its SLURM_CONF (``slurm_host``). A time limit exceeded (TIMEOUT ->
timed_out, SIGTERM) is shown through the API, in tests/api/test_batch_exit_settle.py: Slurm needs
60-90 s for it, paid once (the job is submitted when tests/api/test_api_batch.py starts).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

import psutil
import pytest
from pydantic import ValidationError

from api.batchspec import BatchOptions
from api.jobs.scheduler import (
    JobStatus,
    SlurmClient,
    SubmitRejected,
    Tracker,
    key_comment,
)
from sshpool import CommandResult, ConnectionLost, Pool
from sshpool.devhost import LocalHost, LocalSlurm

pytestmark = pytest.mark.timeout(60)

CPUS = 16  # SLURM_CPUS of tests/conftest.py: the session's LocalSlurm
# Two of these never run at once (2 x 9 > 16), and one runs beside the time-limit job.
BIG = CPUS // 2 + 1
SH = "#!/bin/sh\n"


@pytest.fixture
def opts(workdir: str) -> Callable[..., BatchOptions]:
    """BatchOptions with the session's workdir."""
    return functools.partial(BatchOptions, workdir=workdir)


@pytest.fixture
async def client(slurm_host: LocalHost) -> AsyncIterator[SlurmClient]:
    async with Pool() as pool:
        yield SlurmClient(pool, slurm_host.target(), settle=1.0)


async def _jobs_with_key(client: SlurmClient, key: str) -> list[str]:
    result = await client.pool.run(
        client.target, ["squeue", "--me", "--states=all", "--noheader", "--format=%i|%k"]
    )
    lines = result.stdout.decode().splitlines()
    return [line.split("|")[0] for line in lines if line.endswith("|" + key_comment(key))]


async def _job_count(client: SlurmClient) -> int:
    result = await client.pool.run(client.target, ["squeue", "--me", "--states=all", "-h"])
    return len(result.stdout.splitlines())


async def _wait_state(client: SlurmClient, job_id: str, state: str, timeout: float) -> JobStatus:
    deadline = time.monotonic() + timeout
    while True:
        status = (await client.states([job_id]))[job_id]
        if status.state == state or time.monotonic() > deadline:
            return status
        await asyncio.sleep(0.2)


async def _eventually(check: Callable[[], bool], timeout: float) -> bool:
    """Whether ``check()`` (blocking, run in a thread) turns true within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        if await asyncio.to_thread(check):
            return True
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.1)


# --------------------------------------------------------------------------------------------
# The local Slurm itself


def test_local_slurm_starts_schedules_and_stops_cleanly(tmp_path: Path) -> None:
    """A second LocalSlurm starts (a trivial job has run, within start's own deadline), twice,
    then stops, leaving no process. Its data dir is deep, as pytest's per-worker temp dirs are:
    slurmd's spool, where each job step makes a Unix socket, moves to a short path (a socket's
    path holds 107 bytes; before, the trivial job was requeued for ever)."""
    cluster = LocalSlurm("second", data_dir=tmp_path / ("deep-" * 12), cpus=2)
    assert not cluster.munge_socket.is_relative_to(cluster.dir)
    assert not cluster.spool_dir.is_relative_to(cluster.dir)
    try:
        cluster.start()
        assert cluster.start() is cluster and cluster.running
    finally:
        cluster.stop()
        cluster.stop()
    left = [
        p
        for p in psutil.process_iter(["cmdline"])
        if str(cluster.conf_path) in " ".join(p.info["cmdline"] or [])
    ]
    assert left == []
    assert not cluster.sockets_dir.exists()


def test_slurm_daemons_listen_on_loopback_only(slurm: LocalSlurm) -> None:
    """slurmctld and slurmd bind 127.0.0.1, never 0.0.0.0."""
    daemons = [
        p
        for p in psutil.process_iter(["name", "cmdline"])
        if p.info["name"] in ("slurmctld", "slurmd")
        and str(slurm.conf_path) in " ".join(p.info["cmdline"] or [])
    ]
    assert {p.info["name"] for p in daemons} == {"slurmctld", "slurmd"}
    listening = [
        c.laddr.ip for p in daemons for c in p.net_connections("tcp") if c.status == "LISTEN"
    ]
    assert listening and set(listening) == {"127.0.0.1"}


# --------------------------------------------------------------------------------------------
# Submit, states, output


async def test_job_goes_pending_running_completed_and_output_reads_back(
    client: SlurmClient, opts: Callable[..., BatchOptions]
) -> None:
    """A job held back by a bigger one is seen queued, running, then succeeded; output reads."""
    blocker = await client.submit(SH + "sleep 2\n", opts(ntasks=BIG))
    script = SH + "echo hello; sleep 1; echo world; echo oops >&2\n"
    job = await client.submit(script, opts(name="greet", ntasks=BIG))
    seen: list[str] = []
    tracker = Tracker(
        client, interval=0.1, max_interval=0.2, on_change=lambda s: seen.append(s.state)
    )
    runner = asyncio.create_task(tracker.run())
    try:
        final = await tracker.wait(job.job_id, timeout=30)
    finally:
        runner.cancel()
        await client.cancel(blocker.job_id)
    assert seen[0] == "queued" and "running" in seen and seen[-1] == "succeeded"
    assert (final.scheduler_state, final.exit_code, final.signal) == ("COMPLETED", 0, None)
    out = await client.read_output(job.stdout_path)
    assert (out.data, out.size) == (b"hello\nworld\n", 12)
    part = await client.read_output(job.stdout_path, offset=6, limit=3)
    assert (part.data, part.next_offset, part.size) == (b"wor", 9, 12)
    assert (await client.read_output(job.stderr_path)).data == b"oops\n"


async def test_failing_script_is_failed_with_its_exit_code(
    client: SlurmClient, opts: Callable[..., BatchOptions]
) -> None:
    """exit 3 -> failed, exit code 3, Slurm's FAILED beside it."""
    job = await client.submit(SH + "echo partial; exit 3\n", opts())
    status = await _wait_state(client, job.job_id, "failed", 20)
    assert (status.state, status.scheduler_state, status.exit_code) == ("failed", "FAILED", 3)
    assert (await client.read_output(job.stdout_path)).data == b"partial\n"


async def test_output_of_a_job_not_started_is_absent(
    client: SlurmClient, opts: Callable[..., BatchOptions]
) -> None:
    """Reading the output of a job still pending gives no data and no size."""
    blocker = await client.submit(SH + "sleep 30\n", opts(ntasks=BIG))
    job = await client.submit(SH + "echo never\n", opts(ntasks=BIG))
    try:
        chunk = await client.read_output(job.stdout_path)
        assert (chunk.data, chunk.size) == (b"", None)
    finally:
        await client.cancel(job.job_id)
        await client.cancel(blocker.job_id)


async def test_options_with_shell_metacharacters_arrive_verbatim(
    client: SlurmClient, slurm_host: LocalHost, workdir: str
) -> None:
    """workdir and env values full of shell syntax reach the job byte-exact, nothing runs."""
    workdir = f"{workdir}/odd dir;$(touch pwned) 'q'"
    slurm_host.run_local(["mkdir", "-p", workdir])
    value = "a,b;$(touch pwned) `id` 'x' \"y\" *"
    options = BatchOptions(workdir=workdir, env={"ODD": value, "OTHER": "2"})
    job = await client.submit(SH + 'printf "%s|%s|%s\\n" "$PWD" "$ODD" "$OTHER"\n', options)
    status = await _wait_state(client, job.job_id, "succeeded", 20)
    assert status.state == "succeeded"
    assert job.stdout_path.startswith(f"{workdir}/sshapi-{job.job_id}-")
    out = await client.read_output(job.stdout_path)
    assert out.data.decode() == f"{workdir}|{value}|2\n"
    home = slurm_host.account.home
    assert not await asyncio.to_thread(
        lambda: any(Path(d, "pwned").exists() for d in (workdir, home))
    )


async def test_output_goes_to_the_home_directory_without_workdir(
    client: SlurmClient, slurm_host: LocalHost
) -> None:
    """Without workdir the job runs in the account's home and its output path is relative."""
    job = await client.submit(SH + "pwd\n", BatchOptions())
    try:
        assert not job.stdout_path.startswith("/")
        assert (await _wait_state(client, job.job_id, "succeeded", 20)).state == "succeeded"
        out = await client.read_output(job.stdout_path)
        assert out.data.decode() == slurm_host.account.home + "\n"
    finally:
        slurm_host.run_local(["rm", "-f", job.stdout_path, job.stderr_path])


async def test_states_of_an_unknown_job_is_lost(client: SlurmClient) -> None:
    """A job id slurmctld does not know (purged or never existed) is lost, not an error."""
    status = (await client.states(["987654"]))["987654"]
    assert (status.state, status.scheduler_state) == ("lost", None)


# --------------------------------------------------------------------------------------------
# Cancel


async def test_cancel_while_pending(client: SlurmClient, opts: Callable[..., BatchOptions]) -> None:
    """scancel of a pending job: cancelled, and it never ran (no output file)."""
    blocker = await client.submit(SH + "sleep 30\n", opts(ntasks=BIG))
    job = await client.submit(SH + "echo ran\n", opts(ntasks=BIG))
    try:
        assert (await client.states([job.job_id]))[job.job_id].state == "queued"
        await client.cancel(job.job_id)
        status = await _wait_state(client, job.job_id, "cancelled", 10)
    finally:
        await client.cancel(blocker.job_id)
    assert (status.state, status.scheduler_state) == ("cancelled", "CANCELLED")
    assert (await client.read_output(job.stdout_path)).size is None


async def test_cancel_while_running_kills_the_script(
    client: SlurmClient, slurm_host: LocalHost, opts: Callable[..., BatchOptions]
) -> None:
    """scancel of a running job: cancelled, and its processes are gone."""
    marker = f"sleep 3{time.monotonic_ns() % 100000}"
    job = await client.submit(SH + f"echo started; {marker}\n", opts())
    assert (await _wait_state(client, job.job_id, "running", 10)).state == "running"
    assert await _eventually(lambda: bool(slurm_host.processes(marker)), 10)
    await client.cancel(job.job_id)
    status = await _wait_state(client, job.job_id, "cancelled", 15)
    assert (status.state, status.scheduler_state) == ("cancelled", "CANCELLED")
    assert await _eventually(lambda: not slurm_host.processes(marker), 10)


# --------------------------------------------------------------------------------------------
# Tracking many jobs


async def test_hundred_jobs_cost_at_most_two_ssh_commands_per_poll(
    client: SlurmClient, opts: Callable[..., BatchOptions]
) -> None:
    """100 tracked jobs: every poll is one squeue, plus one scontrol batch when some end."""
    t0 = time.monotonic()
    jobs = await asyncio.gather(
        *(client.submit(SH + f"echo {i}\n", opts(name=f"many{i}")) for i in range(100))
    )
    print(f"100 submissions took {time.monotonic() - t0:.1f} s")
    tracker = Tracker(client, interval=0.2)
    for job in jobs:
        tracker.track(job.job_id)
    finals: dict[str, JobStatus] = {}
    per_poll: list[int] = []
    deadline = time.monotonic() + 45
    while tracker.tracked and time.monotonic() < deadline:
        before = client.commands
        changed = await tracker.poll()
        per_poll.append(client.commands - before)
        finals.update((s.job_id, s) for s in changed if s.final)
        await asyncio.sleep(0.2)
    print(f"{len(per_poll)} polls, SSH commands per poll: {per_poll}")
    assert len(finals) == 100, f"{len(finals)} of 100 final after {len(per_poll)} polls"
    assert {s.state for s in finals.values()} == {"succeeded"}
    assert max(per_poll) <= 2, per_poll
    assert tracker.commands == sum(per_poll)
    out = await client.read_output(jobs[42].stdout_path)
    assert out.data == b"42\n"


async def test_tracker_backs_off_while_nothing_changes(
    client: SlurmClient, opts: Callable[..., BatchOptions]
) -> None:
    """The poll interval doubles while a job stays the same and resets when it changes."""
    job = await client.submit(SH + "sleep 30\n", opts())
    await _wait_state(client, job.job_id, "running", 10)
    tracker = Tracker(client, interval=0.1, max_interval=0.4)
    tracker.track(job.job_id)
    try:
        assert [s.state for s in await tracker.poll()] == ["running"]
        assert tracker.interval == 0.1
        assert await tracker.poll() == [] and tracker.interval == 0.2
        assert await tracker.poll() == [] and tracker.interval == 0.4
        assert await tracker.poll() == [] and tracker.interval == 0.4
    finally:
        await client.cancel(job.job_id)
    await _wait_state(client, job.job_id, "cancelled", 10)
    assert [s.state for s in await tracker.poll()] == ["cancelled"]
    assert tracker.interval == 0.1 and tracker.tracked == []


# --------------------------------------------------------------------------------------------
# No duplicates


async def test_retried_submission_with_the_same_key_adopts_the_job(
    client: SlurmClient, slurm_host: LocalHost, opts: Callable[..., BatchOptions]
) -> None:
    """A request retried with the same key (by a fresh client: the API restarted) makes no
    second Slurm job."""
    key = f"retry-{time.monotonic_ns()}"
    first = await client.submit(SH + "sleep 5\n", opts(), key)
    async with Pool() as pool:
        again = await SlurmClient(pool, slurm_host.target()).submit(SH + "sleep 5\n", opts(), key)
    try:
        assert (first.adopted, again.adopted, again.job_id) == (False, True, first.job_id)
        assert await _jobs_with_key(client, key) == [first.job_id]
    finally:
        await client.cancel(first.job_id)


class _LoseAfterSbatch(SlurmClient):
    """The connection drops right after sbatch: ``run_first`` says whether it still ran."""

    def __init__(self, pool: Pool, client: SlurmClient, *, run_first: bool) -> None:
        super().__init__(pool, client.target, settle=1.0)
        self.run_first = run_first
        self.lost = 0

    async def _run(
        self,
        argv: str | Sequence[str],
        *,
        stdin: bytes | None = None,
        max_output: int = 1 << 20,
        starts: bool = False,
    ) -> CommandResult:
        is_sbatch = not isinstance(argv, str) and "sbatch" in argv
        if is_sbatch and self.lost == 0:
            self.lost += 1
            if self.run_first:
                await super()._run(argv, stdin=stdin, max_output=max_output, starts=starts)
            raise ConnectionLost("connection dropped after sbatch started", started=True)
        return await super()._run(argv, stdin=stdin, max_output=max_output, starts=starts)


async def test_unknown_outcome_after_sbatch_ran_adopts_the_job(
    client: SlurmClient, opts: Callable[..., BatchOptions]
) -> None:
    """sbatch ran but the answer was lost: the key lookup finds the job; exactly one exists."""
    key = f"lost-{time.monotonic_ns()}"
    lossy = _LoseAfterSbatch(client.pool, client, run_first=True)
    submitted = await lossy.submit(SH + "sleep 5\n", opts(), key)
    try:
        assert submitted.adopted and lossy.lost == 1
        assert await _jobs_with_key(client, key) == [submitted.job_id]
    finally:
        await client.cancel(submitted.job_id)


async def test_unknown_outcome_without_a_job_submits_once_more(
    client: SlurmClient, opts: Callable[..., BatchOptions]
) -> None:
    """sbatch never got through: after the lookup finds nothing, it is run again, once."""
    key = f"never-{time.monotonic_ns()}"
    lossy = _LoseAfterSbatch(client.pool, client, run_first=False)
    submitted = await lossy.submit(SH + "sleep 5\n", opts(), key)
    try:
        assert not submitted.adopted and lossy.lost == 1
        assert await _jobs_with_key(client, key) == [submitted.job_id]
    finally:
        await client.cancel(submitted.job_id)


# --------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize(
    "options",
    [
        {"nodes": -1},
        {"ntasks": 0},
        {"name": "x; rm -rf ~"},
        {"name": "$(id)"},
        {"partition": "debug`id`"},
        {"workdir": "relative/dir"},
        {"env": {"BAD NAME": "1"}},
        {"env": {"SBATCH_PARTITION": "batch"}},
        {"time_limit": 0},
        {"mem": "1G"},
    ],
    ids=lambda o: next(iter(o)),
)
def test_bad_options_are_refused_by_validation(options: dict[str, object]) -> None:
    """Invalid options never become an sbatch argument: a validation error names them."""
    with pytest.raises(ValidationError):
        BatchOptions.model_validate(options)


async def test_unknown_partition_is_the_schedulers_error_and_nothing_is_submitted(
    client: SlurmClient, opts: Callable[..., BatchOptions]
) -> None:
    """sbatch's own refusal surfaces as SubmitRejected with its message; no job exists."""
    before = await _job_count(client)
    with pytest.raises(SubmitRejected, match="invalid partition"):
        await client.submit(SH + "true\n", opts(partition="nosuchpartition"))
    assert await _job_count(client) == before


async def test_script_without_interpreter_line_is_refused_before_ssh(
    client: SlurmClient, opts: Callable[..., BatchOptions]
) -> None:
    """A script sbatch would refuse is refused here without running any command."""
    with pytest.raises(ValueError, match="#!"):
        await client.submit("echo no shebang\n", opts())
    assert client.commands == 0


# --------------------------------------------------------------------------------------------
# Time limit (last: its job has been running since the module started)


async def test_timed_out_waits_leave_no_waiter_behind(
    client: SlurmClient, opts: Callable[..., BatchOptions]
) -> None:
    """5,000 waits on a running job that time out (what idempotent replays with `Prefer: wait`
    do) leave no waiter in the tracker; a wait that gets its answer leaves none either."""
    job = await client.submit(SH + "sleep 30\n", opts())
    await _wait_state(client, job.job_id, "running", 10)
    tracker = Tracker(client, interval=0.1)
    for _ in range(5000):
        with contextlib.suppress(TimeoutError):
            await tracker.wait(job.job_id, 0)
    left = tracker.waiting
    print(f"FIGURE waiters left after 5,000 timed-out waits: {left}")
    runner = asyncio.create_task(tracker.run())
    try:
        waiting = asyncio.create_task(tracker.wait(job.job_id, 20))
        await client.cancel(job.job_id)
        assert (await waiting).state == "cancelled"
    finally:
        runner.cancel()
    assert left == 0
    assert tracker.waiting == 0
