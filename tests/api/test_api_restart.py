"""A dead API process: its running jobs read back as `lost` after a restart, on both stores."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import pytest
from api_helpers import Api, Keys, make_settings, pg_schema, running_api, server_process

from api.config import load_config
from sshpool.devhost import LocalHost


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
        marker = f"{time.time_ns() % 10**6 + 6_000_000}"
        with server_process(settings) as (proc, url):
            async with httpx.AsyncClient(timeout=10) as client:
                first = Api(url, client, secret, load_config(config_file), settings, keys)
                r = await first.submit({"host": "local", "command": f"sleep {marker}"}, wait=0)
                job_id = r.json()["id"]
                await first.wait_state(job_id, ("running",))
            proc.send_signal(signal.SIGKILL)
        try:
            async with running_api(settings, keys, secret) as second:
                job = await second.job(job_id)
                assert job["state"] == "lost"
                assert "restarted" in job["error"]
        finally:
            # The remote command outlives a killed API (nothing was there to kill it).
            tuned_host.run_local(["pkill", "-f", f"sleep {marker}"])
