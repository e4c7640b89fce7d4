"""`sshapi serve` with several worker processes on one port (SSHAPI_WORKERS): SQLite with one
writer per worker, jobs cancelled through whichever worker gets the DELETE, each connection
handed to the least busy worker, a dead worker started again."""

from __future__ import annotations

import asyncio
import random
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path

import httpx
import psutil
import pytest
from api_helpers import REDIS_URL, Api, Keys, make_settings, server_process
from test_api_certificates import CLAIM, cert_config, run_as

from api.config import load_config
from sshpool.devhost import LocalHost
from sshpool.devhost.accounts import ensure_accounts


def workers_of(pid: int) -> list[psutil.Process]:
    """The supervisor's live workers. A worker that just died and is not reaped yet (a zombie
    between a kill and the supervisor's restart) is not one: its cmdline cannot be read."""
    workers = []
    for child in psutil.Process(pid).children():
        try:
            if "spawn" in " ".join(child.cmdline()):
                workers.append(child)
        except (psutil.ZombieProcess, psutil.NoSuchProcess):
            continue
    return workers


async def test_two_workers_share_the_port_store_and_cancels(
    config_file: Path, secret: str, keys: Keys, tmp_path: Path
) -> None:
    """Two workers on SQLite: 40 concurrent jobs all succeed, and jobs cancelled on fresh
    connections (landing on either worker) all end `cancelled`."""
    settings = make_settings(tmp_path, config_file, "sqlite", None).model_copy(
        update={"workers": 2}
    )
    config = load_config(config_file)
    with server_process(settings) as (proc, url):
        assert len(workers_of(proc.pid)) == 2
        # A new connection per request: the supervisor spreads them over both workers.
        limits = httpx.Limits(max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=30, limits=limits) as client:
            api = Api(url, client, secret, config, settings, keys)
            quick = await asyncio.gather(
                *(api.submit({"host": "local", "argv": ["echo", str(n)]}) for n in range(40))
            )
            assert [r.status_code for r in quick] == [201] * 40
            assert all(r.json()["state"] == "succeeded" for r in quick)
            slow = [
                (await api.submit({"host": "local", "argv": ["sleep", "30"]}, wait=0)).json()["id"]
                for _ in range(6)
            ]
            for job_id in slow:
                r = await client.delete(f"{url}/v1/jobs/{job_id}", headers=api.auth())
                assert r.status_code in (200, 202), r.text
            for job_id in slow:
                assert (await api.until_final(job_id))["state"] == "cancelled"


# The held requests' connections come from this address, the rest from 127.0.0.1: so each
# worker's count of them is read from its sockets, whatever else it holds.
HELD_FROM = "127.0.0.2"


def held_by(workers: list[psutil.Process], port: int) -> list[int]:
    """Per worker, its open connections on `port` from HELD_FROM."""
    return [
        sum(
            1
            for c in w.net_connections("tcp")
            if c.status == psutil.CONN_ESTABLISHED
            and c.laddr.port == port
            and c.raddr
            and c.raddr.ip == HELD_FROM
        )
        for w in workers
    ]


def running(argv: list[str]) -> int:
    """How many processes on this machine (the rig's host is local) run exactly `argv`."""
    count = 0
    for p in psutil.process_iter(["cmdline"]):
        count += p.info["cmdline"] == argv
    return count


class Held:
    """Jobs running `argv` answered with `Prefer: wait=60`, each on a connection of its own
    from HELD_FROM: each request stays in flight, on the worker it was handed to, for as long as
    its job runs."""

    def __init__(self, stack: AsyncExitStack, api: Api, proc: subprocess.Popen[bytes]) -> None:
        self.stack, self.api = stack, api
        self.port = int(api.url.rsplit(":", 1)[1])
        self.workers = workers_of(proc.pid)
        self.argv = ["sleep", f"{100 + random.random():.6f}"]  # told apart from any other
        self.requests: list[asyncio.Task[httpx.Response]] = []

    async def one_more(self) -> list[int]:
        """Open one more, and once its job runs, each worker's count of them. Nothing else
        connects meanwhile: a connection's worker is chosen when the supervisor hands it
        over, by the requests in flight then."""
        transport = httpx.AsyncHTTPTransport(local_address=HELD_FROM)
        own = await self.stack.enter_async_context(
            httpx.AsyncClient(timeout=90, transport=transport)
        )
        body = {"host": "local", "argv": self.argv}
        headers = {**self.api.auth(), "Prefer": "wait=60"}
        url = f"{self.api.url}/v1/jobs"
        self.requests.append(asyncio.create_task(own.post(url, json=body, headers=headers)))
        n = len(self.requests)
        deadline = time.monotonic() + 30
        while sum(counts := held_by(self.workers, self.port)) < n or running(self.argv) < n:
            assert time.monotonic() < deadline, f"long request {n}: {counts}"
            assert not self.requests[-1].done(), self.requests[-1].result().text
            await asyncio.sleep(0.05)
        return counts


