"""The CLI start-up benchmark runs and prints what docs/benchmarks.md records: a row per command
and build, each with its median, p90, min, its ratio over the interpreter's floor and its CPU
time (not a timing assertion: the shared machine's load moves every figure)."""

from __future__ import annotations

import re

import pytest

from loadtests import cli_startup

pytestmark = pytest.mark.timeout(300)

ROW = re.compile(
    r"^(?P<name>.+?)\s+median\s+(?P<median>\d+) ms\s+p90\s+\d+\s+min\s+\d+\s+"
    r"(?P<ratio>[\d.]+) x floor\s+\+\s*-?\d+ ms\s+cpu\s+(?P<cpu>\d+) ms$"
)


def test_the_benchmark_times_each_build_s_commands_beside_the_floor(
    capsys: pytest.CaptureFixture[str],
) -> None:
    cli_startup.main(["--runs", "2", "--client-only"])
    rows = {m["name"]: m for line in capsys.readouterr().out.splitlines() if (m := ROW.match(line))}
    assert list(rows) == [
        "python -c pass",
        "server: GET /v1/jobs",
        "[1] sshapi --help",
        "[1] sshapi jobs list",
        "[2] sshapi --help",
        "[2] sshapi jobs list",
    ]
    assert rows["python -c pass"]["ratio"] == "1.0"
    # Each command is a process of its own whose CPU is counted; the request is in-process.
    assert (
        int(rows["[2] sshapi jobs list"]["cpu"]) > 0 and rows["server: GET /v1/jobs"]["cpu"] == "0"
    )
