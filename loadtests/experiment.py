"""The experiment runner: one command runs a matrix of backend x sshd profile x pool mode x load
profile with interleaved repeats, and writes one comparison report, verdicts first.

    python -m loadtests.experiment                      # --profile limits: where sshd's limits bite
    python -m loadtests.experiment --profile matrix     # light steady load, pooled+per-request
    python -m loadtests.experiment --sshd-binary /tmp/sshapi-openssh10-0/root/usr/sbin/sshd
    python -m loadtests.experiment --backends asyncssh paramiko --profiles smoke paper \\
        --repeats 3 --duration-factor 0.5

Every cell gets its own API process (fresh pool and job store) against one sshd per profile
(started once, on loopback); the Locust run is `loadtests/sustained.py` (open model) or, for the
profile `burst`, `loadtests/burst.py`. Repeats are interleaved, in a different order each round,
so drift of a shared machine spreads over the cells instead of biasing one. Percentiles of a
cell merge the HdrHistograms of its repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import os
import random
import re
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sqlalchemy.engine import make_url

from loadtests import hdr, recommend
from loadtests.cpu import CpuMeter
from loadtests.replicas import drop_schema
from loadtests.report import run_dir, versions
from loadtests.schedule import PROFILES
from loadtests.server import POOL_MODES, limits, start_api, stop_api
from loadtests.verdict import render as render_verdicts
from loadtests.verdict import verdicts

REPO = Path(__file__).resolve().parent.parent
LOCUST = Path(sys.executable).parent / "locust"
REPORT_LINE = re.compile(r"^report: (.+report\.md)$", re.M)
# What sshd logs when one of its limits refuses the API: a handshake dropped past MaxStartups
# (or PerSourceMaxStartups), a channel refused past MaxSessions, a source penalized.
SSHD_REFUSALS = {
    # "past MaxStartups" before OpenSSH 9.8, "Maxstartups" (or "PerSourceMaxStartups") after.
    "MaxStartups": re.compile(r"drop connection .*maxstartups|beginning maxstartups", re.I),
    "MaxSessions": re.compile(r"no more sessions|open_session.*refused", re.I),
    "penalty": re.compile(r"penalt", re.I),
}


@dataclass(frozen=True, slots=True)
class Cell:
    backend: str
    sshd: str
    pool_mode: str
    profile: str

    @property
    def label(self) -> str:
        return f"{self.backend}/{self.sshd}/{self.pool_mode}/{self.profile}"


def matrix(
    backends: list[str], sshd: list[str], pool_modes: list[str], profiles: list[str]
) -> list[Cell]:
    return [Cell(*c) for c in itertools.product(backends, sshd, pool_modes, profiles)]


def rounds(cells: list[Cell], repeats: int, seed: int) -> list[tuple[int, Cell]]:
    """Every cell once per round, each round in its own shuffled order (seeded: reproducible)."""
    rng = random.Random(seed)
    order: list[tuple[int, Cell]] = []
    for r in range(repeats):
        shuffled = list(cells)
        rng.shuffle(shuffled)
        order += [(r, c) for c in shuffled]
    return order


def locust_argv(cell: Cell, url: str, args: argparse.Namespace, meta: dict[str, Any]) -> list[str]:
    common = ["--headless", "-H", url, "--report-dir", str(args.out / "runs")]
    common += ["--run-meta", json.dumps(meta), "--connection", args.connection]
    if cell.profile == "burst":
        sizes = [str(s) for s in args.burst_sizes]
        return [str(LOCUST), "-f", str(REPO / "loadtests" / "burst.py"), *common,
                "--burst-sizes", *sizes, "--repeats", "1", "--cooldown", "1"]  # fmt: skip
    factor = str(args.duration_factor)
    return [str(LOCUST), "-f", str(REPO / "loadtests" / "sustained.py"), *common,
            "--load-profile", cell.profile, "--duration-factor", factor]  # fmt: skip


def run_cell(cell: Cell, repeat: int, host: Any, args: argparse.Namespace) -> dict[str, Any]:
    """One run: a fresh API for the cell, one Locust run, its summary (or why there is none)."""
    work = args.out / "api" / f"{len(list((args.out / 'api').glob('*'))):03d}"
    lim = limits(cell.pool_mode)
    meta = {**asdict(cell), "sshd_profile": cell.sshd, "repeat": repeat,
            "pool_limits": dataclasses.asdict(lim), "sshd_port": host.port}  # fmt: skip
    workers = getattr(args, "workers", 1)
    meta["workers"] = workers
    api_env = {"SSHAPI_WORKERS": str(workers)}
    database_url = getattr(args, "database_url", None)
    if database_url:
        # PostgreSQL: a fresh schema per run (dropped after), as a fresh SQLite file would be.
        api_env["SSHAPI_DATABASE_URL"] = database_url
        api_env["SSHAPI_DATABASE_SCHEMA"] = f"sshapi_bench_{uuid.uuid4().hex[:12]}"
        meta["store"] = make_url(database_url).render_as_string(hide_password=True)
    proc, url = start_api(
        host, backend=cell.backend, pool_mode=cell.pool_mode, data_dir=work,
        log=work / "api.log", env=api_env,
    )  # fmt: skip
    try:
        env = {**os.environ, "SSHAPI_DATA_DIR": str(work)}
        env.pop("SSHAPI_TOKEN", None)
        env.pop("SSHAPI_CONFIG", None)
        log_start = host.log_path.stat().st_size if host.log_path.exists() else 0
        meter = CpuMeter(proc.pid, host.pid).start()
        done = subprocess.run(
            locust_argv(cell, url, args, meta), env=env, capture_output=True, text=True,
            timeout=args.run_timeout,
        )  # fmt: skip
        found = REPORT_LINE.search(done.stdout + done.stderr)
        summary = (
            json.loads((Path(found.group(1)).parent / "summary.json").read_text())
            if found
            else None
        )
        gen = (summary or {}).get("meta", {}).get("generator_cpu") or {}
        cpu = meter.stop(int(gen.get("requests") or 0), gen.get("seconds"))
    finally:
        stop_api(proc)
        if database_url:
            asyncio.run(drop_schema(database_url, api_env["SSHAPI_DATABASE_SCHEMA"]))
    (work / "locust.log").write_text(done.stdout + done.stderr)
    with open(host.log_path, "rb") as log:
        log.seek(log_start)
        sshd_log = log.read().decode(errors="replace")
    refusals = {k: len(pattern.findall(sshd_log)) for k, pattern in SSHD_REFUSALS.items()}
    if not found or summary is None:
        return {"cell": asdict(cell), "repeat": repeat, "error": f"no report ({work}/locust.log)"}
    summary["cpu"] = cpu
    summary["sshd_refusals"] = refusals
    return {"cell": asdict(cell), "repeat": repeat, "exit": done.returncode,
            "report": found.group(1), "summary": summary}  # fmt: skip


def compare(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per cell: merged percentiles over repeats, counts, validity, spread of p99."""
    by_cell: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in results:
        by_cell[Cell(**r["cell"]).label].append(r)
    rows = []
    for label, runs in by_cell.items():
        ok = [r["summary"] for r in runs if "summary" in r]
        merged = hdr.percentiles(hdr.merge(s["latency_hdr"] for s in ok))
        errors: dict[str, int] = defaultdict(int)
        for s in ok:
            for kind, n in s["errors"].items():
                errors[kind] += n
        p99s = [s["latency_ms"]["p99"] for s in ok if s["latency_ms"]["p99"] is not None]
        refused: dict[str, int] = defaultdict(int)
        for s in ok:
            for kind, n in s.get("sshd_refusals", {}).items():
                refused[kind] += n
        rows.append(
            {
                "cell": label,
                **runs[0]["cell"],
                "runs": len(runs),
                "valid_runs": sum(1 for s in ok if s["validity"]["valid"]),
                "requests": sum(s["requests"] for s in ok),
                "failed": sum(s["failed"] for s in ok),
                "errors": dict(errors),
                "sshd_refusals": dict(refused),
                "latency_ms": merged,
                "p99_per_repeat": p99s,
                "stages": [s.get("stages", s.get("bursts", [])) for s in ok],
                "reports": [r.get("report") or r.get("error") for r in runs],
            }
        )
    return rows


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def render(rows: list[dict[str, Any]], meta: dict[str, Any], images: list[str]) -> str:
    lines = [
        "# Experiment comparison",
        "",
        "Open-model latency (ms) from the intended send time, successes only, warm-up left out; "
        "each cell's percentiles merge the HdrHistograms of its repeats. A cell with fewer valid "
        "runs than runs had a generator problem (see each run's report). The last column counts "
        "sshd's log lines of limits refusing the API over the cell's runs (MaxStartups: "
        "throttling begun or a handshake dropped; MaxSessions: a channel refused; penalty: "
        "PerSourcePenalties).",
        "",
        "| backend | sshd | pool mode | profile | runs (valid) | requests | failed | p50 | p90 "
        "| p99 | p99.9 | max | p99 per repeat | errors | sshd log: refused |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: r["cell"]):
        p = r["latency_ms"]
        lines.append(
            f"| {r['backend']} | {r['sshd']} | {r['pool_mode']} | {r['profile']} | "
            f"{r['runs']} ({r['valid_runs']}) | {r['requests']} | {r['failed']} | "
            + " | ".join(_ms(p[k]) for k in ("p50", "p90", "p99", "p99.9", "max"))
            + f" | {', '.join(_ms(v) for v in r['p99_per_repeat'])} | "
            + (", ".join(f"{k} {n}" for k, n in r["errors"].items()) or "-")
            + " | "
            + (", ".join(f"{k} {n}" for k, n in r["sshd_refusals"].items() if n) or "-")
            + " |"
        )
    lines += ["", *[f"![{name}]({name})" for name in images], "", "## Runs", ""]
    for r in sorted(rows, key=lambda r: r["cell"]):
        lines += [f"- {r['cell']}: " + ", ".join(str(x) for x in r["reports"])]
    lines += ["", "## Metadata", "", "```json", json.dumps(meta, indent=2), "```", ""]
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], out: Path) -> list[str]:
    import matplotlib.pyplot as plt

    import loadtests.plots  # noqa: F401 (selects the Agg backend before pyplot draws)

    rows = sorted(rows, key=lambda r: r["cell"])
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(rows)), 4.5))
    x = range(len(rows))
    for k, (key, color) in enumerate((("p50", "tab:blue"), ("p90", "tab:green"),
                                      ("p99", "tab:orange"))):  # fmt: skip
        ax.bar([i + (k - 1) * 0.27 for i in x], [r["latency_ms"][key] or 0 for r in rows],
               width=0.27, color=color, label=key)  # fmt: skip
    ax.set_xticks(list(x), [r["cell"].replace("/", "\n") for r in rows], fontsize=7)
    ax.set(ylabel="latency (ms, log)", yscale="log", title="Latency per cell (merged repeats)")
    ax.legend()
    ax.grid(True, axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "cells.png", dpi=110)
    plt.close(fig)
    images = ["cells.png"]
    series = {
        r["cell"]: [
            (st["offered_rate"], st["latency_ms"]["p99"])
            for stages in r["stages"][:1]
            for st in stages
            if "offered_rate" in st and st["latency_ms"]["p99"] is not None
        ]
        for r in rows
    }
    if any(len(v) > 1 for v in series.values()):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for label, points in series.items():
            if len(points) > 1:
                ax.plot([p[0] for p in points], [p[1] for p in points], "o-", label=label)
        ax.set(xlabel="offered load (requests/s)", ylabel="p99 (ms, log)", yscale="log",
               title="p99 vs offered load (first repeat of each cell)")  # fmt: skip
        ax.legend(fontsize=7)
        ax.grid(True, which="both", alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / "p99_vs_load.png", dpi=110)
        plt.close(fig)
        images.append("p99_vs_load.png")
    return images


