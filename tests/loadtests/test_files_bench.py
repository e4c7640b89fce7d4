"""The files benchmark's memory claim: the API's RSS stays flat while a file much larger than
any buffer streams through it both ways (a bound on memory, not a timing assertion)."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtests.files_bench import MIB, measure, report
from sshpool.devhost import LocalHost

pytestmark = pytest.mark.timeout(300)

# Twice the bound: a body held in memory would grow the RSS by 100 MiB and fail it.
SIZE = 100 * MIB
MAX_GROWTH_MIB = 50


def test_api_rss_stays_flat_through_a_100_mib_upload_and_download(
    tuned_host: LocalHost, tmp_path: Path
) -> None:
    """100 MiB up and down through the API (sha256 checked both ways) grow its RSS by less than
    50 MiB each; scp moved the same file for the comparison."""
    result = measure(tuned_host, SIZE, tmp_path / "run")
    by_name = {t["name"]: t for t in result["transfers"]}
    for name in ("API upload", "API download"):
        assert by_name[name]["rss_growth_mib"] < MAX_GROWTH_MIB, report(result)
    assert by_name["scp upload"]["mb_per_s"] > 0 and by_name["scp download"]["mb_per_s"] > 0
    assert "API / scp" in report(result)


def test_through_the_relay_the_rss_stays_flat_too(tuned_host: LocalHost, tmp_path: Path) -> None:
    """Through the rig's relay at 20 ms the lane reads and writes in bigger calls (four
    bandwidth-delay products): the API's RSS still grows by less than 50 MiB each way, and
    scp and SFTP alone went through the relay too."""
    result = measure(tuned_host, SIZE, tmp_path / "run", rtt_ms=20)
    by_name = {t["name"]: t for t in result["transfers"]}
    for name in ("API upload", "API download"):
        assert by_name[name]["rss_growth_mib"] < MAX_GROWTH_MIB, report(result)
    assert result["rtt_ms"] == 20
    assert "relay RTT 20 ms" in report(result)
