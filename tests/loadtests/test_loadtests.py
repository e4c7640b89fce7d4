"""The load suite's pure parts: schedules, shapes, percentiles, validity, Server-Timing parsing.
(Locust itself is never imported here: it monkey-patches the process with gevent.)"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest

from loadtests import hdr
from loadtests.records import DROPPED, Record, error_kind, parse_server_timing, read_jsonl
from loadtests.report import render, write_run
from loadtests.schedule import (
    PROFILES,
    Stage,
    arrivals,
    burst_plan,
    scaled,
    share,
    split,
    stage_at,
    total_duration,
)
from loadtests.summary import LATE_MS, summarize, validity


def rec(latency: float = 10.0, **kw: object) -> Record:
    fields: dict[str, object] = {
        "kind": "open", "t": 1000.0, "latency_ms": latency, "service_ms": latency,
        "lateness_ms": 0.0, "ok": True, "status": 201, "error": "", "stage": 0, "warmup": False,
        "rate": 10.0, "burst_size": 0, "connection": "keep-alive", "worker": 0,
    }  # fmt: skip
    fields.update(kw)
    return Record(**fields)  # type: ignore[arg-type]


def test_arrivals_are_evenly_spaced_at_the_stage_rate() -> None:
    """A 2 s stage at 5/s intends 10 sends 0.2 s apart, starting at 0."""
    times = [a.t for a in arrivals([Stage(2.0, 5.0)])]
    assert len(times) == 10
    assert times[0] == 0.0
    assert all(math.isclose(b - a, 0.2) for a, b in itertools.pairwise(times))


def test_each_stage_starts_at_its_own_offset() -> None:
    """The second stage's first arrival is at the end of the first stage, whatever its rate."""
    items = arrivals([Stage(1.0, 3.0), Stage(2.0, 10.0)])
    second = [a for a in items if a.stage == 1]
    assert len(second) == 20
    assert second[0].t == 1.0
    assert [a.index for a in items] == list(range(23))


def test_paper_profile_offers_50_then_90_per_second_after_warmup() -> None:
    """`paper` has a warm-up, then the paper's two rates."""
    stages = PROFILES["paper"]
    assert stages[0].warmup
    assert [s.rate for s in stages if not s.warmup] == [50.0, 90.0]


def test_sweep_steps_up_past_the_paper_rates() -> None:
    """`sweep` rates increase monotonically and go well beyond 90/s."""
    rates = [s.rate for s in PROFILES["sweep"] if not s.warmup]
    assert rates == sorted(rates)
    assert rates[-1] > 2 * 90


def test_scaled_changes_durations_not_rates() -> None:
    """A duration factor shortens every stage and keeps the rates."""
    short = scaled(PROFILES["paper"], 0.1)
    assert [s.rate for s in short] == [s.rate for s in PROFILES["paper"]]
    assert math.isclose(total_duration(short), total_duration(PROFILES["paper"]) * 0.1)
    with pytest.raises(ValueError):
        scaled(PROFILES["smoke"], 0)


def test_shares_partition_the_schedule_exactly() -> None:
    """Three generators together send every arrival once, each at a third of the rate."""
    items = arrivals([Stage(3.0, 10.0)])
    parts = [share(items, i, 3) for i in range(3)]
    assert sorted(a.index for p in parts for a in p) == [a.index for a in items]
    assert all(len(p) == 10 for p in parts)
    with pytest.raises(ValueError):
        share(items, 3, 3)


def test_burst_plan_interleaves_sizes_across_repeats() -> None:
    """Repeats cycle through all sizes rather than repeating one size back to back."""
    plan = burst_plan([10, 50, 100], 2)
    assert [b.size for b in plan] == [10, 50, 100, 10, 50, 100]
    assert [b.repeat for b in plan] == [0, 0, 0, 1, 1, 1]
    assert [b.index for b in plan] == list(range(6))


