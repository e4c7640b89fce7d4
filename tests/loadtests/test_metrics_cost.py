"""loadtests.metrics_cost runs both trees, interleaved, and prints a figure for each run."""

from __future__ import annotations

import json

import pytest

from loadtests import metrics_cost


def test_metrics_cost_measures_both_trees_interleaved(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        metrics_cost.main(["--base", "HEAD", "--jobs", "20", "--scrapes", "5", "--rounds", "2"])
        == 0
    )
    out = capsys.readouterr().out
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [r["tree"] for r in rows] == ["base HEAD", "this", "this", "base HEAD"]
    for row in rows:
        assert row["api_cpu_ms_per_job"] > 0 and row["api_cpu_ms_per_scrape"] > 0, row
    assert "load average (1 min)" in out
