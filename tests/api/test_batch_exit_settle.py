"""A job that ran past its time limit is reported with the signal that ended it, even when
slurmctld answers TIMEOUT before slurmstepd's report of the script's end reached it (a loaded
whole-suite run read ``ExitCode=0:0`` at that moment and the API said exit_signal null). The
tracker holds such a status back (``EXIT_SETTLE``) until the code lands or the time is up.

The real TIMEOUT through the API comes first (its job submitted when tests/api/test_api_batch.py
starts: Slurm ends it 60-90 s later, long before this module runs in a whole run); then the
scheduler's answers scripted: the race is not one a test can provoke on demand."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable

import pytest
from api_helpers import Api

from api.jobs import scheduler
from api.jobs.scheduler import JobStatus, SlurmClient, Tracker
from sshpool import Limits, Pool, Target
from sshpool.devhost import FakeBackend

TERM = 15
pytestmark = pytest.mark.timeout(120)


async def test_time_limit_exceeded_is_timed_out(batch_api: Api, overtime_job: str) -> None:
    """A `sleep 300` with a one-minute limit: `timed_out` (Slurm's TIMEOUT), with the time
    limit named, and ended by TERM as far as Slurm has said: its report of the signal may come
    after the tracker's `EXIT_SETTLE` on a loaded box (then none is given; the holding back is
    proven with a scripted Slurm below), never another signal."""
    job = await batch_api.until_final(overtime_job, timeout=110)
    assert (job["state"], job["scheduler"]["state"]) == ("timed_out", "TIMEOUT")
    assert job["exit_signal"] in ("TERM", None) and "time limit" in job["error"]


class _Answers(SlurmClient):
    """A client whose states() answers, poll after poll, the exit statuses given (code, signal)
    for job 7 in state TIMEOUT; the last one repeats."""

    def __init__(self, pool: Pool, exits: list[tuple[int, int | None]]) -> None:
        target = Target("fake", "user", ("key",), "known_hosts", limits=Limits())  # type: ignore[arg-type]
        super().__init__(pool, target)
        self.exits = exits
        self.reads = 0

    async def states(self, job_ids: Iterable[str]) -> dict[str, JobStatus]:
        code, sig = self.exits[min(self.reads, len(self.exits) - 1)]
        self.reads += 1
        return {"7": JobStatus("7", "timed_out", "TIMEOUT", "TimeLimit", code, sig)}


async def test_a_timeout_read_before_its_exit_code_is_reported_with_the_signal() -> None:
    """Two polls read TIMEOUT with 0:0, the third 0:15: nothing is reported final before the
    signal is known, the polls stay at the shortest interval meanwhile, and the job is
    reported once, with TERM."""
    async with Pool(FakeBackend()) as pool:
        client = _Answers(pool, [(0, None), (0, None), (0, TERM)])
        tracker = Tracker(client, interval=0.1, max_interval=5.0)
        tracker.track("7")
        reported = []
        for _ in range(4):
            reported += await tracker.poll()
            assert tracker.interval == 0.1 or tracker.tracked == []
    assert [(s.state, s.signal) for s in reported] == [("timed_out", TERM)]
    assert client.reads == 3 and tracker.tracked == []


async def test_a_timeout_that_stays_zero_is_reported_after_the_settle_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A script that caught TERM and exited 0 reads 0:0 for good: reported as it is, once
    EXIT_SETTLE has passed (not held forever)."""
    monkeypatch.setattr(scheduler, "EXIT_SETTLE", 0.3)
    async with Pool(FakeBackend()) as pool:
        tracker = Tracker(_Answers(pool, [(0, None)]), interval=0.1)
        polling = asyncio.create_task(tracker.run())
        t0 = time.perf_counter()
        try:
            status = await tracker.wait("7", timeout=5)
        finally:
            polling.cancel()
        waited = time.perf_counter() - t0
    assert 0.3 <= waited < 5, waited
    assert (status.state, status.exit_code, status.signal) == ("timed_out", 0, None)