def test_split_spreads_a_burst_over_generators() -> None:
    """A burst of 10 over 3 generators fires 4, 3, 3."""
    assert [split(10, i, 3) for i in range(3)] == [4, 3, 3]
    assert sum(split(401, i, 4) for i in range(4)) == 401


def test_stage_at_finds_the_running_stage() -> None:
    """Times map to the stage that runs then; before 0 and after the end there is none."""
    stages = [Stage(1.0, 1.0), Stage(2.0, 1.0)]
    assert [stage_at(stages, t) for t in (-0.1, 0.0, 0.99, 1.0, 2.9, 3.0)] == [
        None, 0, 0, 1, 1, None,
    ]  # fmt: skip


def test_server_timing_header_is_parsed_into_stages() -> None:
    """Durations are read per metric; a metric without a valid duration is skipped."""
    header = 'auth;dur=0.25, queue;desc="wait";dur=1.5, exec;dur=x, store'
    assert parse_server_timing(header) == {"auth": 0.25, "queue": 1.5}
    assert parse_server_timing(None) == {}


def test_error_kind_unwraps_resets_and_timeouts() -> None:
    """A reset wrapped in another exception is still a reset; socket timeouts are timeouts."""
    wrapped = RuntimeError(ConnectionResetError(104, "Connection reset by peer"))
    assert error_kind(wrapped) == "reset"
    assert error_kind(TimeoutError()) == "timeout"
    assert error_kind(ValueError("x")) == "ValueError"


def test_percentiles_keep_three_significant_digits_and_merge() -> None:
    """HDR percentiles are within 0.1% and two encoded histograms merge to the sum."""
    values = [float(v) for v in range(1, 1001)]
    p = hdr.percentiles(hdr.histogram(values))
    assert p["count"] == 1000
    assert abs(p["p99"] - 990.0) <= 1.0  # type: ignore[operator]
    merged = hdr.merge([hdr.encode(hdr.histogram(values))] * 2)
    assert merged.get_total_count() == 2000


def test_summary_counts_successes_only_and_leaves_warmup_out() -> None:
    """Failed and warm-up requests do not enter the latency percentiles."""
    records = [rec(10.0), rec(20.0), rec(5000.0, ok=False, status=503, error="http 503")]
    records.append(rec(9000.0, warmup=True))
    s = summarize(records, {}, {})
    assert s["requests"] == 3
    assert s["failed"] == 1
    assert s["errors"] == {"http 503": 1}
    assert s["latency_ms"]["count"] == 2
    assert s["latency_ms"]["max"] < 21
    assert s["warmup_requests"] == 1


def test_each_stage_says_how_late_its_sends_left() -> None:
    """The generator's part of a stage's latency, per stage; dropped arrivals were never sent."""
    records = [rec(lateness_ms=0.1, stage=0, rate=10.0) for _ in range(9)]
    records += [rec(lateness_ms=2.0, stage=1, rate=90.0) for _ in range(9)]
    records += [rec(ok=False, error=DROPPED, lateness_ms=500.0, stage=1, rate=90.0)]
    slow, fast = summarize(records, {}, {})["stages"]
    assert math.isclose(slow["lateness_ms"]["p50"], 0.1, rel_tol=0.01)
    assert math.isclose(fast["lateness_ms"]["max"], 2.0, rel_tol=0.01)


def test_each_stage_says_where_its_latency_went() -> None:
    """Per stage, the Server-Timing stages of its successes and the rest of each answer's time
    (the HTTP round trip and what runs between stages), so a low rate's figure explains itself;
    a failure's timings stay out."""
    slow = {"auth": 0.1, "open": 2.0, "exec": 1.0, "store": 0.3}
    records = [rec(6.0, stage=0, rate=10.0, server=slow) for _ in range(9)]
    records += [rec(4.0, stage=1, rate=90.0, server={**slow, "open": 1.5}) for _ in range(9)]
    records += [rec(900.0, ok=False, status=503, error="http 503", stage=1, rate=90.0,
                    server={"queue": 800.0})]  # fmt: skip
    low, high = summarize(records, {}, {})["stages"]
    assert math.isclose(low["server_timing_ms"]["open"]["p50"], 2.0, rel_tol=0.01)
    assert math.isclose(low["untimed_ms"]["p50"], 6.0 - 3.4, rel_tol=0.01)
    assert math.isclose(high["server_timing_ms"]["open"]["p50"], 1.5, rel_tol=0.01)
    assert "queue" not in high["server_timing_ms"]
    assert math.isclose(high["untimed_ms"]["p50"], 4.0 - 2.9, rel_tol=0.01)


