"""Writes a run's directory: summary.json, records.jsonl (one line per request), the plots, and
report.md that shows them with the tables."""

from __future__ import annotations

import json
import platform
import statistics
from collections.abc import Sequence
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from loadtests import plots
from loadtests.records import Record, write_jsonl
from loadtests.summary import CpuSamples, summarize

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("sshapi", "locust", "hdrhistogram", "asyncssh", "paramiko", "ssh2-python", "uvicorn")


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    try:
        from sshpool.devhost import sshd_version

        out["openssh"] = ".".join(map(str, sshd_version()))
    except Exception:  # no sshd on the generator machine: the server side reports its own
        pass
    return out


def run_dir(base: Path, name: str) -> Path:
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    path = base / f"{stamp}-{name}"
    n = 1
    while path.exists():
        n += 1
        path = base / f"{stamp}-{name}-{n}"
    path.mkdir(parents=True)
    return path


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def _pct_cells(p: dict[str, Any]) -> str:
    return " | ".join(_ms(p[k]) for k in ("p50", "p90", "p99", "p99.9", "max"))


PCT_HEAD = "p50 | p90 | p99 | p99.9 | max"


def render(summary: dict[str, Any], images: dict[str, str | None]) -> str:
    meta = summary["meta"]
    v = summary["validity"]
    lines = [f"# Load run: {meta.get('title', 'run')}", ""]
    if v["valid"]:
        lines.append("**Valid run**: the generator kept its schedule (see Validity).")
    else:
        lines.append("**INVALID RUN**: the generator, not the server, limited it:")
        lines += [f"- {reason}" for reason in v["reasons"]]
    if v.get("limited"):
        lines += ["", "**LIMITED**: not a plain measurement of the service:"]
        lines += [f"- {reason}" for reason in v["limited"]]
    lines += [
        "",
        f"Model: **{meta.get('model')}** ({meta.get('latency_from')}). Connection: "
        f"**{meta.get('connection')}**. Percentiles: HdrHistogram, 3 significant digits, "
        "successes only, warm-up left out; all times in ms.",
        "",
        f"| requests | ok | failed | {PCT_HEAD} |",
        "|---|---|---|---|---|---|---|---|",
        f"| {summary['requests']} | {summary['ok']} | {summary['failed']} | "
        f"{_pct_cells(summary['latency_ms'])} |",
        "",
    ]
    if summary["errors"]:
        lines += ["Errors by kind: " + ", ".join(f"{k} {n}" for k, n in summary["errors"].items())]
        lines.append("")
    if "stages" in summary:
        lines += [
            "## Per stage",
            "",
            f"| offered/s | achieved/s | requests | failed | {PCT_HEAD} | service p50 | p99 "
            "| sent late p50 | stage |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for s in summary["stages"]:
            lines.append(
                f"| {s['offered_rate']:g} | {_ms(s['throughput'])} | {s['requests']} | "
                f"{s['failed']} | {_pct_cells(s['latency_ms'])} | {_ms(s['service_ms']['p50'])} "
                f"| {_ms(s['service_ms']['p99'])} | {_ms(s['lateness_ms']['p50'])} | "
                f"{_stage_verdict(s['validity'])} |"
            )
    if "bursts" in summary:
        lines += [
            "## Per burst size",
            "",
            f"| size | repeats | failed | {PCT_HEAD} | makespan median | makespan max |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for b in summary["bursts"]:
            lines.append(
                f"| {b['size']} | {b['repeats']} | {b['failed']} | {_pct_cells(b['latency_ms'])} "
                f"| {_ms(statistics.median(b['makespan_ms']))} | {_ms(max(b['makespan_ms']))} |"
            )
    lines += ["", "## Server-Timing stages (successes)", "", f"| stage | {PCT_HEAD} |"]
    lines.append("|---|---|---|---|---|---|")
    for name, p in summary["server_timing_ms"].items():
        lines.append(f"| {name} | {_pct_cells(p)} |")
    lines += _breakdown(summary.get("breakdown_ms") or {})
    lines += ["", "## Plots", ""]
    lines += [f"![{name}]({file})" for name, file in images.items() if file]
    late = v["lateness_ms"] or {}
    gen = meta.get("generator_cpu") or {}
    lines += [
        "",
        "## Validity",
        "",
        f"- late sends (open model, > {v['late_threshold_ms']:g} ms after intended): "
        f"{v['late']}; send lateness (bursts: spread after the release) p99 "
        f"{_ms(late.get('p99'))} ms, max {_ms(late.get('max'))} ms",
        f"- dropped arrivals (in-flight cap): {v['dropped']}",
        "- generator CPU p90: "
        + (", ".join(f"{w} {c:.0f}%" for w, c in v["generator_cpu_p90"].items()) or "-"),
        f"- generator CPU per request: {_ms(gen.get('ms_per_request'))} ms "
        f"({gen.get('seconds', '-')} s over {gen.get('requests', '-')} requests)",
        "",
        "## Metadata",
        "",
        "```json",
        json.dumps(meta, indent=2, sort_keys=True),
        "```",
        "",
    ]
    return "\n".join(lines)


# What each part of the breakdown is, beside its name (loadtests.summary.breakdown).
PARTS = {
    "sent late": "the generator: intended time (a burst's release) to the send",
    "untimed": "no Server-Timing stage: the network, the API's accept queue and event loop before "
    "its timing middleware, the framework, the answer's way back",
    "total": "the latency",
}


def _breakdown(parts: dict[str, dict[str, float | None]]) -> list[str]:
    """Where the time went: the parts of each latency, whose means add up to the mean latency."""
    if not parts:
        return []
    lines = [
        "",
        "## Where the time went (successes with Server-Timing)",
        "",
        "Each latency in parts: the send's lateness, the server's stages, and the untimed rest "
        "of the round trip. The means add up to the total's; the percentiles are each part's "
        "own and do not add.",
        "",
        "| part | mean | p50 | p99 | what |",
        "|---|---|---|---|---|",
    ]
    for name, p in parts.items():
        what = PARTS.get(name, "Server-Timing stage")
        lines.append(f"| {name} | {_ms(p['mean'])} | {_ms(p['p50'])} | {_ms(p['p99'])} | {what} |")
    return lines


def _stage_verdict(v: dict[str, Any]) -> str:
    """A stage's own validity: `valid`, or INVALID and why (the same reasons as the run's)."""
    verdict = "valid" if v["valid"] else "INVALID: " + "; ".join(v["reasons"])
    return verdict + "".join(f"; LIMITED: {reason}" for reason in v.get("limited", []))


def write_run(
    out: Path, records: Sequence[Record], meta: dict[str, Any], cpu: CpuSamples
) -> dict[str, Any]:
    """Everything about one run into `out`; returns the summary."""
    summary = summarize(records, meta, cpu)
    write_jsonl(out / "records.jsonl", records)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    measured = [r for r in records if not r.warmup]
    images = {
        "percentiles vs offered load": plots.vs_offered_load(summary.get("stages", []), out),
        "percentiles over time": plots.over_time(records, out),
        "latency distribution": plots.distribution(measured, out),
        "burst size vs makespan": plots.burst_makespan(summary.get("bursts", []), out),
    }
    (out / "report.md").write_text(render(summary, images))
    return summary
