"""Verdicts for the experiment runner: does one cell beat another, given the spread over repeats?

For a pair of cells that differ in one dimension (by default the sshd profile: `tuned` against
`stock`, same backend, pool mode and load profile) and for each offered load (stage), a
hierarchical bootstrap estimates the difference B - A of

- p99 latency (successes, from the intended send time): resample the repeats of each cell with
  replacement, then the requests within each chosen repeat, and take the p99 of the pooled
  sample;
- throughput (successes per second of the stage; of a burst, per second of its makespan):
  resample the repeats, mean of the chosen;
- failure rate (failed share of the stage's or burst's requests), as throughput.

A burst profile's "load" is its burst size (all repeats of that size, as one stage).

Only repeats whose stage kept its own validity verdict count: a repeat in which the generator
fell behind at that load measured the generator (its throughput and latency understated), so it
is left out and counted apart; with no valid repeat on a side, the verdict is "no valid run".

The 95% interval of the difference gives the verdict: entirely on B's good side, "B better";
entirely on its bad side, "B worse"; containing 0, "indistinguishable". With two repeats the
interval is wide by design: a single lucky or unlucky run cannot decide anything, which is the
point (the last benchmark's one-run "tuned 101 ms against stock 39 ms" at 90/s was such a case).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from loadtests.records import Record, read_jsonl

RESAMPLES = 2000
CONFIDENCE = 0.95


@dataclass(frozen=True, slots=True)
class Interval:
    point: float
    low: float
    high: float

    def verdict(self, lower_is_better: bool, name: str) -> str:
        """`name` better / worse / indistinguishable, for a difference `name` minus baseline."""
        if self.low > 0:
            return f"{name} {'worse' if lower_is_better else 'better'}"
        if self.high < 0:
            return f"{name} {'better' if lower_is_better else 'worse'}"
        return "indistinguishable"


def _interval(samples: np.ndarray[Any, Any], point: float) -> Interval:
    tail = (1.0 - CONFIDENCE) / 2 * 100
    low, high = np.percentile(samples, [tail, 100 - tail])
    return Interval(point, float(low), float(high))


def _pooled_p99(repeats: Sequence[np.ndarray[Any, Any]], rng: np.random.Generator) -> float:
    chosen = rng.integers(0, len(repeats), len(repeats))
    parts = [repeats[i][rng.integers(0, len(repeats[i]), len(repeats[i]))] for i in chosen]
    return float(np.percentile(np.concatenate(parts), 99))


def p99_difference(
    a: Sequence[Sequence[float]], b: Sequence[Sequence[float]], seed: int = 1
) -> Interval | None:
    """Bootstrap interval of p99(B) - p99(A); each argument holds one latency list per repeat.
    None when either side has no latency at all."""
    ra = [np.asarray(r, dtype=float) for r in a if len(r)]
    rb = [np.asarray(r, dtype=float) for r in b if len(r)]
    if not ra or not rb:
        return None
    rng = np.random.default_rng(seed)
    diffs = np.fromiter(
        (_pooled_p99(rb, rng) - _pooled_p99(ra, rng) for _ in range(RESAMPLES)), float, RESAMPLES
    )
    point = float(np.percentile(np.concatenate(rb), 99) - np.percentile(np.concatenate(ra), 99))
    return _interval(diffs, point)


def mean_difference(a: Sequence[float], b: Sequence[float], seed: int = 1) -> Interval | None:
    """Bootstrap interval of mean(B) - mean(A) over repeats (e.g. throughput per repeat)."""
    if not a or not b:
        return None
    xa, xb = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    rng = np.random.default_rng(seed)
    diffs = rng.choice(xb, (RESAMPLES, len(xb))).mean(axis=1) - rng.choice(
        xa, (RESAMPLES, len(xa))
    ).mean(axis=1)
    return _interval(diffs, float(xb.mean() - xa.mean()))


@dataclass(slots=True)
class Runs:
    """One cell's valid repeats for one stage: successful latencies and throughput per repeat,
    the failures among them; and how many repeats of the stage were INVALID (left out)."""

    latencies: list[list[float]]
    throughput: list[float]
    failed: int
    invalid: int = 0
    failure_rate: list[float] = field(default_factory=list)


def stage_runs(results: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Runs]]:
    """(cell label without the compared dimension, compared value) -> load -> Runs, from the
    experiment's results (each run's records.jsonl next to its report). A load is "N/s" for a
    stage of an open-model profile, "burst N" for the bursts of size N."""
    out: dict[tuple[str, str], dict[str, Runs]] = defaultdict(dict)
    for r in results:
        if "summary" not in r:
            continue
        cell = r["cell"]
        key = (f"{cell['backend']}/{cell['pool_mode']}/{cell['profile']}", cell["sshd"])
        by_stage: dict[str, list[Record]] = defaultdict(list)
        for rec in read_jsonl(Path(r["report"]).parent / "records.jsonl"):
            if not rec.warmup:
                load = f"burst {rec.burst_size}" if rec.kind == "burst" else f"{rec.rate:g}/s"
                by_stage[load].append(rec)
        valid = {f"{st['offered_rate']:g}/s": st["validity"]["valid"]
                 for st in r["summary"].get("stages", [])}  # fmt: skip
        for load, recs in by_stage.items():
            runs = out[key].setdefault(load, Runs([], [], 0))
            if not valid.get(load, True):
                runs.invalid += 1
                continue
            ok = [x.latency_ms for x in recs if x.ok]
            if recs[0].kind == "burst":
                # Bursts of one size in one run are taken together: successes per second of
                # the time from the first release to the last answer.
                span = max(x.t + x.latency_ms / 1000 for x in recs) - min(x.t for x in recs)
                runs.throughput.append(len(ok) / span if span > 0 else 0.0)
            else:
                st = next(s for s in r["summary"]["stages"] if f"{s['offered_rate']:g}/s" == load)
                runs.throughput.append(st["throughput"] or 0.0)
            runs.latencies.append(ok)
            runs.failed += len(recs) - len(ok)
            runs.failure_rate.append((len(recs) - len(ok)) / len(recs))
    return out


def verdicts(
    results: list[dict[str, Any]], baseline: str = "stock", candidate: str = "tuned"
) -> list[dict[str, Any]]:
    """Per cell pair and offered load: p99 and throughput differences (candidate - baseline)
    with their intervals and verdicts."""
    runs = stage_runs(results)
    rows = []
    for (label, value), stages in sorted(runs.items()):
        if value != candidate or (label, baseline) not in runs:
            continue
        base = runs[(label, baseline)]
        for load, cand in sorted(stages.items()):
            if load not in base:
                continue
            ref = base[load]
            p99 = p99_difference(ref.latencies, cand.latencies)
            thr = mean_difference(ref.throughput, cand.throughput)
            fail = mean_difference(ref.failure_rate, cand.failure_rate)
            missing = "no data" if ref.throughput and cand.throughput else "no valid run"
            rows.append(
                {
                    "cells": label,
                    "load": load,
                    "repeats": (len(ref.throughput), len(cand.throughput)),
                    "invalid": (ref.invalid, cand.invalid),
                    "failed": (ref.failed, cand.failed),
                    "p99_diff_ms": p99,
                    "p99_verdict": p99.verdict(True, candidate) if p99 else missing,
                    "throughput_diff": thr,
                    "throughput_verdict": thr.verdict(False, candidate) if thr else missing,
                    "failure_rate_diff": fail,
                    "failure_rate_verdict": fail.verdict(True, candidate) if fail else missing,
                }
            )
    return rows


def render(rows: list[dict[str, Any]], baseline: str = "stock", candidate: str = "tuned") -> str:
    def iv(i: Interval | None) -> str:
        return "-" if i is None else f"{i.point:+.1f} [{i.low:+.1f}, {i.high:+.1f}]"

    lines = [
        f"## Verdicts: {candidate} against {baseline}",
        "",
        f"Differences {candidate} - {baseline} with {CONFIDENCE:.0%} hierarchical bootstrap "
        f"intervals over the valid repeats ({RESAMPLES} resamples; a repeat whose stage was "
        "INVALID is left out); failures are not in the p99.",
        "",
        "| cells | load | valid repeats | INVALID | failed | p99 diff ms | p99 "
        "| throughput diff /s | throughput | failure rate diff | failure rate |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        fail = r["failure_rate_diff"]
        fail_iv = (
            "-" if fail is None else (f"{fail.point:+.1%} [{fail.low:+.1%}, {fail.high:+.1%}]")
        )
        lines.append(
            f"| {r['cells']} | {r['load']} | {r['repeats'][0]}, {r['repeats'][1]} | "
            f"{r['invalid'][0]}, {r['invalid'][1]} | "
            f"{r['failed'][0]}, {r['failed'][1]} | {iv(r['p99_diff_ms'])} | {r['p99_verdict']} | "
            f"{iv(r['throughput_diff'])} | {r['throughput_verdict']} | "
            f"{fail_iv} | {r['failure_rate_verdict']} |"
        )
    return "\n".join(lines)
