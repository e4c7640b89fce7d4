"""`python -m loadtests.accounts` end to end with a dozen accounts and room for 4 connections:
through the API and through the pool, every job succeeds and the row reports the evictions the
budget made and the connections it held, as the pool counts them."""

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
@pytest.mark.parametrize("via", ["api", "pool"])
def test_a_burst_wider_than_the_budget_reports_its_evictions(via: str, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "loadtests.accounts", "--via", via, "--accounts", "12",
         "--modes", "budget", "--parts", "burst", "--max-total-connections", "4",
         "--pause", "0", "--data-dir", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=140,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    (row,) = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert row["statuses"] == {"ok": 12}, row
    # 12 accounts through 4 connections: at least 8 closed for room, never more than 4 held.
    assert row["evictions"] >= 8, row
    assert 1 <= row["budget_connections_max"] <= 4, row
    assert row["sshd_drop_lines"] == 0
    assert 0 < row["sshd_pss_mib"] < row["sshd_rss_mib"], row
    assert row["generator_cpu_ms_per_job"] > 0
