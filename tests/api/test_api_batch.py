"""Batch jobs through the HTTP API against the real Slurm of tests/conftest.py (`slurm`).

One `sshapi serve` process for the module, its host `local` being the Slurm login host. Slurm
enforces time limits in whole minutes, checked every 30 s: the over-time job is submitted when
the module starts and checked by its last test.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from api_helpers import Api, Keys, config_toml, eventually, make_settings, server_process

from api.config import load_config
from api.scheduler import BatchOptions, key_comment
from api.settings import Settings
from sshpool import Pool
from sshpool.devhost import LocalHost, LocalSlurm

pytestmark = pytest.mark.timeout(120)

SH = "#!/bin/sh\n"
BIG = 9  # CPUs: two of these never run at once on the 16-CPU node
SCHEDULER = """
[hosts.local.scheduler]
poll_interval = 0.3
max_poll_interval = 2.0
settle = 1.0
"""


# Batch jobs count against max_concurrent until final: the hundred-jobs test's subject may
# have them all active at once.
BULK = """[[policy]]
issuer = "*"
subject = "bulk"
hosts = ["local"]
shell_hosts = ["local"]
rate = 1000
burst = 1000
max_concurrent = 128

"""


def write_config(path: Path, host: LocalHost, secret_file: Path, keys: Keys) -> Path:
    text = config_toml(host, secret_file, keys, SCHEDULER)
    catch_all = '[[policy]]\nsubject = "*"'
    assert catch_all in text
    path.write_text(text.replace(catch_all, BULK + catch_all))
    return path


@pytest.fixture(scope="module")
def server(
    slurm_host: LocalHost,
    secret_file: Path,
    keys: Keys,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, Settings]]:
    folder = tmp_path_factory.mktemp("batch-api")
    config = write_config(folder / "sshapi.toml", slurm_host, secret_file, keys)
    settings = make_settings(folder, config, "sqlite", None)
    with server_process(settings) as (_, url):
        yield url, settings


@pytest.fixture
async def api(server: tuple[str, Settings], secret: str, keys: Keys) -> AsyncIterator[Api]:
    url, settings = server
    assert settings.config is not None
    async with httpx.AsyncClient(timeout=60) as client:
        yield Api(url, client, secret, load_config(settings.config), settings, keys)


def batch(workdir: str, script: str, **options: Any) -> dict[str, Any]:
    return {"host": "local", "batch": {"script": SH + script, "workdir": workdir, **options}}


@pytest.fixture(scope="module", autouse=True)
def overtime_job(server: tuple[str, Settings], secret: str, keys: Keys, workdir: str) -> str:
    """A job past its one-minute limit, submitted first so Slurm's clock runs meanwhile."""

    async def submit() -> str:
        async with httpx.AsyncClient(timeout=60) as client:
            url, settings = server
            assert settings.config is not None
            api = Api(url, client, secret, load_config(settings.config), settings, keys)
            r = await api.submit(batch(workdir, "sleep 300\n", time_limit=60))
            assert r.status_code == 202, r.text
            return str(r.json()["id"])

    return asyncio.run(submit())


async def slurm_jobs(host: LocalHost, comment: str | None = None) -> list[str]:
    """Ids of the account's jobs in any state (with that --comment, if given)."""
    async with Pool() as pool:
        result = await pool.run(
            host.target(), ["squeue", "--me", "--states=all", "--noheader", "--format=%i|%k"]
        )
    lines = result.stdout.decode().splitlines()
    return [ln.split("|")[0] for ln in lines if comment is None or ln.endswith("|" + comment)]


async def output(api: Api, job_id: str, **params: Any) -> httpx.Response:
    return await api.client.get(
        f"{api.url}/v1/jobs/{job_id}/output", params=params, headers=api.auth()
    )


async def test_batch_job_completes_and_its_output_reads_back_in_ranges(
    api: Api, workdir: str
) -> None:
    script = 'for i in $(seq 1 200); do echo "line $i"; done; echo oops >&2\n'
    r = await api.submit(batch(workdir, script, name="lines", ntasks=1))
    assert r.status_code == 202, r.text
    job = r.json()
    # Answered once Slurm took it: its id is there; no command timeout for a batch job.
    assert job["kind"] == "batch" and job["timeout"] is None
    assert re.fullmatch(r"\d+", job["scheduler"]["job_id"])
    assert job["batch"]["name"] == "lines" and "script" not in job["batch"]
    done = await api.until_final(job["id"], timeout=30)
    assert (done["state"], done["exit_status"]) == ("succeeded", 0)
    assert done["scheduler"]["state"] == "COMPLETED"
    assert done["started_at"] is not None and done["finished_at"] is not None

    expected = "".join(f"line {i}\n" for i in range(1, 201)).encode()
    whole = await output(api, job["id"])
    assert whole.status_code == 200 and whole.content == expected
    assert whole.headers["X-Output-Size"] == str(len(expected))
    part = await output(api, job["id"], offset=7, limit=20)
    assert part.content == expected[7:27]
    assert part.headers["X-Output-Next-Offset"] == "27"
    beyond = await output(api, job["id"], offset=len(expected))
    assert beyond.status_code == 200 and beyond.content == b""
    err = await output(api, job["id"], stream="stderr")
    assert err.content == b"oops\n"


