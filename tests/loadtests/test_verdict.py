"""loadtests.verdict: bootstrap intervals over repeats decide better / worse / indistinguishable."""

from __future__ import annotations

import random

from loadtests.verdict import Interval, mean_difference, p99_difference


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
