"""HdrHistogram helpers: one histogram layout everywhere (microseconds, 3 significant digits),
so histograms from workers and from repeats merge."""

from __future__ import annotations

from collections.abc import Iterable

from hdrh.histogram import HdrHistogram

LOWEST_US = 1
HIGHEST_US = 3_600_000_000  # one hour: nothing we time is longer
DIGITS = 3
QUANTILES = {"p50": 50.0, "p90": 90.0, "p99": 99.0, "p99.9": 99.9}


def histogram(values_ms: Iterable[float] = ()) -> HdrHistogram:
    hist = HdrHistogram(LOWEST_US, HIGHEST_US, DIGITS)
    for value in values_ms:
        hist.record_value(min(HIGHEST_US, max(LOWEST_US, round(value * 1000.0))))
    return hist


def percentiles(hist: HdrHistogram) -> dict[str, float | int | None]:
    """count, p50/p90/p99/p99.9, max and mean in milliseconds; None when empty."""
    count = hist.get_total_count()
    out: dict[str, float | int | None] = {"count": count}
    for name, q in QUANTILES.items():
        out[name] = hist.get_value_at_percentile(q) / 1000.0 if count else None
    out["max"] = hist.get_max_value() / 1000.0 if count else None
    out["mean"] = hist.get_mean_value() / 1000.0 if count else None
    return out


def encode(hist: HdrHistogram) -> str:
    """Base64 of the compressed histogram (the HdrHistogram wire format, any language reads it)."""
    encoded: bytes = hist.encode()
    return encoded.decode("ascii")


def merge(encoded: Iterable[str]) -> HdrHistogram:
    total = histogram()
    for item in encoded:
        total.decode_and_add(item)
    return total
