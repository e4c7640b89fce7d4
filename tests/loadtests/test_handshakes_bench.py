"""`python -m loadtests.handshakes` end to end: every phase of a connection completes against
the rig's stock sshd, and a connection that stops at sshd's banner costs sshd less than one
that logs in and runs a command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="creating accounts needs root")


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_each_phase_completes_and_the_banner_alone_costs_sshd_less(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "loadtests.handshakes", "--inflight", "2", "--duration", "2",
         "--accounts", "3", "--phase", "tcp", "kex", "auth", "exec", "--data-dir", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=140,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    rows = {r["phase"]: r for r in map(json.loads, lines)}
    assert set(rows) == {"tcp", "kex", "auth", "exec"}, output
    for row in rows.values():
        assert set(row["statuses"]) == {"ok"}, row
        assert row["drop_lines"] == 0
    assert 0 < rows["tcp"]["sshd_cpu_ms"] < rows["exec"]["sshd_cpu_ms"], rows
