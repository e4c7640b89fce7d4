"""Load shapes as pure functions: the open model's intended send times, the profiles, the burst
plan, and how work splits across Locust workers. Nothing here sleeps or does I/O, so the shapes
are unit tested exactly."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Stage:
    """A constant offered rate for a while. Warm-up stages are sent but left out of results."""

    duration: float
    rate: float
    warmup: bool = False

    @property
    def label(self) -> str:
        return f"warmup {self.rate:g}/s" if self.warmup else f"{self.rate:g}/s"


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request of the open model: its index, intended send time (seconds from the start of the
    run) and the stage it belongs to."""

    index: int
    t: float
    stage: int


@dataclass(frozen=True, slots=True)
class Burst:
    """One burst: `size` requests released together. `repeat` counts from 0."""

    index: int
    size: int
    repeat: int


def _stepped(rates: list[float], step: float, warmup: float) -> list[Stage]:
    return [Stage(warmup, rates[0], warmup=True), *(Stage(step, r) for r in rates)]


# The sustained profiles. `paper` replays the rates of the paper's Locust runs (50 and 90 RPS);
# `sweep` steps past where this machine saturates; `soak` holds a moderate rate for long.
PROFILES: dict[str, list[Stage]] = {
    "smoke": [Stage(2.0, 5.0, warmup=True), Stage(10.0, 10.0)],
    "paper": [Stage(5.0, 20.0, warmup=True), Stage(30.0, 50.0), Stage(30.0, 90.0)],
    "sweep": _stepped([25.0, 50.0, 100.0, 150.0, 200.0, 300.0, 400.0], step=20.0, warmup=5.0),
    "soak": [Stage(10.0, 20.0, warmup=True), Stage(1800.0, 30.0)],
    # loadtests.bench: a low rate (the API's own overhead), the paper's two rates held longer,
    # then steps past this box's knee; per-request connections saturate far lower.
    "bench": [
        Stage(5.0, 20.0, warmup=True),
        Stage(15.0, 10.0),
        Stage(20.0, 50.0),
        Stage(20.0, 90.0),
        *(Stage(10.0, r) for r in (150.0, 200.0, 250.0, 300.0, 350.0, 400.0, 500.0, 600.0)),
    ],
    # loadtests.bench's CPU row: a steady 100/s, the API's CPU per job at the rate.
    "cpu": [Stage(3.0, 20.0, warmup=True), Stage(20.0, 100.0)],
    "bench-per-request": [
        Stage(5.0, 5.0, warmup=True),
        *(Stage(10.0, r) for r in (5.0, 10.0, 20.0, 30.0)),
        Stage(20.0, 50.0),
        Stage(20.0, 90.0),
    ],
}


def scaled(stages: list[Stage], factor: float, rate_factor: float = 1.0) -> list[Stage]:
    """The same profile with every stage `factor` times as long (short runs in tests and
    experiment matrices) and `rate_factor` times the rate (a soak at another rate)."""
    if factor <= 0 or rate_factor <= 0:
        raise ValueError("the duration and rate factors must be positive")
    return [Stage(s.duration * factor, s.rate * rate_factor, s.warmup) for s in stages]


def total_duration(stages: list[Stage]) -> float:
    return sum(s.duration for s in stages)


def arrivals(stages: list[Stage]) -> list[Arrival]:
    """Intended send times at a constant spacing of 1/rate within each stage (the open model:
    the schedule never waits for answers). Each stage starts at its own offset, so a stage
    holds round(duration * rate) arrivals whatever came before."""
    out: list[Arrival] = []
    start = 0.0
    for n, stage in enumerate(stages):
        if stage.rate < 0 or stage.duration < 0:
            raise ValueError("rates and durations must be >= 0")
        count = math.floor(stage.duration * stage.rate + 1e-9)
        first = len(out)
        out.extend(Arrival(first + i, start + i / stage.rate, n) for i in range(count))
        start += stage.duration
    return out


def share(items: list[Arrival], index: int, count: int) -> list[Arrival]:
    """The arrivals one of `count` generators sends: every count-th, so each keeps the shape of
    the profile at 1/count of its rate and together they send each arrival exactly once."""
    if not 0 <= index < count:
        raise ValueError(f"generator index {index} is not in 0..{count - 1}")
    return items[index::count]


def burst_plan(sizes: list[int], repeats: int) -> list[Burst]:
    """Every size once per repeat, repeats interleaved (10, 50, ..., 10, 50, ...) so drift of the
    machine over time spreads across sizes instead of biasing one."""
    if repeats < 1 or not sizes or min(sizes) < 1:
        raise ValueError("need at least one repeat and sizes >= 1")
    return [
        Burst(r * len(sizes) + i, size, r) for r in range(repeats) for i, size in enumerate(sizes)
    ]


def split(size: int, index: int, count: int) -> int:
    """How many of a burst's `size` requests generator `index` of `count` fires: as even as
    possible, the first `size % count` generators one more."""
    if not 0 <= index < count:
        raise ValueError(f"generator index {index} is not in 0..{count - 1}")
    return size // count + (1 if index < size % count else 0)


def stage_at(stages: list[Stage], t: float) -> int | None:
    """The index of the stage running `t` seconds into the profile; None once it is over."""
    start = 0.0
    for n, stage in enumerate(stages):
        if t < start + stage.duration:
            return n if t >= 0 else None
        start += stage.duration
    return None