async def test_failing_script_is_failed_with_its_exit_code(api: Api, workdir: str) -> None:
    r = await api.submit(batch(workdir, "exit 3\n"), wait=30)
    job = r.json()
    assert r.status_code == 201, r.text  # Prefer: wait waits for the end of a batch job too
    assert (job["state"], job["exit_status"], job["scheduler"]["state"]) == ("failed", 3, "FAILED")


async def test_pending_job_runs_when_cpus_free_and_cancel_works_pending_and_running(
    api: Api, workdir: str, slurm_host: LocalHost
) -> None:
    marker = f"{time.time_ns() % 10**6 + 7_000_000}"
    big = {"ntasks": BIG}
    running = (await api.submit(batch(workdir, f"sleep {marker}\n", **big))).json()
    await api.wait_state(running["id"], ("running",), timeout=30)
    doomed = (await api.submit(batch(workdir, "sleep 1\n", **big))).json()
    waiting = (await api.submit(batch(workdir, "sleep 2; echo ran\n", **big))).json()
    async with asyncio.timeout(10):
        while (pending := await api.job(waiting["id"]))["scheduler"]["state"] != "PENDING":  # noqa: ASYNC110
            await asyncio.sleep(0.1)
    assert pending["state"] == "queued" and pending["scheduler"]["reason"]
    # No output file before the job starts: 404 with Retry-After, not an empty 200.
    early = await output(api, doomed["id"])
    assert early.status_code == 404 and early.headers["Retry-After"]

    headers = api.auth()
    r = await api.client.delete(f"{api.url}/v1/jobs/{doomed['id']}", headers=headers)
    assert r.status_code == 200, r.text
    assert (r.json()["state"], r.json()["scheduler"]["state"]) == ("cancelled", "CANCELLED")

    r = await api.client.delete(f"{api.url}/v1/jobs/{running['id']}", headers=headers)
    assert r.status_code == 200, r.text
    assert r.json()["state"] == "cancelled"
    await eventually(lambda: not slurm_host.processes(f"sleep {marker}"), timeout=15)
    again = await api.client.delete(f"{api.url}/v1/jobs/{running['id']}", headers=headers)
    assert again.status_code == 409

    # The CPUs freed, the waiting job goes pending -> running -> completed.
    seen = {pending["scheduler"]["state"]}
    async with asyncio.timeout(30):
        while (job := await api.job(waiting["id"]))["state"] not in ("succeeded", "failed"):
            seen.add(job["scheduler"]["state"])
            await asyncio.sleep(0.1)
    assert {"PENDING", "RUNNING"} <= seen
    assert job["state"] == "succeeded"
    assert (await output(api, waiting["id"])).content == b"ran\n"


