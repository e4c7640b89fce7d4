"""`python -m loadtests.handshakes` end to end: every phase of a connection completes against
the rig's stock sshd, and a connection that stops at sshd's banner costs sshd less than one
that logs in and runs a command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="creating accounts needs root")


def handshakes(data_dir: Path, *args: str) -> list[dict[str, Any]]:
    """The rows `python -m loadtests.handshakes` prints: 2 in flight, 3 accounts, and `args`."""
    done = subprocess.run(
        [sys.executable, "-m", "loadtests.handshakes", "--inflight", "2", "--accounts", "3",
         "--data-dir", str(data_dir), *args],
        cwd=REPO, capture_output=True, text=True, timeout=140,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_each_phase_completes_and_the_banner_alone_costs_sshd_less(tmp_path: Path) -> None:
    rows = {
        r["phase"]: r
        for r in handshakes(tmp_path, "--duration", "2", "--phase", "tcp", "kex", "auth", "exec")
    }
    assert set(rows) == {"tcp", "kex", "auth", "exec"}, rows
    for row in rows.values():
        assert set(row["statuses"]) == {"ok"}, row
        assert row["drop_lines"] == 0
    assert 0 < rows["tcp"]["sshd_cpu_ms"] < rows["exec"]["sshd_cpu_ms"], rows


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_certificate_logins_of_an_ecdsa_and_an_ed25519_ca_both_complete(tmp_path: Path) -> None:
    """--credentials compares key logins with certificates of the rig's ECDSA CA and of an
    Ed25519 CA: every login of each kind completes, and sshd's log shows certificates signed
    by both kinds of CA (what the comparison is about)."""
    kinds = ("keys", "certificate", "certificate-ed25519")
    rows = {
        r["credentials"]: r
        for r in handshakes(tmp_path, "--duration", "1", "--credentials", *kinds)
    }
    assert set(rows) == set(kinds), rows
    for row in rows.values():
        assert set(row["statuses"]) == {"ok"} and row["statuses"]["ok"] > 0, row
    log = (tmp_path / "hosts" / "accounts" / "sshd" / "sshd.log").read_text()
    assert "signed by ECDSA CA" in log and "signed by ED25519 CA" in log
