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


def quantiles(hist: HdrHistogram, names: Iterable[str] = QUANTILES) -> dict[str, float | None]:
    """The named QUANTILES in milliseconds; None when empty."""
    count = hist.get_total_count()
    return {
        n: hist.get_value_at_percentile(QUANTILES[n]) / 1000.0 if count else None for n in names
    }


def percentiles(hist: HdrHistogram) -> dict[str, float | int | None]:
    """count, p50/p90/p99/p99.9, max and mean in milliseconds; None when empty."""
    count = hist.get_total_count()
    out: dict[str, float | int | None] = {"count": count, **quantiles(hist)}
    out["max"] = hist.get_max_value() / 1000.0 if count else None
    out["mean"] = mean_us(hist) / 1000.0 if count else None
    return out


def mean_us(hist: HdrHistogram) -> float:
    """`hist.get_mean_value()`, the same number (each recorded bucket at its median equivalent
    value), from one copy of the counts array: hdrh walks every bucket up to the largest value
    with an iterator object, ~0.1 s per histogram, and a run's summary takes dozens."""
    total: int = hist.get_total_count()
    if not total:
        return 0.0
    # A decoded histogram's array may stop short of counts_len (hdrh's get_count_at_index).
    n = min(hist.counts_len, hist.encoder.payload.counts_len)
    weighted = 0
    for index, count in enumerate(hist.counts[:n]):
        if count:
            high = hist.get_highest_equivalent_value(hist.get_value_from_index(index))
            low = hist.get_lowest_equivalent_value(high)
            weighted += count * (low + ((high - low + 1) >> 1))
    return float(weighted) / total


def encode(hist: HdrHistogram) -> str:
    """Base64 of the compressed histogram (the HdrHistogram wire format, any language reads it)."""
    encoded: bytes = hist.encode()
    return encoded.decode("ascii")


def merge(encoded: Iterable[str]) -> HdrHistogram:
    total = histogram()
    for item in encoded:
        total.decode_and_add(item)
    return total
