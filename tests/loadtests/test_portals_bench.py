"""loadtests.portals_bench runs end to end (its own host and API): the polls are answered and the
feed carries the background jobs' changes, so the CPU figures it prints compare what they claim
to compare."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtests import portals_bench


@pytest.mark.timeout(300)
def test_the_portals_benchmark_polls_and_follows(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "summary.json"
    portals_bench.main(["--jobs", "20", "--phase", "4", "--rounds", "1", "--out", str(out)])
    lines = capsys.readouterr().out.splitlines()
    phases = [json.loads(line) for line in lines if '"phase"' in line]
    assert [p["phase"] for p in phases] == ["idle", "poll", "feed"]
    poll, feed = phases[1], phases[2]
    assert poll["ok"] > 0 and poll["failed"] == 0
    assert feed["events"] > 0  # the background jobs' changes reached the feed
    summary = json.loads(out.read_text())
    assert summary["polls_per_s"]["wanted"] == 10.0
    assert summary["feed_over_poll_full_rate"] >= 0
