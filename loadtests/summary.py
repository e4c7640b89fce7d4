"""From raw records to the numbers of a run: HdrHistogram percentiles (successes only, warm-up
left out), errors by kind, per-stage and per-burst-size tables, Server-Timing stages, and the
validity verdicts (the run's, and each stage's). Pure functions over lists of Record."""

from __future__ import annotations

import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from loadtests import hdr
from loadtests.records import DROPPED, Record

# A send more than this after its intended time is late: the generator, not the server, set
# the pace. Above LATE_FRACTION late sends, or any dropped arrival, or a busy generator CPU, the
# run measured the generator and says so.
LATE_MS = 10.0
LATE_FRACTION = 0.01
CPU_LIMIT = 80.0  # percent of one core, 90th percentile of the generator's samples
# The API's own refusals: rate limits and per-identity caps (429), admission and saturation
# (503). A run whose failures are mostly these, at more than LIMITED_FRACTION of its requests,
# measured the limits rather than the service, and says so beside its validity.
REFUSALS = (429, 503)
LIMITED_FRACTION = 0.01
# The generator samples its own CPU this often: each sample is (Unix time, percent of one core)
# over the interval that ends at its time, so a stage is judged by the samples of its own time.
CPU_INTERVAL = 1.0
CpuSamples = Mapping[str, Sequence[Sequence[float]]]  # worker -> [(time, percent), ...]


def _pcts(values: Sequence[float]) -> dict[str, float | int | None]:
    return hdr.percentiles(hdr.histogram(values))


def _errors(records: Sequence[Record]) -> dict[str, int]:
    return dict(Counter(r.error for r in records if not r.ok).most_common())


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)] if ordered else 0.0


def validity(measured: Sequence[Record], cpu: CpuSamples) -> dict[str, Any]:
    """valid + the reasons it is not: late sends (open model), dropped arrivals, a busy
    generator CPU. A valid closed-model run is still only what it is: its latency starts at the
    actual send, so a stalled server delays sends instead of showing in latency."""
    reasons: list[str] = []
    sent = [r for r in measured if r.error != DROPPED]
    # Only the open model promises send times. A burst's lateness is how long one process takes
    # to put N requests on the wire after the release: part of the burst, shown, not judged.
    late = sum(1 for r in sent if r.kind == "open" and r.lateness_ms > LATE_MS)
    dropped = sum(1 for r in measured if r.error == DROPPED)
    cpu_p90 = {w: _quantile([p for _, p in s], 0.9) for w, s in cpu.items() if s}
    if sent and late / len(sent) > LATE_FRACTION:
        reasons.append(
            f"{late} of {len(sent)} requests ({100 * late / len(sent):.1f}%) were sent more than "
            f"{LATE_MS:g} ms after their intended time: the generator fell behind"
        )
    if dropped:
        reasons.append(
            f"{dropped} arrivals dropped at the in-flight cap: their latency is missing, "
            "percentiles are understated (the server saturated or the cap is too low)"
        )
    busy = {w: v for w, v in cpu_p90.items() if v > CPU_LIMIT}
    if busy:
        reasons.append(
            "generator CPU p90 above "
            f"{CPU_LIMIT:g}%: " + ", ".join(f"{w} {v:.0f}%" for w, v in sorted(busy.items()))
        )
    return {
        "valid": not reasons,
        "reasons": reasons,
        "limited": limited(sent),
        "late": late,
        "late_threshold_ms": LATE_MS,
        "lateness_ms": _pcts([max(0.0, r.lateness_ms) for r in sent]) if sent else None,
        "dropped": dropped,
        "generator_cpu_p90": cpu_p90,
    }


def limited(sent: Sequence[Record]) -> list[str]:
    """Why a run (valid or not) is not a plain measurement of the service: most of its requests
    failed, or its failures are mostly the API's own refusals. Empty when neither."""
    failed = [r for r in sent if not r.ok]
    refused = Counter(f"http {r.status}" for r in failed if r.status in REFUSALS)
    found = []
    if sent and 2 * len(failed) > len(sent):
        found.append(f"most requests failed ({len(failed)} of {len(sent)})")
    total = sum(refused.values())
    if 2 * total > len(failed) and total > LIMITED_FRACTION * len(sent):
        kinds = ", ".join(f"{k}: {n}" for k, n in sorted(refused.items()))
        found.append(
            f"{total} of {len(failed)} failures were the API's own limits refusing ({kinds}): "
            "the run measured its rate limits, caps or admission, not the service"
        )
    return found


