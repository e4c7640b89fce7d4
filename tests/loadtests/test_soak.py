"""`python -m loadtests.soak`, short: a steady load ends with no errors and the API's memory,
descriptors, SSH connections and sshd sessions flat. The 10-minute run at 100 req/s is the same
command with `--rate 100 --minutes 10` (figures in RELIABILITY.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_short_soak_is_flat_with_no_errors(tmp_path: Path) -> None:
    """15 s at 20 req/s: every request succeeds and every watched quantity stays flat (the
    sampler and the verdict at work; flatness over minutes is the 10-minute run's figure)."""
    done = subprocess.run(
        [sys.executable, "-m", "loadtests.soak", "--rate", "20", "--minutes", "0.25",
         "--interval", "1", "--settle", "3", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=140, check=False,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    (report,) = tmp_path.glob("*-soak/soak.json")
    soak = json.loads(report.read_text())
    assert soak["requests"]["requests"] == 300
    assert soak["requests"]["failed"] == 0
    assert soak["verdict"]["flat"]
    assert set(soak["verdict"]["series"]) == {"rss_mb", "own_fds", "connections", "sshd_sessions"}
    assert len(soak["samples"]) >= 12
    assert "verdict: OK" in output