def test_a_burst_report_says_where_all_of_its_latency_went() -> None:
    """A burst whose answers took 483 ms from the release while the server's stages account for
    26 ms (the figures of issue 44): the report's breakdown has the untimed rest and the
    sends' lateness as rows of their own, and the rows' means add up to the mean latency
    (before: only the 26 ms of stages were shown)."""
    stages = {"auth": 1.0, "exec": 20.0, "store": 5.0}
    records = [
        rec(483.0 + k, kind="burst", service_ms=463.0 + k, lateness_ms=20.0, stage=0,
            burst_size=10, server=stages)
        for k in range(10)
    ]  # fmt: skip
    s = summarize(records, {}, {})
    parts = s["breakdown_ms"]
    assert list(parts) == ["sent late", "auth", "exec", "store", "untimed", "total"]
    assert math.isclose(parts["untimed"]["mean"], 463.0 + 4.5 - 26.0)
    assert math.isclose(parts["sent late"]["mean"], 20.0)
    total = sum(p["mean"] for name, p in parts.items() if name != "total")
    assert math.isclose(total, parts["total"]["mean"]) and math.isclose(total, 487.5)
    text = render(s, {})
    assert "## Where the time went" in text
    assert "| untimed | 441.5 | 441.0 | 446.0 | no Server-Timing stage" in text
    assert "| sent late | 20.0 |" in text and "| total | 487.5 |" in text


def test_validity_flags_late_sends_drops_and_busy_cpu() -> None:
    """Each of the three generator problems makes the run invalid with its own reason."""
    ok = [rec() for _ in range(100)]
    assert validity(ok, {"local": [(1000.0 + n, 10.0) for n in range(10)]})["valid"]
    late = [rec(lateness_ms=LATE_MS * 2) for _ in range(5)] + ok
    dropped = [rec(ok=False, error=DROPPED), *ok]
    v_late = validity(late, {})
    v_drop = validity(dropped, {})
    v_cpu = validity(ok, {"worker0": [(1000.0 + n, 95.0) for n in range(10)]})
    assert not v_late["valid"] and "intended time" in v_late["reasons"][0]
    assert not v_drop["valid"] and v_drop["dropped"] == 1
    assert not v_cpu["valid"] and "worker0" in v_cpu["reasons"][0]


def test_each_stage_has_its_own_validity_verdict() -> None:
    """A last stage where the generator fell behind (late sends, its CPU busy in that stage's
    seconds only) is INVALID, and so is the run; the stages before it keep their own verdict."""
    records = [rec(t=1000.0 + n / 10, stage=0, rate=10.0) for n in range(100)]
    records += [rec(t=1010.0 + n / 90, stage=1, rate=90.0) for n in range(900)]
    records += [rec(t=1020.0 + n / 600, stage=2, rate=600.0, lateness_ms=LATE_MS * 3)
                for n in range(600)]  # fmt: skip
    # One sample a second, each over the second that ends at its time: busy only in stage 2.
    cpu = {"local": [(1001.0 + n, 95.0 if n >= 20 else 20.0) for n in range(21)]}
    s = summarize(records, {}, cpu)
    verdicts = [(st["validity"]["valid"], st["validity"]["generator_cpu_p90"]["local"])
                for st in s["stages"]]  # fmt: skip
    assert verdicts == [(True, 20.0), (True, 20.0), (False, 95.0)]
    assert len(s["stages"][2]["validity"]["reasons"]) == 2  # late sends and the busy CPU
    assert not s["validity"]["valid"]