async def test_each_connection_goes_to_the_least_busy_worker(
    config_file: Path, secret: str, keys: Keys, tmp_path: Path
) -> None:
    """Four long requests (jobs answered with `Prefer: wait`), each on its own connection and
    opened once the one before is running, are served two by each worker: placed by the
    requests in flight, not by which worker wakes first. (That a busy worker is passed over
    whatever the turn: tests/api/test_handoff.py.)"""
    settings = make_settings(tmp_path, config_file, "sqlite", None).model_copy(
        update={"workers": 2}
    )
    config = load_config(config_file)
    with server_process(settings) as (proc, url):
        async with AsyncExitStack() as stack:
            client = await stack.enter_async_context(httpx.AsyncClient(timeout=30))
            api = Api(url, client, secret, config, settings, keys)
            held = Held(stack, api, proc)
            assert len(held.workers) == 2
            try:
                assert sorted(await held.one_more()) == [0, 1]
                assert await held.one_more() == [1, 1]
                assert sorted(await held.one_more()) == [1, 2]
                assert await held.one_more() == [2, 2]
            finally:
                r = await client.get(f"{url}/v1/jobs", headers=api.auth())
                for job in r.json()["items"]:
                    if job["state"] not in ("succeeded", "failed", "cancelled"):
                        await client.delete(f"{url}/v1/jobs/{job['id']}", headers=api.auth())
                await asyncio.gather(*held.requests, return_exceptions=True)


async def test_a_sigterm_lets_each_workers_requests_in_flight_finish(
    config_file: Path, secret: str, keys: Keys, tmp_path: Path
) -> None:
    """SIGTERM to the supervisor while each worker holds a job answered with `Prefer: wait`
    (connections handed over, not accepted by the workers): each worker's graceful shutdown
    lets its request finish, both jobs are answered `succeeded`, and everything exits."""
    settings = make_settings(tmp_path, config_file, "sqlite", None).model_copy(
        update={"workers": 2}
    )
    config = load_config(config_file)
    with server_process(settings) as (proc, url):
        async with AsyncExitStack() as stack:
            client = await stack.enter_async_context(httpx.AsyncClient())
            api = Api(url, client, secret, config, settings, keys)
            held = Held(stack, api, proc)
            held.argv[1] = f"{2 + random.random():.6f}"  # a job that ends by itself
            await held.one_more()
            assert await held.one_more() == [1, 1]
            proc.send_signal(signal.SIGTERM)
            answers = await asyncio.gather(*held.requests)
        assert [r.status_code for r in answers] == [201, 201], [r.text for r in answers]
        assert [r.json()["state"] for r in answers] == ["succeeded", "succeeded"]
        assert proc.wait(30) == 128 + signal.SIGTERM
        _, running_still = psutil.wait_procs(held.workers, timeout=10)
        assert running_still == []


async def test_a_killed_worker_is_started_again(
    config_file: Path, secret: str, keys: Keys, tmp_path: Path
) -> None:
    """SIGKILL of one worker: the others keep answering and the supervisor starts it again;
    SIGKILL of the supervisor then: its workers stop rather than serve on unsupervised."""
    settings = make_settings(tmp_path, config_file, "sqlite", None).model_copy(
        update={"workers": 2}
    )
    with server_process(settings) as (proc, url):
        victim = workers_of(proc.pid)[0]
        victim.send_signal(signal.SIGKILL)
        victim.wait(5)
        async with httpx.AsyncClient(timeout=10) as client:
            assert (await client.get(f"{url}/readyz")).status_code == 200
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                alive = [p for p in workers_of(proc.pid) if p.pid != victim.pid]
                if len(alive) == 2:
                    break
                await asyncio.sleep(0.2)
            assert len(alive) == 2
        proc.send_signal(signal.SIGKILL)
        proc.wait(5)
        _, running = psutil.wait_procs(alive, timeout=20)
        assert running == [], running


