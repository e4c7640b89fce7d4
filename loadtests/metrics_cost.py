"""What /metrics costs the API, old tree against new, interleaved in one run: API CPU per job
and per scrape. Each round starts a fresh API from each tree in turn (the base exported with
`git archive` into a scratch directory and put first on PYTHONPATH; the other: this checkout),
order alternating between rounds, on one rig host; warms it with 100 jobs, then runs `--jobs`
jobs (`true`, 8 in flight, each waited for with Prefer: wait) and `--scrapes` scrapes, and
reads the API process tree's CPU (loadtests/cpu.py) over each. One JSON line per run, then the
figures per tree, with the load average.

    python -m loadtests.metrics_cost --base c695d82 --jobs 1500 --scrapes 300 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from loadtests.cpu import tree_seconds

ROOT = Path(__file__).resolve().parents[1]
IN_FLIGHT = 8
WARM_UP = 100


async def jobs(client: httpx.AsyncClient, url: str, token: str, n: int) -> None:
    gate = asyncio.Semaphore(IN_FLIGHT)
    headers = {"Authorization": f"Bearer {token}", "Prefer": "wait=30"}

    async def one() -> None:
        async with gate:
            body = {"host": "local", "argv": ["true"]}
            r = await client.post(f"{url}/v1/jobs", json=body, headers=headers)
            if r.status_code != 201:
                raise RuntimeError(f"a job answered {r.status_code}: {r.text}")

    await asyncio.gather(*(one() for _ in range(n)))


async def measure(pid: int, url: str, token: str, n_jobs: int, n_scrapes: int) -> dict[str, float]:
    async with httpx.AsyncClient(timeout=60) as client:
        await jobs(client, url, token, WARM_UP)
        c0, t0 = tree_seconds(pid), time.perf_counter()
        await jobs(client, url, token, n_jobs)
        c1, t1 = tree_seconds(pid), time.perf_counter()
        for _ in range(n_scrapes):
            r = await client.get(f"{url}/metrics", headers={"Authorization": f"Bearer {token}"})
            r.raise_for_status()
        c2 = tree_seconds(pid)
    return {
        "api_cpu_ms_per_job": round((c1 - c0) / n_jobs * 1000, 3),
        "jobs_per_s": round(n_jobs / (t1 - t0), 1),
        "api_cpu_ms_per_scrape": round((c2 - c1) / max(1, n_scrapes) * 1000, 3),
    }


def export(commit: str, into: Path) -> Path:
    """The tree of `commit`, as files (no git metadata), under `into`."""
    into.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", commit], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="main", help="The commit measured against this checkout.")
    p.add_argument("--jobs", type=int, default=1500, help="Jobs measured per run.")
    p.add_argument("--scrapes", type=int, default=300, help="Scrapes measured per run.")
    p.add_argument("--rounds", type=int, default=3, help="Rounds (each runs both trees).")
    args = p.parse_args(argv)

    from api.local import local_token, resolve_config
    from api.settings import Settings
    from loadtests.server import start_api, stop_api, tuned_host

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="metrics-cost-") as scratch:
        trees = {f"base {args.base}": export(args.base, Path(scratch) / "base"), "this": ROOT}
        with tuned_host("metrics-cost") as (host, tmp):
            names = list(trees)
            for n in range(args.rounds):
                for name in names if n % 2 == 0 else names[::-1]:
                    data = tmp / f"{n}-{len(rows)}"
                    env = {"PYTHONPATH": str(trees[name])}
                    proc, url = start_api(
                        host, backend="asyncssh", pool_mode="pooled", data_dir=data, env=env
                    )
                    try:
                        settings = Settings(data_dir=data)
                        scopes = ["jobs:read", "jobs:write", "admin"]
                        token = local_token(settings, resolve_config(settings), "cost", scopes)
                        figures = asyncio.run(
                            measure(proc.pid, url, token, args.jobs, args.scrapes)
                        )
                    finally:
                        stop_api(proc)
                    row = {"round": n + 1, "tree": name, **figures}
                    row["load_1m"] = round(os.getloadavg()[0], 2)
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    for name in trees:
        mine = [r for r in rows if r["tree"] == name]
        for key in ("api_cpu_ms_per_job", "api_cpu_ms_per_scrape"):
            values = sorted(r[key] for r in mine)
            print(f"{name}: {key} {values} (median {statistics.median(values)})")
    loads = [r["load_1m"] for r in rows]
    print(f"load average (1 min) {min(loads)} to {max(loads)}")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
