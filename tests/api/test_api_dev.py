"""`sshapi dev`: the local host and the API in one command, and nothing left behind."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import httpx
import psutil
from api_helpers import SSHAPI, free_port

from loadtests.server import wait_ready


def test_dev_answers_and_a_sigterm_stops_the_local_host_too(tmp_path: Path) -> None:
    """systemd, `timeout` and CI stop a process with SIGTERM: the local sshd it started must go
    with it (uvicorn re-raises the signal after its own shutdown)."""
    data = tmp_path / "data"
    port = free_port()
    env = {**os.environ, "SSHAPI_DATA_DIR": str(data), "SSHAPI_LOG_LEVEL": "warning"}
    proc = subprocess.Popen(
        [SSHAPI, "dev", "--port", str(port)], env=env, stdout=subprocess.DEVNULL
    )
    try:
        wait_ready(proc, f"http://127.0.0.1:{port}")

        def sshd_of_data_dir() -> list[psutil.Process]:
            found = []
            for p in psutil.process_iter(["cmdline"]):
                line = " ".join(p.info["cmdline"] or [])
                if "sshd" in line and str(data) in line:
                    found.append(p)
            return found

        assert sshd_of_data_dir(), "the local host's sshd is not running"
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        assert not sshd_of_data_dir()
        # What it leaves is a plain configuration file that `sshapi serve` reads later.
        assert (data / "local.toml").is_file()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_dev_accounts_prints_a_token_that_runs_as_its_own_account(tmp_path: Path) -> None:
    """`sshapi dev --accounts 2`: the printed token runs `id -un` as sshapi-r0001 on host `hpc`
    (a certificate per connection), and `sshapi token --account` mints one for the other."""
    data = tmp_path / "data"
    port = free_port()
    env = {**os.environ, "SSHAPI_DATA_DIR": str(data), "SSHAPI_LOG_LEVEL": "warning"}
    proc = subprocess.Popen(
        [SSHAPI, "dev", "--port", str(port), "--accounts", "2"],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url)
        assert proc.stdout is not None
        token = ""
        while not token:
            line = proc.stdout.readline()
            if line.startswith("export TOKEN="):
                token = line.split("=", 1)[1].strip()
        other = subprocess.run(
            [SSHAPI, "token", "--sub", "bob", "--account", "sshapi-r0002"],
            env=env, capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        for tok, account in ((token, "sshapi-r0001"), (other, "sshapi-r0002")):
            r = httpx.post(
                f"{url}/v1/jobs",
                json={"host": "hpc", "argv": ["id", "-un"]},
                headers={"Authorization": f"Bearer {tok}", "Prefer": "wait=20"},
                timeout=30,
            )
            assert r.json()["stdout"].strip() == account, r.text
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()
