"""`sshapi dev`: the local host and the API in one command, and nothing left behind."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

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
