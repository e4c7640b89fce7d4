"""Durations counted into fixed buckets (`Durations`), as a Prometheus histogram holds them:
what a host pool took to make a connection (`HostPool.create_time`) and what its callers
waited for a slot (`HostPool.wait_time`). Plain numbers, so the pool stays free of any metrics
library: the API reads them at scrape time (api/metrics.py) and exposes them after
OpenTelemetry's connection-pool conventions."""

from __future__ import annotations

import bisect

# Upper bounds in seconds: a slot taken at once (0) up to a queue that gave up after a minute.
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Durations:
    """Counts per bucket (non-cumulative: `counts[i]` is the observations <= `bounds[i]` and
    above the bound before; the last entry counts those above every bound), their sum and
    number. One bisect and three additions per observation."""

    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...] = BUCKETS) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.sum += seconds
        self.count += 1
