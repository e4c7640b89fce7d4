"""Batch jobs through the HTTP API against the real Slurm of tests/conftest.py (`slurm`).

One `sshapi serve` process for the session (conftest.py `batch_server`), its host `local` being
the Slurm login host. Slurm enforces time limits in whole minutes, checked every 30 s: the
over-time job is submitted when the module starts and checked by a late test.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from api_helpers import (
    SSHAPI,
    Api,
    Keys,
    eventually,
    make_settings,
    server_process,
    write_batch_config,
)
from faults import figure

from api.batchspec import BatchOptions
from api.config import load_config
from api.jobs.scheduler import key_comment
from sshpool import Pool
from sshpool.devhost import LocalHost, LocalSlurm

pytestmark = pytest.mark.timeout(120)

SH = "#!/bin/sh\n"
BIG = 9  # CPUs: two of these never run at once on the 16-CPU node


@pytest.fixture
def api(batch_api: Api) -> Api:
    """This module's API: the session's `sshapi serve` in front of Slurm (conftest.py)."""
    return batch_api


def batch(workdir: str, script: str, **options: Any) -> dict[str, Any]:
    return {"host": "local", "batch": {"script": SH + script, "workdir": workdir, **options}}


@pytest.fixture(scope="module", autouse=True)
def _slurm_clock(overtime_job: str) -> None:
    """The job past its time limit is submitted before this module's tests: Slurm's clock runs
    while they do, and tests/api/test_batch_exit_settle.py, minutes later in a whole run,
    finds it ended without waiting (alone it waits the 60-90 s)."""


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


async def test_sshapi_batch_submit_wait_prints_the_output_and_exits_with_the_status(
    api: Api, tmp_path: Path
) -> None:
    script = tmp_path / "job.sh"
    script.write_text(SH + "echo to-stdout; echo to-stderr >&2; exit 3\n")
    env = {**os.environ, "SSHAPI_URL": api.url, "SSHAPI_TOKEN": api.token("alice"),
           "SSHAPI_CLIENT_CONFIG": "/nonexistent"}  # fmt: skip
    proc = await asyncio.create_subprocess_exec(
        SSHAPI, "batch", "submit", "local", str(script), "--wait", env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 90)
    assert (proc.returncode, out) == (3, b"to-stdout\n"), err
    assert err.startswith(b"to-stderr\n") and b"failed" in err, err


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
        folder, write_batch_config(folder / "c.toml", host, secret_file, keys), "sqlite", None
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


async def test_batch_output_is_followed_live_by_several_clients(api: Api, workdir: str) -> None:
    """Two followers of a running batch job see its first line before it ends and the whole
    output by the end; the follow ends once the scheduler reports the job final."""
    script = "echo tick1; sleep 3; echo tick2\n"
    r = await api.submit(batch(workdir, script))
    job_id = r.json()["id"]
    url = f"{api.url}/v1/jobs/{job_id}/output?follow=true"

    async def follower() -> tuple[bytes, str]:
        got = b""
        state_at_first = ""
        async with api.client.stream("GET", url, headers=api.auth()) as body:
            assert body.status_code == 200
            async for chunk in body.aiter_bytes():
                if not got:
                    state_at_first = (await api.job(job_id))["state"]
                got += chunk
        return got, state_at_first

    results = await asyncio.wait_for(asyncio.gather(follower(), follower()), 60)
    for got, state_at_first in results:
        assert got == b"tick1\ntick2\n"
        assert state_at_first in ("queued", "running")  # the first line came while it ran
    assert (await api.job(job_id))["state"] == "succeeded"


# ---- issue 15 item 4: SSH-backed reads and cancels are bounded (figures: RELIABILITY.md)


def server_pid(api: Api) -> int:
    """The pid of the `sshapi serve` process listening at api.url."""
    port = int(api.url.rsplit(":", 1)[1])
    for conn in psutil.net_connections("tcp"):
        if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN:
            assert conn.pid is not None
            return conn.pid
    raise AssertionError("no process listens there")


async def ssh_commands(api: Api) -> float:
    """SSH commands the server's pools ran so far (sshpool_commands over all targets)."""
    text = (await api.client.get(f"{api.url}/metrics")).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("sshpool_commands_total{")
    )


async def test_output_reads_and_cancels_take_tokens_from_a_bucket_per_identity(
    api: Api, workdir: str
) -> None:
    """`slow` (rate 0.2/s, burst 2): of 12 output reads and DELETEs in a row, 2 are served and
    the rest are 429 with Retry-After, as each would run SSH commands."""
    r = await api.submit(batch(workdir, "echo hi\n"), sub="slow", wait=30)
    job_id = r.json()["id"]
    headers = api.auth("slow")
    statuses = []
    for n in range(12):
        if n % 2:
            answer = await api.client.delete(f"{api.url}/v1/jobs/{job_id}", headers=headers)
        else:
            answer = await api.client.get(f"{api.url}/v1/jobs/{job_id}/output", headers=headers)
        statuses.append(answer.status_code)
        if answer.status_code == 429:
            assert int(answer.headers["Retry-After"]) >= 1
    figure("12 output reads/DELETEs by a rate-0.2 burst-2 identity: statuses", statuses)
    assert statuses.count(429) >= 9


