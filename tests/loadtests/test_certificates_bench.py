"""loadtests.certificates runs end to end on a few accounts and prints its figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtests import certificates


def test_certificates_bench_prints_every_part(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--accounts", "3", "--rounds", "1", "--connects", "3", "--jobs", "5"]
    assert certificates.main([*argv, "--data-dir", str(tmp_path / "data")]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line[:1] == "{"]
    assert [r["part"] for r in rows] == ["burst", "connect", "cpu"]
    burst, connect, cpu = rows
    assert burst["statuses"] == {"ok": 3} and burst["refusing_certificate_lines"] == 0
    assert connect["certificate_p50_ms"] > 0 and cpu["certificate_cpu_ms_per_job"] > 0


def test_certificates_bench_through_http(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--http`: each researcher's token runs `id -un` as their account through `sshapi
    serve`, and the CPU part compares a certificate account with a key file account."""
    argv = ["--http", "--accounts", "3", "--rounds", "1", "--jobs", "5"]
    assert certificates.main([*argv, "--data-dir", str(tmp_path / "data")]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line[:1] == "{"]
    assert [r["part"] for r in rows] == ["http-burst", "http-cpu"]
    burst, cpu = rows
    assert burst["statuses"] == {"ok": 3} and burst["refusing_certificate_lines"] == 0
    assert burst["certificate_logins"] == 3 and "key_api_cpu_ms_per_job" in cpu
