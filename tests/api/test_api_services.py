"""The supervisor of the background tasks (api/services.py, api/tasks.py), as a user sees it: a
batch tracker that dies is started again and its jobs still end; one that keeps dying takes
the process down (exit status 70) instead of leaving a replica whose batch jobs never end.

The death is a failed write of a job's new state (a store that errs): the tracker's poll gives
up on anything but SSH and scheduler errors, and before the supervisor its task was lost."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from api_helpers import (
    Api,
    Keys,
    make_settings,
    running_api,
    server_process,
    write_batch_config,
)

from api.config import load_config
from api.jobs import BatchJobs
from api.jobs.scheduler import JobStatus
from api.workers import TASK_DIED
from sshpool.devhost import LocalHost

pytestmark = pytest.mark.timeout(90)

SH = "#!/bin/sh\n"


def batch(workdir: str, script: str) -> dict[str, Any]:
    return {"host": "local", "batch": {"script": SH + script, "workdir": workdir}}


async def test_a_tracker_that_dies_is_restarted_and_its_job_ends(
    slurm_host: LocalHost,
    secret_file: Path,
    secret: str,
    keys: Keys,
    workdir: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    record = BatchJobs._record
    failed: list[str] = []

    async def fails_once(self: BatchJobs, host: str, status: JobStatus) -> None:
        if not failed:
            failed.append(status.job_id)
            raise OSError("the store did not answer")
        await record(self, host, status)

    monkeypatch.setattr(BatchJobs, "_record", fails_once)
    config = write_batch_config(tmp_path / "sshapi.toml", slurm_host, secret_file, keys)
    settings = make_settings(tmp_path, config, "sqlite", None)
    async with running_api(settings, keys, secret) as api:
        r = await api.submit(batch(workdir, "echo restarted\n"))
        assert r.status_code in (201, 202), r.text
        job = await api.until_final(r.json()["id"], timeout=60)
        assert job["state"] == "succeeded", job
        assert failed, "the tracker never failed: the test tested nothing"
        r = await api.client.get(f"{api.url}/readyz")
        assert r.status_code == 200, r.text


BROKEN_SERVE = textwrap.dedent(
    """
    from api.jobs import BatchJobs
    from api.settings import Settings
    from api.workers import serve

    async def broken(self, host, status):
        raise OSError("the store did not answer")

    BatchJobs._record = broken
    serve(Settings())
    """
)


async def test_a_tracker_that_keeps_dying_takes_the_process_down(
    slurm_host: LocalHost, secret_file: Path, secret: str, keys: Keys, workdir: str, tmp_path: Path
) -> None:
    """Every write of a batch job's state fails: the tracker dies three times within a minute,
    and `sshapi serve` stops and exits 70 (its supervisor starts it again), where it served
    on with batch jobs that never end."""
    config_file = write_batch_config(tmp_path / "sshapi.toml", slurm_host, secret_file, keys)
    settings = make_settings(tmp_path, config_file, "sqlite", None)
    wrapper = (sys.executable, "-c", BROKEN_SERVE)
    with server_process(settings, wrapper=wrapper) as (proc, url):
        async with httpx.AsyncClient(timeout=30) as client:
            api = Api(url, client, secret, load_config(config_file), settings, keys)
            r = await api.submit(batch(workdir, "true\n"))
            assert r.status_code in (201, 202), r.text
        started = time.monotonic()
        try:
            status = await asyncio.to_thread(proc.wait, 60)
        except subprocess.TimeoutExpired:
            pytest.fail("the process served on after its tracker kept dying")
        assert status == TASK_DIED
        # Three deaths with pauses of 0.5 and 1 s between them, then the grace of 0.5 s.
        print(f"exited {time.monotonic() - started:.1f} s after the submission")