@pytest.mark.parametrize(
    ("options", "where"),
    [
        ({"nodes": -1}, "nodes"),
        ({"ntasks": 0}, "ntasks"),
        ({"name": "x; rm -rf ~"}, "name"),
        ({"partition": "debug`id`"}, "partition"),
        ({"workdir": "relative"}, "workdir"),
        ({"env": {"SBATCH_PARTITION": "batch"}}, "env"),
        ({"mem": "1G"}, "mem"),
        ({"script": "echo no interpreter line\n"}, "script"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
async def test_bad_options_are_422_and_nothing_is_submitted(
    api: Api, workdir: str, slurm_host: LocalHost, options: dict[str, Any], where: str
) -> None:
    before = await slurm_jobs(slurm_host)
    body = batch(workdir, "true\n")
    body["batch"].update(options)
    r = await api.submit(body)
    assert r.status_code == 422, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    assert where in str(r.json()["errors"][0]["loc"])
    assert await slurm_jobs(slurm_host) == before


async def test_batch_with_a_command_timeout_or_on_a_host_without_scheduler_is_422(
    api: Api, workdir: str
) -> None:
    r = await api.submit({**batch(workdir, "true\n"), "timeout": 5})
    assert r.status_code == 422 and "time_limit" in r.text
    r = await api.submit({**batch(workdir, "true\n"), "host": "tiny"})
    assert r.status_code == 422 and r.json()["type"].endswith(":no-scheduler")


async def test_unknown_partition_is_the_schedulers_own_error_and_nothing_is_submitted(
    api: Api, workdir: str, slurm_host: LocalHost
) -> None:
    before = await slurm_jobs(slurm_host)
    r = await api.submit(batch(workdir, "true\n", partition="nosuchpartition"))
    assert r.status_code == 422, r.text
    problem = r.json()
    assert problem["type"].endswith(":batch-rejected")
    assert "invalid partition" in problem["detail"].lower()
    assert (await api.job(problem["job_id"]))["state"] == "error"
    assert await slurm_jobs(slurm_host) == before


async def test_hundred_jobs_are_tracked_with_a_handful_of_ssh_commands_per_poll(
    api: Api, workdir: str
) -> None:
    def counters(text: str) -> tuple[float, float]:
        found = dict(
            re.findall(r'^(sshapi_scheduler_poll\w*)_total\{host="local"\} (\S+)$', text, re.M)
        )
        return float(found["sshapi_scheduler_polls"]), float(
            found["sshapi_scheduler_poll_commands"]
        )

    polls0, commands0 = counters((await api.client.get(f"{api.url}/metrics")).text)
    limit = asyncio.Semaphore(16)

    async def one(i: int) -> str:
        async with limit:
            body = batch(workdir, f"sleep 1; echo {i}\n")
            r = await api.submit(body, key=f"many-{i}", sub="bulk")
            assert r.status_code == 202, r.text
            return str(r.json()["id"])

    ids = await asyncio.gather(*(one(i) for i in range(100)))
    async with asyncio.timeout(90):
        for job_id in ids:
            done = await api.until_final(job_id, sub="bulk", timeout=90)
            assert done["state"] == "succeeded"
    polls, commands = counters((await api.client.get(f"{api.url}/metrics")).text)
    per_poll = (commands - commands0) / (polls - polls0)
    print(f"100 jobs: {polls - polls0:.0f} polls, {commands - commands0:.0f} SSH commands")
    assert per_poll <= 2.0  # one squeue for all, one scontrol for those just ended


async def test_command_jobs_have_their_stored_output_in_ranges_too(api: Api) -> None:
    r = await api.submit({"host": "local", "argv": ["printf", "0123456789"]})
    job_id = r.json()["id"]
    part = await output(api, job_id, offset=3, limit=4)
    assert (part.status_code, part.content) == (200, b"3456")
    assert part.headers["X-Output-Size"] == "10"


async def test_api_killed_after_sbatch_and_retried_with_the_same_key_makes_one_slurm_job(
    slurm: LocalSlurm,
    make_host: Any,
    secret_file: Path,
    secret: str,
    keys: Keys,
    tmp_path_factory: pytest.TempPathFactory,
    workdir: str,
) -> None:
    """sbatch runs, then the API dies before it hears the job id (the host's sbatch lingers
    10 s after submitting). The client retries with its Idempotency-Key against the restarted
    API: the same job answers, adopted from Slurm by its key; exactly one Slurm job exists."""
    bin_dir = tmp_path_factory.mktemp("slow-sbatch")
    bin_dir.chmod(0o755)
    wrapper = bin_dir / "sbatch"
    wrapper.write_text('#!/bin/sh\n/usr/bin/sbatch "$@"; status=$?; sleep 10; exit $status\n')
    wrapper.chmod(0o755)
    env = slurm.sshd_overrides()["SetEnv"]
    host = make_host("tuned", overrides={"SetEnv": f"{env} PATH={bin_dir}:/usr/bin:/bin"})
    folder = tmp_path_factory.mktemp("kill-api")
    settings = make_settings(
        folder, write_config(folder / "c.toml", host, secret_file, keys), "sqlite", None
    )
    body = batch(workdir, "echo once\n")
    async with httpx.AsyncClient(timeout=60) as client:
        with server_process(settings) as (proc, url):
            first = Api(url, client, secret, load_config(settings.config), settings, keys)
            r = await first.submit(body, key="kill-me", wait=0)
            assert r.status_code == 202 and r.json()["scheduler"]["job_id"] is None
            job_id = r.json()["id"]
            comment = key_comment(job_id)
            async with asyncio.timeout(20):
                while not await slurm_jobs(host, comment):  # noqa: ASYNC110 (polls Slurm)
                    await asyncio.sleep(0.2)
            proc.send_signal(signal.SIGKILL)
        with server_process(settings) as (_, url):
            second = Api(url, client, secret, load_config(settings.config), settings, keys)
            retry = await second.submit(body, key="kill-me", wait=0)
            assert retry.json()["id"] == job_id
            assert retry.headers["Idempotent-Replayed"] == "true"
            done = await second.until_final(job_id, timeout=30)
            assert done["state"] == "succeeded"
            assert (await output(second, job_id)).content == b"once\n"
    assert await slurm_jobs(host, comment) == [done["scheduler"]["job_id"]]


async def test_time_limit_exceeded_is_timed_out(api: Api, overtime_job: str) -> None:
    """Last in the module: Slurm ends the one-minute job 60-90 s after it started."""
    job = await api.until_final(overtime_job, timeout=110)
    assert (job["state"], job["scheduler"]["state"]) == ("timed_out", "TIMEOUT")
    assert job["exit_signal"] == "TERM" and "time limit" in job["error"]


async def test_an_unreadable_output_file_is_a_502_not_empty_bytes(
    api: Api, workdir: str, slurm_host: LocalHost
) -> None:
    r = await api.submit(batch(workdir, "echo secret\n"), wait=30)
    job = r.json()
    assert job["state"] == "succeeded", r.text
    options = BatchOptions(workdir=workdir)
    path = options.output_path(job["scheduler"]["job_id"], job["id"], "stdout")
    os.chmod(path, 0)
    answer = await output(api, job["id"])
    assert answer.status_code == 502
    assert answer.json()["type"].endswith(":scheduler-error")
