"""The transfer fairness measurement runs end to end (small: the figures are in
docs/benchmarks.md, measured with the defaults)."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtests.transfer_fairness import measure, parse, report
from sshpool.devhost import LocalHost

pytestmark = pytest.mark.timeout(120)


def test_a_small_run_reports_the_bystander_and_the_downloads(
    tuned_host: LocalHost, tmp_path: Path
) -> None:
    """The downloads by httpx in the generator's process here (the other test: curl's)."""
    args = parse(
        ["--size-mib", "16", "--downloads", "2", "--base-seconds", "1", "--client", "httpx"]
    )
    result = measure(tuned_host, args, tmp_path)
    assert result["downloaded_mb"] == pytest.approx(2 * 16 * (1 << 20) / 1e6)
    assert result["alone_ms"] and result["during_ms"]
    assert "queue" in result["stages_during_ms"]
    assert "bob during the downloads" in report(result)


def test_lane_on_and_off_runs_interleave_with_parallel_scp(
    tuned_host: LocalHost, tmp_path: Path
) -> None:
    """`--lane on,off`: one API per setting, then as many scp of the same file at once with
    bob's jobs beside them too (what the box leaves him); the report sets each run beside
    scp's figure of its round. The downloads by curl, the default; the API in 2 processes."""
    lane = ["--lane", "on,off", "--workers", "2"]
    args = parse(["--size-mib", "16", "--downloads", "2", "--base-seconds", "1", *lane])
    result = measure(tuned_host, args, tmp_path)
    kinds = [(run["kind"], run.get("lane")) for run in result["runs"]]
    assert kinds == [("api", "on"), ("api", "off"), ("scp", None)]
    for run in result["runs"][:2]:
        assert run["downloaded_mb"] == pytest.approx(2 * 16 * (1 << 20) / 1e6)
        assert run["scp_mb_per_s"] == result["runs"][2]["mb_per_s"] > 0
    scp = result["runs"][2]
    assert scp["alone_ms"] and scp["during_ms"] and scp["failed"] == 0
    text = report(result)
    assert "lane on" in text and "lane off" in text and "parallel scp" in text
    assert "during the scp" in text
