"""`python -m loadtests.raw_matrix` end to end with tiny durations: every cell of sshd profile x
pool limits is measured once per round, and each non-baseline cell gets a difference and a
verdict against the baseline."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def raw_matrix(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "loadtests.raw_matrix", *argv],
        cwd=REPO, capture_output=True, text=True, timeout=110,
    )  # fmt: skip


@pytest.mark.timeout(120)
def test_every_cell_is_measured_each_round_and_judged_against_the_baseline(
    tmp_path: Path,
) -> None:
    done = raw_matrix("--sshd", "stock", "--limits", "default", "sessions12",
                      "--concurrency", "2", "--duration", "0.3", "--rounds", "2",
                      "--out", str(tmp_path))  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert len(re.findall(r"^round [01]: 2 callers, sshd stock", done.stdout, re.M)) == 4
    base = re.search(
        r"^\| 2 \| stock \| default \| (\d+) .*\| 0 \| - \| baseline \|$", done.stdout, re.M
    )
    other = re.search(
        r"^\| 2 \| stock \| sessions12 \| \d+ .*\| 0 \| [+-]\d+ \[[+-]\d+, [+-]\d+\] \| "
        r"(stock/sessions12 better|stock/sessions12 worse|indistinguishable) \|$",
        done.stdout, re.M,
    )  # fmt: skip
    assert base and int(base.group(1)) > 0, done.stdout
    assert other, done.stdout
    (report,) = tmp_path.glob("*-raw-matrix/raw_matrix.md")
    assert "| 2 | stock | sessions12 |" in report.read_text()


def test_a_single_round_is_refused() -> None:
    """One round has no spread, so no verdict could be honest: refused before any sshd starts."""
    done = raw_matrix("--rounds", "1")
    assert done.returncode == 2 and "--rounds must be at least 2" in done.stderr
