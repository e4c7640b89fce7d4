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
    args = parse(["--size-mib", "16", "--downloads", "2", "--base-seconds", "1"])
    result = measure(tuned_host, args, tmp_path)
    assert result["downloaded_mb"] == pytest.approx(2 * 16 * (1 << 20) / 1e6)
    assert result["alone_ms"] and result["during_ms"]
    assert "queue" in result["stages_during_ms"]
    assert "bob during the downloads" in report(result)
