"""`sshapi serve` with several worker processes on one port (SSHAPI_WORKERS): SQLite with one
writer per worker, jobs cancelled through whichever worker gets the DELETE, a dead worker
started again."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import httpx
import psutil
from api_helpers import Api, Keys, make_settings, server_process

from api.config import load_config


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
        # A new connection per request: the kernel spreads them over both workers.
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
