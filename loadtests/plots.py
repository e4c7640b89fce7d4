"""The report's figures (matplotlib, Agg: no display). Each function writes one PNG and returns
its file name, or None when the run has nothing to show in it."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator

from loadtests import hdr
from loadtests.records import Record

LINES = (("p50", "tab:blue"), ("p90", "tab:green"), ("p99", "tab:orange"), ("p99.9", "tab:red"))


def _save(fig: Any, out: Path, name: str) -> str:
    fig.tight_layout()
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    return name


def vs_offered_load(stages: Sequence[dict[str, Any]], out: Path) -> str | None:
    rows = [s for s in stages if s["latency_ms"]["count"]]
    if len(rows) < 2:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    rates = [s["offered_rate"] for s in rows]
    for key, color in LINES:
        ax.plot(rates, [s["latency_ms"][key] for s in rows], "o-", color=color, label=key)
    ax.set(xlabel="offered load (requests/s)", ylabel="latency (ms, log)", yscale="log")
    ax.set_title("Latency percentiles vs offered load (successes, from intended send time)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return _save(fig, out, "percentiles_vs_load.png")


def over_time(records: Sequence[Record], out: Path, window: float = 1.0) -> str | None:
    fig = over_time_figure(records, window)
    return None if fig is None else _save(fig, out, "percentiles_over_time.png")


def over_time_figure(records: Sequence[Record], window: float = 1.0) -> Any:
    """Percentiles per window, failures as bars. A window without successes breaks the lines
    (a NaN point): a cool-down between bursts or stages is not drawn as a slope across it."""
    if not records:
        return None
    t0 = min(r.t for r in records)
    ok: dict[int, list[float]] = defaultdict(list)
    failed: dict[int, int] = defaultdict(int)
    for r in records:
        slot = int((r.t - t0) / window)
        if r.ok:
            ok[slot].append(r.latency_ms)
        else:
            failed[slot] += 1
    slots = sorted(set(ok) | set(failed))
    # One histogram per window (not one per line), and only the quantiles drawn.
    drawn = [key for key, _ in LINES[:3]]
    values = {s: hdr.quantiles(hdr.histogram(ok[s]), drawn) for s in ok}
    fig, ax = plt.subplots(figsize=(9, 4))
    for key, color in LINES[:3]:
        xs: list[float] = []
        ys: list[float] = []
        for s in sorted(ok):
            if xs and s * window - xs[-1] > window:
                xs.append(xs[-1] + window)
                ys.append(math.nan)
            # A slot with successes has every percentile (None only for an empty histogram).
            value = values[s][key]
            xs.append(s * window)
            ys.append(math.nan if value is None else value)
        # Markers: a burst is one window, so a run of bursts is points, not lines.
        ax.plot(xs, ys, ".-", color=color, label=key)
    ax.set(xlabel="seconds since start (intended send time)", ylabel="latency (ms, log)")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    errors = ax.twinx()
    errors.bar(
        [s * window for s in slots], [failed[s] for s in slots], width=window, color="tab:red",
        alpha=0.35, label="failed/dropped",
    )  # fmt: skip
    # Counts from 0; with no failure at all matplotlib would centre the axis on 0 (-0.04..0.04).
    errors.set_ylim(0, max(1, *failed.values()) * 1.1 if failed else 1)
    errors.yaxis.set_major_locator(MaxNLocator(integer=True))
    errors.set_ylabel("failed or dropped per window")
    lines, labels = ax.get_legend_handles_labels()
    bars, bar_labels = errors.get_legend_handles_labels()
    ax.legend(lines + bars, labels + bar_labels, loc="upper left")
    ax.set_title(f"Latency percentiles per {window:g} s window, with failures")
    return fig


def distribution(records: Sequence[Record], out: Path) -> str | None:
    """The HdrHistogram percentile spectrum: latency against 1/(1-q) on a log axis, so the tail
    (99%, 99.9%) gets as much room as the median."""
    hist = hdr.histogram(r.latency_ms for r in records if r.ok)
    if not hist.get_total_count():
        return None
    quantiles = [50, 75, 90, 95, 99, 99.5, 99.9, 99.95, 99.99, 100]
    xs = [1 / (1 - q / 100) if q < 100 else 1e5 for q in quantiles]
    ys = [hist.get_value_at_percentile(q) / 1000 for q in quantiles]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(xs, ys, "o-")
    ax.set_xscale("log")
    ax.set_xticks(xs, [f"{q:g}%" if q < 100 else "max" for q in quantiles], rotation=45)
    ax.minorticks_off()
    ax.set(xlabel="percentile", ylabel="latency (ms)", title="Latency distribution (successes)")
    ax.grid(True, alpha=0.3)
    return _save(fig, out, "latency_distribution.png")


def burst_makespan(rows: Sequence[dict[str, Any]], out: Path) -> str | None:
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    sizes = [r["size"] for r in rows]
    for r in rows:
        ax.scatter([r["size"]] * len(r["makespan_ms"]), r["makespan_ms"], color="tab:gray", s=12)
    medians = [statistics.median(r["makespan_ms"]) for r in rows]
    ax.plot(sizes, medians, "o-", color="tab:red", label="makespan (median; dots: each repeat)")
    for key, color in LINES[:3]:
        ax.plot(sizes, [r["latency_ms"][key] for r in rows], "o--", color=color, label=key)
    ax.set(xlabel="burst size (simultaneous requests)", ylabel="ms", title="Burst size vs makespan")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return _save(fig, out, "burst_makespan.png")