@pytest.mark.parametrize("exec_mode", ["channel", "agent"])
async def test_two_workers_with_certificates_run_each_researcher_as_their_account(
    make_host: Callable[..., LocalHost],
    secret_file: Path,
    secret: str,
    keys: Keys,
    tmp_path: Path,
    exec_mode: str,
) -> None:
    """SSHAPI_WORKERS=2 on a certificate host, in both exec modes: the server starts (each
    worker loads its own CA from the configuration: a loaded key never crosses into a worker),
    and jobs run as the account their token names on both workers (sshd's log names the
    minting process in each certificate's key id)."""
    accounts = [a.name for a in ensure_accounts(2, data_dir=tmp_path / "accounts")]
    host = make_host("stock", researchers=True)
    path = tmp_path / "sshapi.toml"
    text = cert_config(host, secret_file, keys)
    mode = f'exec_mode = "{exec_mode}"\n[hosts.hpc.credentials]'
    path.write_text(text.replace("[hosts.hpc.credentials]", mode))
    settings = make_settings(tmp_path, path, "sqlite", None).model_copy(update={"workers": 2})
    with server_process(settings) as (proc, url):
        pids = {str(p.pid) for p in workers_of(proc.pid)}
        assert len(pids) == 2
        # A new connection and a new identity per job: the supervisor spreads the connections
        # over both workers, and each identity's first job mints a certificate where it lands.
        limits = httpx.Limits(max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=30, limits=limits) as client:
            api = Api(url, client, secret, load_config(path), settings, keys)
            minted: set[str] = set()
            for n in range(60):
                account = accounts[n % 2]
                r = await run_as(api, f"sub-{n}", ["id", "-un"], **{CLAIM: account})
                assert r.json()["state"] == "succeeded", r.text
                assert r.json()["stdout"].strip() == account
                found = re.findall(r"ID sub-\d+@\S+/\S+\.(\d+)/\d+ \(serial", host.log_tail(400))
                minted = set(found)
                if minted == pids:
                    break
    assert minted == pids, f"certificates minted by {minted}, workers {pids}"


def room_for_3(config_file: Path, tmp_path: Path) -> Path:
    """The test configuration with host `local` holding 3 connections of one channel at most."""
    text = config_file.read_text().replace(
        "[hosts.local.limits]\nmax_connections = 2\nmax_sessions = 8\n",
        "[hosts.local.limits]\nmax_connections = 4\nmax_sessions = 1\nmax_total_connections = 3\n",
    )
    assert "max_total_connections = 3" in text
    path = tmp_path / "shared.toml"
    path.write_text(text)
    return path


def established(port: int) -> int:
    """This machine's established TCP connections to `port` (what that sshd serves): through
    netlink (`ss`), whose one walk of the kernel's table does not add up a connection closed
    and another opened meanwhile, as /proc/net/tcp read page by page (psutil) can while the
    workers, other processes, close and open them (docs/benchmarks.md, "The kernel's count");
    psutil without `ss`."""
    if shutil.which("ss"):
        out = subprocess.run(
            ["ss", "-Htn", "state", "established", f"( dport = :{port} )"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return sum(1 for line in out.splitlines() if line.strip())
    return sum(
        1
        for c in psutil.net_connections("tcp")
        if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
    )


async def test_two_workers_with_redis_share_the_sshds_budget(
    tuned_host: LocalHost, config_file: Path, secret: str, keys: Keys, tmp_path: Path
) -> None:
    """`sshapi serve --workers 2` with Redis, host `local` with room for 3 connections of one
    channel each: 12 one-second jobs spread over both workers all succeed, the sshd never sees
    more than 3 connections, and /metrics shows the share and the slots leased. Each worker
    with its own budget (before) held up to 6."""
    path = room_for_3(config_file, tmp_path)
    settings = make_settings(tmp_path, path, "sqlite", None).model_copy(update={"workers": 2})
    config = load_config(path)
    most = 0

    async def sample() -> None:
        nonlocal most
        while True:
            most = max(most, await asyncio.to_thread(established, tuned_host.port))
            await asyncio.sleep(0.01)

    with server_process(settings, extra_env={"SSHAPI_REDIS_URL": REDIS_URL}) as (_proc, url):
        # A new connection per request: the supervisor spreads them over both workers.
        limits = httpx.Limits(max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            api = Api(url, client, secret, config, settings, keys)
            sampler = asyncio.create_task(sample())
            try:
                done = await asyncio.gather(
                    *(api.submit({"host": "local", "argv": ["sleep", "1"]}) for _ in range(12))
                )
            finally:
                sampler.cancel()
            texts = [(await client.get(f"{url}/metrics")).text for _ in range(6)]
    assert [r.status_code for r in done] == [201] * 12
    assert all(r.json()["state"] == "succeeded" for r in done)
    assert most <= 3, most
    # Each worker's /metrics: its share, and the slots all of them lease, within the budget.
    leased = re.findall(r'sshpool_sshd_leased_connections\{host="local"\} (\d+)', "".join(texts))
    assert leased and all(int(n) <= 3 for n in leased), leased
    assert 'sshpool_sshd_share_connections{host="local"}' in "".join(texts)