async def test_thirty_concurrent_16_mib_output_reads_keep_the_api_small(
    api: Api, workdir: str
) -> None:
    """A batch job wrote 16 MiB; 30 reads of all of it at once each get the 16 MiB while the
    API's RSS grows by far less than the 480 MiB they carry (the output is streamed)."""
    size = 16 << 20
    r = await api.submit(batch(workdir, f"head -c {size} /dev/zero\n"), wait=60)
    assert r.json()["state"] == "succeeded", r.text
    proc = psutil.Process(server_pid(api))
    before = proc.memory_info().rss
    peak = before
    done = asyncio.Event()

    async def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, proc.memory_info().rss)
            await asyncio.sleep(0.02)

    async def read() -> int:
        n = 0
        async with api.client.stream(
            "GET",
            f"{api.url}/v1/jobs/{r.json()['id']}/output",
            params={"limit": size},
            headers=api.auth(),
        ) as answer:
            assert answer.status_code == 200
            async for chunk in answer.aiter_bytes():
                n += len(chunk)
        return n

    sampler = asyncio.create_task(sample())
    t0 = time.perf_counter()
    sizes = await asyncio.gather(*(read() for _ in range(30)))
    seconds = time.perf_counter() - t0
    done.set()
    await sampler
    grew = (peak - before) / 2**20
    figure("30 concurrent 16 MiB output reads: API RSS before / peak (MB), seconds",
           (round(before / 2**20), round(peak / 2**20), round(seconds, 1)))  # fmt: skip
    assert sizes == [size] * 30
    assert grew < 200


async def test_twenty_concurrent_cancels_of_one_batch_job_run_one_cancel(
    api: Api, workdir: str
) -> None:
    """20 DELETEs of one running batch job at once: all answer the same `cancelled` job, and
    the SSH commands they cost are those of one cancel (states, scancel, a few polls)."""
    marker = f"{time.time_ns() % 10**6 + 8_000_000}"
    job = (await api.submit(batch(workdir, f"sleep {marker}\n"))).json()
    await api.wait_state(job["id"], ("running",), timeout=30)
    before = await ssh_commands(api)
    headers = api.auth()
    answers = await asyncio.gather(
        *(api.client.delete(f"{api.url}/v1/jobs/{job['id']}", headers=headers) for _ in range(20))
    )
    spent = await ssh_commands(api) - before
    figure("20 concurrent DELETEs of one batch job: statuses, SSH commands",
           (dict(Counter(a.status_code for a in answers)), spent))  # fmt: skip
    assert [a.status_code for a in answers] == [200] * 20
    assert {a.json()["state"] for a in answers} == {"cancelled"}
    assert spent < 20


async def test_replays_with_prefer_wait_leave_no_waiter_in_the_server(
    api: Api, workdir: str
) -> None:
    """300 idempotent replays of a running batch job with `Prefer: wait=0.05` all time out
    (202): afterwards the server holds no waiter for it (sshapi_batch_waiters is 0)."""
    marker = f"{time.time_ns() % 10**6 + 9_000_000}"
    body = batch(workdir, f"sleep {marker}\n")
    first = (await api.submit(body, key=f"replay-{marker}")).json()
    await api.wait_state(first["id"], ("running",), timeout=30)
    statuses: Counter[int] = Counter()
    for _ in range(30):
        answers = await asyncio.gather(
            *(api.submit(body, key=f"replay-{marker}", wait=0.05) for _ in range(10))
        )
        statuses.update(a.status_code for a in answers)
    text = (await api.client.get(f"{api.url}/metrics")).text
    waiters = [line for line in text.splitlines() if line.startswith("sshapi_batch_waiters{")]
    await api.client.delete(f"{api.url}/v1/jobs/{first['id']}", headers=api.auth())
    figure("300 replays with Prefer: wait=0.05: statuses, waiters left", (dict(statuses), waiters))
    assert statuses == {202: 300}
    assert waiters and all(line.endswith(" 0.0") for line in waiters)


async def test_one_remote_reader_per_batch_job_however_many_clients_follow_it(
    api: Api, workdir: str
) -> None:
    """Five followers of a batch job cost the host no more SSH commands than one: the process
    reads the output files once per poll for all of them (api/live/hub.py's watcher)."""

    async def ssh_commands() -> float:
        text = (await api.client.get(f"{api.url}/metrics")).text
        return sum(
            float(v) for v in re.findall(r"^sshpool_commands_total\{.*\} (\S+)$", text, re.M)
        )

    async def followed_by(followers: int) -> tuple[float, list[bytes]]:
        script = "for i in 1 2 3 4 5 6 7 8; do echo tick$i; sleep 0.5; done\n"
        r = await api.submit(batch(workdir, script))
        job_id = r.json()["id"]
        url = f"{api.url}/v1/jobs/{job_id}/output?follow=true"

        async def follower() -> bytes:
            async with api.client.stream("GET", url, headers=api.auth()) as body:
                assert body.status_code == 200
                return b"".join([chunk async for chunk in body.aiter_bytes()])

        before = await ssh_commands()
        outputs = await asyncio.wait_for(
            asyncio.gather(*(follower() for _ in range(followers))), 60
        )
        return await ssh_commands() - before, outputs

    one, outputs1 = await followed_by(1)
    five, outputs5 = await followed_by(5)
    expected = b"".join(f"tick{i}\n".encode() for i in range(1, 9))
    assert outputs1 == [expected] and outputs5 == [expected] * 5
    print(f"SSH commands while followed: 1 follower {one:.0f}, 5 followers {five:.0f}")
    assert five < 1.5 * one + 4  # five readers each would be ~5x
