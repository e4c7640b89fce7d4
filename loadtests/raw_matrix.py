"""sshpool alone (no HTTP) against sshd profile x pool limits, interleaved: which of the two
explains a difference in the raw ceiling?

    .venv/bin/python -m loadtests.raw_matrix                      # stock + tuned x default + local
    .venv/bin/python -m loadtests.raw_matrix --limits default local sessions12 --rounds 5

`loadtests.bench` measures the raw ceiling of each sshd profile (with the limits the API uses,
`loadtests.server.limits`, the same for both profiles) one profile after the
other, so a difference between its two rows mixes the sshd settings and the drift of a shared
machine. Here every combination runs once per round, in a different order each round, as a
closed loop of `hostname` at each --concurrency; the table gives commands/s per cell (mean and
range over rounds) and, per concurrency, the difference of each cell from the baseline (the
first profile with the first limits) with a bootstrap 95% interval over the rounds and its
verdict (`loadtests.verdict.mean_difference`). `local` and `min1` are the same limits
(LOCAL_LIMITS is the defaults with one connection kept open).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import random
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from api.local import LOCAL_LIMITS
from loadtests.backend_bench import BACKENDS, closed_loop
from loadtests.report import run_dir
from loadtests.verdict import mean_difference
from sshpool import Limits, Pool
from sshpool.devhost import LocalHost, Rig, RigSpec

COMMAND = ("hostname",)  # what loadtests.bench's raw ceiling runs
BASE = Limits()
# Named pool limits. `local` is api.local.LOCAL_LIMITS (the embedded host's, and what the API
# benchmarks use with either sshd); `s12h8` is what it was before it became the defaults; the
# single-change ones tell which difference from the defaults matters.
LIMITS: dict[str, Limits] = {
    "default": BASE,
    "local": LOCAL_LIMITS,
    "s12h8": Limits(max_connections=4, min_connections=1, max_sessions=12, max_handshakes=8),
    "sessions12": replace(BASE, max_sessions=12),
    "min1": replace(BASE, min_connections=1),
    "conns2x16": replace(BASE, max_connections=2, max_sessions=16),
}


async def measure(
    host: LocalHost, backend: str, limits: Limits, concurrency: int, duration: float
) -> dict[str, Any]:
    """A fresh pool: prewarmed, a short unmeasured run to open every slot, then the closed loop."""
    target = host.target(**asdict(limits))
    async with Pool(backend=backend) as pool:
        await pool.prewarm(target)
        await closed_loop(pool, target, concurrency, min(1.0, duration / 4), COMMAND)
        row = await closed_loop(pool, target, concurrency, duration, COMMAND)
    return {"rate": row.rate, "p50_ms": row.p50_ms, "p99_ms": row.p99_ms, "errors": row.errors}


def table(results: dict[tuple[int, str, str], list[dict[str, Any]]], args: Any) -> str:
    base = (args.sshd[0], args.limits[0])
    lines = [
        f"commands/s of `{' '.join(COMMAND)}` per cell over {args.rounds} interleaved rounds; "
        f"difference from {base[0]} sshd with `{base[1]}` limits, bootstrap 95% interval:",
        "",
        "| callers | sshd | limits | commands/s mean (min-max) | p50 ms | p99 ms | errors "
        "| difference | verdict |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (c, sshd, name), runs in sorted(results.items()):
        rates = [r["rate"] for r in runs]
        p50 = sorted(r["p50_ms"] for r in runs)[len(runs) // 2]
        p99 = sorted(r["p99_ms"] for r in runs)[len(runs) // 2]
        diff, verdict = "-", "baseline"
        if (sshd, name) != base:
            iv = mean_difference([r["rate"] for r in results[(c, *base)]], rates)
            if iv is not None:
                diff = f"{iv.point:+.0f} [{iv.low:+.0f}, {iv.high:+.0f}]"
                verdict = iv.verdict(lower_is_better=False, name=f"{sshd}/{name}")
        lines.append(
            f"| {c} | {sshd} | {name} | {sum(rates) / len(rates):.0f} ({min(rates):.0f}-"
            f"{max(rates):.0f}) | {p50:.2f} | {p99:.2f} | {sum(r['errors'] for r in runs)} "
            f"| {diff} | {verdict} |"
        )
    return "\n".join(lines)


async def run(args: argparse.Namespace) -> str:
    return table(await cells(args), args)


async def cells(args: argparse.Namespace) -> dict[tuple[int, str, str], list[dict[str, Any]]]:
    """Every cell (callers, sshd profile, limits) of `args`, in interleaved rounds, each sshd
    profile on a rig of its own: each cell's rows, one per round."""
    rigs = {p: Rig(RigSpec(f"raw-{p}", p), data_dir=args.out / "hosts") for p in args.sshd}
    hosts = {p: rig.start().host for p, rig in rigs.items()}
    results: dict[tuple[int, str, str], list[dict[str, Any]]] = {}
    cells = list(itertools.product(args.concurrency, args.sshd, args.limits))
    rng = random.Random(args.seed)
    try:
        for r in range(args.rounds):
            rng.shuffle(cells)
            for c, sshd, name in cells:
                row = await measure(hosts[sshd], args.backend, LIMITS[name], c, args.duration)
                results.setdefault((c, sshd, name), []).append(row)
                print(
                    f"round {r}: {c} callers, sshd {sshd}, limits {name}: {row['rate']:.0f}/s "
                    f"p50 {row['p50_ms']:.2f} ms (load {os.getloadavg()[0]:.1f})",
                    flush=True,
                )
    finally:
        for rig in rigs.values():
            rig.stop()
    return results


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--backend", choices=BACKENDS, default="asyncssh")
    p.add_argument("--sshd", nargs="+", choices=["stock", "tuned"], default=["stock", "tuned"])
    p.add_argument("--limits", nargs="+", choices=list(LIMITS), default=["default", "local"])
    p.add_argument("--concurrency", type=int, nargs="+", default=[8, 32], help="Callers.")
    p.add_argument("--duration", type=float, default=4.0, help="Seconds per measurement.")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("reports"))
    args = p.parse_args(argv)
    if args.rounds < 2:
        p.error("--rounds must be at least 2: one round gives no spread")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    args.out = run_dir(args.out, "raw-matrix")
    started = time.time()
    text = asyncio.run(run(args))
    load = os.getloadavg()[0]
    footer = f"\n{time.time() - started:.0f} s, load average {load:.1f} at the end"
    (args.out / "raw_matrix.md").write_text(f"# Raw matrix\n\n{text}\n{footer}\n")
    print(f"\n{text}\n{footer}\nreport: {args.out / 'raw_matrix.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