def test_burst_lateness_is_not_judged() -> None:
    """A burst's release spread is reported but does not invalidate the run."""
    records = [rec(kind="burst", lateness_ms=50.0, burst_size=10) for _ in range(10)]
    assert validity(records, {})["valid"]


def test_bursts_report_makespan_per_repeat() -> None:
    """The makespan of a burst is its slowest request, failures included."""
    records = [rec(kind="burst", stage=0, burst_size=2, latency_ms=v) for v in (10.0, 30.0)]
    records += [rec(kind="burst", stage=1, burst_size=2, latency_ms=v) for v in (12.0, 15.0)]
    records.append(rec(kind="burst", stage=1, burst_size=2, latency_ms=99.0, ok=False, error="x"))
    (row,) = summarize(records, {}, {})["bursts"]
    assert row["size"] == 2 and row["repeats"] == 2
    assert row["makespan_ms"] == [30.0, 99.0]


def test_write_run_writes_summary_records_report_and_plots(tmp_path: Path) -> None:
    """A run directory holds summary.json, one JSON line per record, report.md and its plots."""
    records = [rec(10.0 + i, t=1000.0 + i / 10, stage=i // 20, rate=10.0 * (1 + i // 20))
               for i in range(60)]  # fmt: skip
    summary = write_run(tmp_path, records, {"title": "t"}, {"local": [(1001.0, 5.0)]})
    assert (tmp_path / "summary.json").is_file()
    assert len(list(read_jsonl(tmp_path / "records.jsonl"))) == 60
    text = (tmp_path / "report.md").read_text()
    for png in ("percentiles_vs_load.png", "percentiles_over_time.png", "latency_distribution.png"):
        assert (tmp_path / png).stat().st_size > 0
        assert png in text
    assert len(summary["stages"]) == 3


def test_over_time_breaks_its_lines_across_a_cool_down_and_counts_failures_from_zero() -> None:
    """Two bursts 5 s apart: before, the p50 line sloped across the idle seconds, and a run
    without failures drew a failures axis of -0.04..0.04."""
    from loadtests.plots import over_time_figure

    records = [rec(10.0, t=1000.0), rec(12.0, t=1000.2), rec(40.0, t=1005.0), rec(44.0, t=1005.1)]
    fig = over_time_figure(records)
    ax, failures = fig.axes
    p50 = next(line for line in ax.get_lines() if line.get_label() == "p50")
    ys = list(p50.get_ydata())
    assert len(ys) == 3 and math.isnan(ys[1])  # burst, break, burst
    assert failures.get_ylim()[0] == 0 and failures.get_ylim()[1] >= 1
    fig.clf()


def test_a_run_refused_by_the_apis_own_limits_is_not_a_plain_valid_run() -> None:
    """The issue's run: 50 requests on one identity, 41 answered 429. Before: `run VALID`."""
    records = [rec(10.0) for _ in range(9)]
    records += [rec(5.0, ok=False, status=429, error="http 429") for _ in range(41)]
    v = validity(records, {})
    assert v["valid"]  # the generator kept its schedule ...
    assert v["limited"] == [  # ... but what it measured was the limiter
        "most requests failed (41 of 50)",
        "41 of 41 failures were the API's own limits refusing (http 429: 41): the run measured "
        "its rate limits, caps or admission, not the service",
    ]
    assert "**LIMITED**" in render(summarize(records, {}, {}), {})
    # A few refusals in a large run, or failures of another kind, are no such verdict.
    healthy = [rec(10.0) for _ in range(1000)] + [rec(5.0, ok=False, status=503, error="http 503")]
    assert validity(healthy, {})["limited"] == []
    broken = [rec(10.0), rec(5.0, ok=False, status=0, error="reset")]
    assert validity(broken, {})["limited"] == []
