"""loadtests.trace_bench, small: every variant runs jobs (the tree of `--before` first on the
path of its API, checked by what its jobs carry) and the server-span comparison runs; the
figures themselves are docs/benchmarks.md's. In a process of its own: the benchmark installs
a tracer provider, one per process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from loadtests.trace_bench import VARIANTS

pytestmark = pytest.mark.timeout(240)
ROOT = Path(__file__).resolve().parents[2]


def test_the_trace_benchmark_measures_every_variant() -> None:
    """A tiny run prints a CPU figure per job for before, off, on-100, on-10, old-on-10 and on-0,
    a CPU figure per request for each server-span variant, with the load average around them."""
    argv = ["--before", "HEAD", "--old", "HEAD", "--variants", ",".join(VARIANTS)]
    argv += ["--jobs", "8", "--rounds", "1", "--concurrency", "2"]
    done = subprocess.run(
        [sys.executable, "-m", "loadtests.trace_bench", *argv, "--spans", "50"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=200,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    for name in (*VARIANTS, "untraced", "ours", "fastapi", "fastapi+operations"):
        assert f"  {name} " in out, out
    assert out.count("load average") == 2
