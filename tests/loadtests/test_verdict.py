"""loadtests.verdict: bootstrap intervals over repeats decide better / worse / indistinguishable."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from loadtests.records import Record, write_jsonl
from loadtests.summary import LATE_MS, summarize
from loadtests.verdict import Interval, mean_difference, p99_difference, render, verdicts


def latencies(center: float, n: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [rng.gauss(center, center * 0.1) for _ in range(n)]


def test_a_clearly_lower_p99_in_every_repeat_is_better() -> None:
    """B's requests are twice as fast in each of 3 repeats: B better, interval below 0."""
    a = [latencies(20, 500, s) for s in range(3)]
    b = [latencies(10, 500, s + 10) for s in range(3)]
    diff = p99_difference(a, b)
    assert diff is not None and diff.high < 0
    assert diff.verdict(lower_is_better=True, name="tuned") == "tuned better"


def test_one_outlier_repeat_leaves_the_p99_undecided() -> None:
    """Same distributions but one of B's two repeats had a stall: no verdict either way."""
    a = [latencies(10, 500, 1), latencies(10, 500, 2)]
    b = [latencies(10, 500, 3), [*latencies(10, 490, 4), *[100.0] * 10]]
    diff = p99_difference(a, b)
    assert diff is not None and diff.low <= 0 <= diff.high
    assert diff.verdict(True, "tuned") == "indistinguishable"


def test_throughput_higher_in_every_repeat_is_better_and_missing_data_is_none() -> None:
    """Throughput is better when higher; a side with no repeats gives no interval."""
    diff = mean_difference([100.0, 101.0, 99.0], [150.0, 149.0, 151.0])
    assert diff is not None and diff.low > 0 and diff.verdict(False, "tuned") == "tuned better"
    assert mean_difference([], [1.0]) is None and p99_difference([[]], [[1.0]]) is None


def test_interval_verdicts_cover_both_signs() -> None:
    """An interval above 0 for a lower-is-better metric is worse; straddling 0 undecided."""
    assert Interval(5, 1, 9).verdict(True, "x") == "x worse"
    assert Interval(-5, -9, -1).verdict(False, "x") == "x worse"
    assert Interval(0, -1, 1).verdict(True, "x") == "indistinguishable"


def _run(out: Path, sshd: str, center: float, seed: int, late: bool = False) -> dict[str, Any]:
    """One experiment run at 50/s (500 requests) with its records on disk beside its report,
    as run_cell leaves it; `late`: the generator sent them all 3x LATE_MS late (an INVALID
    stage)."""
    rng = random.Random(seed)
    records = [
        Record(kind="open", t=1000.0 + n / 50, latency_ms=(v := rng.gauss(center, center / 10)),
               service_ms=v, lateness_ms=3 * LATE_MS if late else 0.1, ok=True, status=201,
               error="", stage=0, warmup=False, rate=50.0, burst_size=0,
               connection="keep-alive", worker=0)
        for n in range(500)
    ]  # fmt: skip
    out.mkdir()
    write_jsonl(out / "records.jsonl", records)
    summary = summarize(records, {}, {})
    cell = {"backend": "asyncssh", "sshd": sshd, "pool_mode": "pooled", "profile": "paper"}
    return {"cell": cell, "summary": summary, "report": str(out / "report.md")}


def test_a_repeat_whose_generator_fell_behind_is_left_out_of_the_verdict(tmp_path: Path) -> None:
    """tuned is twice as fast in both of its valid repeats; its third repeat is INVALID (late
    sends) with 100 ms answers: left out and counted, tuned is still judged better. With no
    valid repeat on a side there is no verdict."""
    stock = [_run(tmp_path / f"s{n}", "stock", 10.0, n) for n in range(2)]
    tuned = [_run(tmp_path / f"t{n}", "tuned", 5.0, 10 + n) for n in range(2)]
    tuned.append(_run(tmp_path / "t-late", "tuned", 100.0, 20, late=True))
    (row,) = verdicts(stock + tuned)
    assert (row["repeats"], row["invalid"]) == ((2, 2), (0, 1))
    assert row["p99_verdict"] == "tuned better"
    assert "| 2, 2 | 0, 1 |" in render([row])
    (none,) = verdicts(stock + tuned[2:])
    assert (none["p99_verdict"], none["throughput_verdict"]) == ("no valid run", "no valid run")
