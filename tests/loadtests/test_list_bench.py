"""The listings benchmark runs end to end on small directories (its figures, at scale, are in
docs/benchmarks.md): every page read, the client's `files ls` printing every entry, four
listings at once by one identity answered 200 or 429 only.

The cap itself is proven in tests/api/test_api_files_limits.py with a listing held open: here a
2,500-entry listing takes ~50 ms, so whether the four overlap on the server is timing (CI saw a
listing end before the fourth began: three 200s)."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtests.list_bench import measure, report
from sshpool.devhost import LocalHost

pytestmark = pytest.mark.timeout(300)


def test_list_bench_pages_prints_and_caps_listings(tuned_host: LocalHost, tmp_path: Path) -> None:
    """Two small directories: 200 with every entry paged and printed by `sshapi files ls`;
    four listings at once by one identity: 200 or 429, never an error, at least max_listings (2)
    of them served."""
    result = measure(tuned_host, tmp_path / "run", [1500, 2500], 4)
    text = report(result)
    for n in (1500, 2500):
        one = result["sizes"][n]
        assert one["status"] == 200, text
        assert one["paged"]["entries"] == n, text
        assert one["cli"]["lines"] == n, text
    statuses = result["concurrent_one_identity"]["statuses"]
    assert statuses.get(200, 0) >= 2 and sum(statuses.values()) == 4, text
    assert set(statuses) <= {200, 429}, text
    assert result["concurrent_identities"]["statuses"] == {200: 4}, text