def _group(records: Sequence[Record]) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    timed = [r for r in ok if r.server]
    span = (max(r.t for r in records) - min(r.t for r in records)) if len(records) > 1 else 0.0
    return {
        "requests": len(records),
        "ok": len(ok),
        "failed": len(records) - len(ok),
        "errors": _errors(records),
        "latency_ms": _pcts([r.latency_ms for r in ok]),
        "service_ms": _pcts([r.service_ms for r in ok]),
        # How late the sends left: the generator's part of `latency_ms` (open model).
        "lateness_ms": _pcts([max(0.0, r.lateness_ms) for r in records if r.error != DROPPED]),
        # Successes per second over the span of intended times (the achieved throughput).
        "throughput": len(ok) / span if span > 0 else None,
        "server_timing_ms": server_timing(ok),
        # What no Server-Timing stage covers: the HTTP round trip, the framework, the handler's
        # own work between stages, the client's parse. With the stages, where a latency went.
        "untimed_ms": _pcts([max(0.0, r.service_ms - sum(r.server.values())) for r in timed]),
        "breakdown_ms": breakdown(timed),
    }


SENT_LATE = "sent late"
UNTIMED = "untimed"


def breakdown(timed: Sequence[Record]) -> dict[str, dict[str, float | None]]:
    """Where each latency went, in parts that add up, per request: the send's lateness (from the
    intended time or the burst's release to the send: latency minus service time), each
    Server-Timing stage (0 where a request lacks it), and the untimed rest of the round trip
    (service time minus the stages: the network, the API's accept queue and event loop before
    its timing middleware, the framework, the answer's way back, the client's read). Per part:
    the mean, which adds up to the mean latency over the parts, and the p50 and p99 (which do
    not add: each is its own part's)."""
    if not timed:
        return {}
    names = sorted({name for r in timed for name in r.server})
    parts: dict[str, list[float]] = {SENT_LATE: [r.latency_ms - r.service_ms for r in timed]}
    for name in names:
        parts[name] = [r.server.get(name, 0.0) for r in timed]
    parts[UNTIMED] = [r.service_ms - sum(r.server.values()) for r in timed]
    parts["total"] = [r.latency_ms for r in timed]
    return {
        name: {
            "mean": round(statistics.fmean(values), 3),
            "p50": round(_quantile(values, 0.5), 3),
            "p99": round(_quantile(values, 0.99), 3),
        }
        for name, values in parts.items()
    }


def server_timing(records: Sequence[Record]) -> dict[str, dict[str, float | int | None]]:
    """Percentiles of each Server-Timing stage over the successes among `records`."""
    stages: dict[str, list[float]] = defaultdict(list)
    for r in records:
        if r.ok:
            for name, ms in r.server.items():
                stages[name].append(ms)
    return {name: _pcts(values) for name, values in stages.items()}


def during(cpu: CpuSamples, records: Sequence[Record]) -> dict[str, list[Sequence[float]]]:
    """The CPU samples whose interval overlaps the intended send times of `records`."""
    start, end = min(r.t for r in records), max(r.t for r in records)
    return {
        w: [s for s in samples if s[0] > start and s[0] - CPU_INTERVAL < end]
        for w, samples in cpu.items()
    }


def summarize(records: Sequence[Record], meta: dict[str, Any], cpu: CpuSamples) -> dict[str, Any]:
    """The content of summary.json. `latency_hdr` (base64 HdrHistogram of the successful
    measured latencies, microseconds) lets the experiment runner merge repeats exactly."""
    measured = [r for r in records if not r.warmup]
    ok = [r for r in measured if r.ok]
    out: dict[str, Any] = {
        "meta": meta,
        "warmup_requests": len(records) - len(measured),
        **_group(measured),
        "validity": validity(measured, cpu),
        "latency_hdr": hdr.encode(hdr.histogram(r.latency_ms for r in ok)),
    }
    stages: dict[int, list[Record]] = defaultdict(list)
    for r in measured:
        stages[r.stage].append(r)
    if any(r.kind != "burst" for r in measured):
        # Each stage is judged on its own: a last step past what the generator can send
        # leaves the run INVALID, not the steps before it (where the targets are read).
        out["stages"] = [
            {
                "stage": n,
                "offered_rate": group[0].rate,
                **_group(group),
                "validity": validity(group, during(cpu, group)),
            }
            for n, group in sorted(stages.items())
        ]
    else:
        out["bursts"] = bursts(measured)
    return out


def bursts(records: Sequence[Record]) -> list[dict[str, Any]]:
    """Per burst size: latency percentiles over all its repeats, and the makespans (release to
    the last answer, failures included) of each repeat."""
    by_burst: dict[int, list[Record]] = defaultdict(list)
    for r in records:
        by_burst[r.stage].append(r)
    by_size: dict[int, list[list[Record]]] = defaultdict(list)
    for group in by_burst.values():
        by_size[group[0].burst_size].append(group)
    rows = []
    for size, groups in sorted(by_size.items()):
        flat = [r for g in groups for r in g]
        makespans = [max(r.latency_ms for r in g) for g in groups]
        # Where the median answer lands within its burst: near 0.5 when requests are served
        # first come first served at a steady rate, near 1.0 when nearly all wait for the end.
        medians = [statistics.median(r.latency_ms for r in g) for g in groups]
        rows.append(
            {
                "size": size,
                **_group(flat),
                "makespan_ms": makespans,
                "p50_over_makespan": [
                    round(m / span, 3) if span else None
                    for m, span in zip(medians, makespans, strict=True)
                ],
                "repeats": len(groups),
            }
        )
    return rows
