"""A short headless Locust run in a subprocess against the real API and sshd. Locust is never
imported into the pytest process (it monkey-patches it with gevent)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtests.schedule import PROFILES, arrivals, scaled
from loadtests.server import start_api, stop_api
from sshpool.local_host import LocalHost

REPO = Path(__file__).resolve().parent.parent
LOCUST = Path(sys.executable).parent / "locust"
FACTOR = 0.5  # the smoke profile at half length: 1 s warm-up, 5 s measured


@pytest.fixture
def api(tuned_host: LocalHost, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    data = tmp_path / "api"
    proc, url = start_api(
        tuned_host, backend="asyncssh", pool_mode="pooled", data_dir=data, log=tmp_path / "api.log"
    )
    try:
        yield url, data
    finally:
        stop_api(proc)


@pytest.mark.timeout(90)
def test_headless_sustained_smoke_run_writes_a_complete_report(
    api: tuple[str, Path], tmp_path: Path
) -> None:
    """`locust -f loadtests/sustained.py --headless` ends by itself, exits 0 with no failures,
    and its summary holds exactly the measured arrivals of the schedule, all successful."""
    url, data = api
    reports = tmp_path / "reports"
    env = {**os.environ, "SSHAPI_DATA_DIR": str(data)}
    env.pop("SSHAPI_TOKEN", None)
    env.pop("SSHAPI_CONFIG", None)
    done = subprocess.run(
        [str(LOCUST), "-f", str(REPO / "loadtests" / "sustained.py"), "--headless", "-H", url,
         "--duration-factor", str(FACTOR), "--report-dir", str(reports)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=80,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    (run,) = reports.iterdir()
    assert f"report: {run / 'report.md'}" in output
    summary = json.loads((run / "summary.json").read_text())
    measured = [a for a in arrivals(scaled(PROFILES["smoke"], FACTOR)) if a.stage == 1]
    assert summary["requests"] == len(measured)
    assert summary["ok"] == len(measured)
    assert summary["latency_ms"]["p50"] > 0
    assert set(summary["server_timing_ms"]) >= {"auth", "exec"}
    assert (run / "report.md").read_text().startswith("# Load run: sustained smoke")
    assert (
        len((run / "records.jsonl").read_text().splitlines())
        == summary["requests"] + (summary["warmup_requests"])
    )
