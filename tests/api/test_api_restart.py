"""A dead API process: its running jobs read back as `lost` after a restart, on both stores."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest
from api_helpers import Api, Keys, free_port, make_settings, pg_schema, running_api

from api.config import load_config
from sshpool.local_host import LocalHost

SSHAPI = str(Path(sys.executable).parent / "sshapi")


async def until_ready(url: str, proc: asyncio.subprocess.Process) -> None:
    async with httpx.AsyncClient() as client, asyncio.timeout(30):
        while True:
            assert proc.returncode is None, "sshapi serve exited during startup"
            try:
                if (await client.get(f"{url}/readyz")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.1)


@pytest.mark.parametrize("db", ["sqlite", "postgresql"])
async def test_restart_with_a_running_job_reads_back_lost(
    db: str,
    config_file: Path,
    secret: str,
    keys: Keys,
    tmp_path: Path,
    tuned_host: LocalHost,
) -> None:
    """`sshapi serve` is SIGKILLed with a job running; the next start marks that job `lost`
    (outcome unknown) instead of leaving it `running` forever."""
    async with pg_schema() as schema:
        settings = make_settings(tmp_path, config_file, db, schema if db != "sqlite" else None)
        port = free_port()
        env = {
            **os.environ,
            "SSHAPI_CONFIG": str(config_file),
            "SSHAPI_DATA_DIR": str(settings.data_dir),
            "SSHAPI_PORT": str(port),
            "SSHAPI_REPLICA": settings.replica,
            "SSHAPI_DATABASE_URL": settings.resolved_database_url,
            "SSHAPI_LOG_LEVEL": "warning",
        }
        if settings.database_schema:
            env["SSHAPI_DATABASE_SCHEMA"] = settings.database_schema
        proc = await asyncio.create_subprocess_exec(
            SSHAPI, "serve", env=env, stdin=asyncio.subprocess.DEVNULL
        )
        url = f"http://127.0.0.1:{port}"
        marker = f"{time.time_ns() % 10**6 + 6_000_000}"
        try:
            await until_ready(url, proc)
            async with httpx.AsyncClient(timeout=10) as client:
                first = Api(url, client, secret, load_config(config_file), settings, keys)
                r = await first.submit({"host": "local", "command": f"sleep {marker}"}, wait=0)
                job_id = r.json()["id"]
                await first.wait_state(job_id, ("running",))
        finally:
            proc.send_signal(signal.SIGKILL)
            async with asyncio.timeout(10):
                await proc.wait()
        try:
            async with running_api(settings, keys, secret) as second:
                job = await second.job(job_id)
                assert job["state"] == "lost"
                assert "restarted" in job["error"]
        finally:
            # The remote command outlives a killed API (nothing was there to kill it).
            tuned_host.run_local(["pkill", "-f", f"sleep {marker}"])