def _advice(
    args: argparse.Namespace, judged: list[dict[str, Any]], rows: list[dict[str, Any]]
) -> tuple[list[recommend.Recommendation], str]:
    """The recommendation per setting of the tuned file for the sshd that ran, and its text
    ("" when the run did not compare tuned with stock)."""
    from sshpool.devhost.host import sshd_binary, sshd_version, tuned_settings

    if not {"stock", "tuned"} <= set(args.sshd):
        return [], ""
    version = sshd_version(sshd_binary(args.sshd_binary))
    settings, skipped = tuned_settings(version)
    found = recommend.recommend(settings, judged, rows, skipped)
    return found, "\n\n" + recommend.render(found, f"OpenSSH {version[0]}.{version[1]}") + "\n"


def _json(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


# What each --profile runs unless told otherwise. `limits` drives sshd where its limits bite:
# per-request connections released 100 at once (stock MaxStartups 10:30:100 drops some of
# the handshakes beyond 10 unauthenticated connections) and 16 channels on one connection
# (stock MaxSessions is 10). `matrix` is the general comparison at a steady, light load.
PRESETS: dict[str, dict[str, Any]] = {
    "limits": {
        "pool_modes": ["per-request", "channels"],
        "profiles": ["burst"],
        "repeats": 3,
        "burst_sizes": [100],
    },
    "matrix": {
        "pool_modes": ["pooled", "per-request"],
        "profiles": ["smoke"],
        "repeats": 2,
        "burst_sizes": [10, 50, 100],
    },
}


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module's docstring as written, and every option's default."""


def parse(argv: list[str] | None) -> argparse.Namespace:
    # The preset is read first so that --help shows the defaults it gives.
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--profile", choices=list(PRESETS), default="limits")
    preset = first.parse_known_args(argv)[0].profile
    p = argparse.ArgumentParser(description=__doc__, formatter_class=_Help)
    p.add_argument("--profile", choices=list(PRESETS), default="limits",
                   help="Preset of the options below (the defaults shown are its).")  # fmt: skip
    p.add_argument("--backends", nargs="+", default=["asyncssh"], help="SSH backends.")
    p.add_argument("--sshd", nargs="+", choices=["stock", "tuned"], default=["stock", "tuned"],
                   help="sshd profiles (verdicts need both).")  # fmt: skip
    p.add_argument("--sshd-binary", default=None,
                   help="sshd to run (None: the system's); OpenSSH 10.0 from `make openssh10` "
                   "brings PerSourcePenalties.")  # fmt: skip
    p.add_argument("--pool-modes", nargs="+", choices=POOL_MODES, help="Pool modes.")
    p.add_argument("--profiles", nargs="+", choices=[*PROFILES, "burst"], help="Load profiles.")
    p.add_argument("--repeats", type=int, help="Runs per cell, interleaved.")
    p.add_argument("--duration-factor", type=float, default=1.0,
                   help="Scales open-model profiles' stage durations.")  # fmt: skip
    p.add_argument("--burst-sizes", type=int, nargs="+", help="Burst sizes (profile burst).")
    p.add_argument("--connection", choices=["keep-alive", "new"], default="keep-alive",
                   help="HTTP connections of the generator.")  # fmt: skip
    p.add_argument("--seed", type=int, default=1, help="Seed of the interleaving.")
    p.add_argument("--workers", type=int, default=1, help="API worker processes per cell.")
    p.add_argument("--run-timeout", type=float, default=3600.0, help="Seconds per Locust run.")
    p.add_argument("--out", type=Path, default=Path("reports"), help="Where reports go.")
    p.set_defaults(**PRESETS[preset])
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    results = measure(parse(argv))["results"]
    return 0 if all("summary" in r for r in results) else 1


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """The matrix of `args`, each sshd profile on a rig of its own; writes and prints the
    comparison (`reports/<time>-experiment/`, which `args.out` becomes) and returns its rows,
    verdicts and runs."""
    from sshpool.devhost import Rig, RigSpec

    args.out = run_dir(args.out, "experiment")
    (args.out / "api").mkdir()
    cells = matrix(args.backends, args.sshd, args.pool_modes, args.profiles)
    order = rounds(cells, args.repeats, args.seed)
    rigs = {
        p: Rig(RigSpec(f"exp-{p}", p, sshd=args.sshd_binary), data_dir=args.out / "hosts")
        for p in args.sshd
    }
    hosts = {p: rig.start().host for p, rig in rigs.items()}
    results = []
    started = time.time()
    try:
        for n, (repeat, cell) in enumerate(order, 1):
            print(f"[{n}/{len(order)}] repeat {repeat}: {cell.label}", flush=True)
            result = run_cell(cell, repeat, hosts[cell.sshd], args)
            if "summary" in result:
                s = result["summary"]
                v = s["validity"]
                print(f"    {s['requests']} requests, {s['failed']} failed, p50 "
                      f"{_ms(s['latency_ms']['p50'])} p99 {_ms(s['latency_ms']['p99'])} ms"
                      f"{'' if v['valid'] else ' (INVALID)'}"
                      f"{' (LIMITED)' if v.get('limited') else ''}", flush=True)  # fmt: skip
            else:
                print(f"    {result['error']}", flush=True)
            results.append(result)
    finally:
        for rig in rigs.values():
            rig.stop()
    rows = compare(results)
    judged = verdicts(results)
    advice = _advice(args, judged, rows)
    meta = {"args": {k: str(v) for k, v in vars(args).items()}, "versions": versions(),
            "cpu_count": os.cpu_count(), "duration_s": round(time.time() - started),
            "load_average_end": os.getloadavg(),
            "sshd_skipped_settings": {p: h.skipped_settings for p, h in hosts.items()}}  # fmt: skip
    (args.out / "comparison.json").write_text(
        json.dumps(
            {"rows": rows, "verdicts": judged, "recommendations": advice[0], "meta": meta},
            indent=2, default=_json,
        )
    )  # fmt: skip
    # Verdicts first, then the detail, and the recommendation per setting last (the file's last
    # section, the terminal's last lines before the file's path).
    verdict_text = render_verdicts(judged) + "\n\n" if judged else ""
    detail = render(rows, meta, plot(rows, args.out))
    (args.out / "comparison.md").write_text(verdict_text + detail + advice[1])
    print(verdict_text + detail.split("\n## Runs")[0].strip() + advice[1])
    print(f"\ncomparison: {args.out / 'comparison.md'}")
    return {"rows": rows, "verdicts": judged, "results": results}


if __name__ == "__main__":
    raise SystemExit(main())
