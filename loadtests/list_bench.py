"""Directory listings through the API: time and the API's memory for big directories.

    python -m loadtests.list_bench --sizes 100000,150000,1000000 --concurrent 20

It starts a local sshd (`tuned`) and the API (`loadtests.server.start_api`, pooled), makes one
directory of empty files per size under the account's home, and for each: lists it once
(`GET .../files?path=D&limit=1000`, the API's RSS sampled every 50 ms by
`loadtests.files_bench.RssSampler`), then, when it is within the cap, pages through it to the end
(time per page) and runs `sshapi files ls` on it (time to its first line and to its end). Then
`--concurrent` listings of the second size at once, by one identity and by as many identities,
while a bystander identity runs one short job every 0.25 s (its latency against a baseline taken
before). Every load is bounded: a fixed number of requests, each with a 600 s timeout, on
127.0.0.1 only. The directories are removed at the end.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from loadtests.bystander import Bystander
from loadtests.files_bench import MIB, RssSampler
from loadtests.server import start_api, stop_api, tuned_host

TIMEOUT = 600.0
SSHAPI = str(Path(sys.executable).parent / "sshapi")


def make_dir(path: Path, n: int) -> float:
    """`n` empty files in a new directory `path`; the seconds it took."""
    t0 = time.perf_counter()
    path.mkdir(parents=True)
    for i in range(n):
        os.close(os.open(path / f"entry-{i:07d}", os.O_CREAT | os.O_WRONLY, 0o644))
    return time.perf_counter() - t0


def list_once(client: httpx.Client, url: str, token: str, path: str) -> tuple[int, float, Any]:
    t0 = time.perf_counter()
    r = client.get(
        f"{url}/v1/hosts/local/files",
        params={"path": path, "limit": 1000},
        headers={"Authorization": f"Bearer {token}"},
    )
    return r.status_code, time.perf_counter() - t0, r.json()


def page_through(client: httpx.Client, url: str, token: str, path: str) -> dict[str, Any]:
    """Every page of a listing: the first page's seconds, the others' (ms), the entries."""
    headers = {"Authorization": f"Bearer {token}"}
    params: dict[str, Any] = {"path": path, "limit": 1000}
    times: list[float] = []
    entries = 0
    t0 = time.perf_counter()
    while True:
        t = time.perf_counter()
        r = client.get(f"{url}/v1/hosts/local/files", params=params, headers=headers)
        r.raise_for_status()
        times.append(time.perf_counter() - t)
        body = r.json()
        entries += len(body["items"])
        if not body["next_cursor"]:
            break
        params["cursor"] = body["next_cursor"]
    rest = [s * 1000 for s in times[1:]] or [0.0]
    return {
        "pages": len(times),
        "entries": entries,
        "first_page_s": times[0],
        "next_pages_median_ms": statistics.median(rest),
        "next_pages_max_ms": max(rest),
        "total_s": time.perf_counter() - t0,
    }


def cli_ls(url: str, token: str, path: str) -> dict[str, Any]:
    """`sshapi files ls local PATH`: seconds to its first line and to its end, lines printed."""
    env = {**os.environ, "SSHAPI_URL": url, "SSHAPI_TOKEN": token}
    t0 = time.perf_counter()
    first = None
    lines = 0
    with subprocess.Popen(
        [SSHAPI, "files", "ls", "local", path], env=env, stdout=subprocess.PIPE, text=True
    ) as proc:
        assert proc.stdout is not None
        for _ in proc.stdout:
            lines += 1
            if first is None:
                first = time.perf_counter() - t0
        proc.wait(timeout=TIMEOUT)
    return {"first_line_s": first, "total_s": time.perf_counter() - t0, "lines": lines}


def concurrent(url: str, tokens: list[str], path: str, pid: int, bystander: str) -> dict[str, Any]:
    """One listing per token, all at once, the bystander's jobs running meanwhile."""

    def one(token: str) -> tuple[int, float]:
        with httpx.Client(timeout=TIMEOUT) as client:
            status, seconds, _ = list_once(client, url, token, path)
            return status, seconds

    with RssSampler(pid) as rss, Bystander(url, bystander) as by:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(len(tokens)) as pool:
            done = list(pool.map(one, tokens))
        wall = time.perf_counter() - t0
    return {
        "listings": len(tokens),
        "statuses": dict(collections.Counter(s for s, _ in done)),
        "slowest_s": max(s for _, s in done),
        "wall_s": wall,
        "rss_before_mib": rss.before / MIB,
        "rss_peak_mib": rss.peak / MIB,
        "bystander": by.summary(),
    }


def measure(host: Any, workdir: Path, sizes: list[int], n_concurrent: int) -> dict[str, Any]:
    from api.local import local_token, resolve_config
    from api.settings import Settings

    api_dir = workdir / "api"
    proc, url = start_api(
        host, backend="asyncssh", pool_mode="pooled", data_dir=api_dir, log=workdir / "api.log"
    )
    base = Path(host.account.home) / f"list-bench-{uuid.uuid4().hex[:8]}"
    result: dict[str, Any] = {"sizes": {}, "load_before": os.getloadavg()}
    try:
        settings = Settings(data_dir=api_dir)
        config = resolve_config(settings)
        scopes = ["files:read", "jobs:read", "jobs:write"]

        def token(sub: str) -> str:
            return local_token(settings, config, sub, scopes)

        lister, bystander = token("list-bench"), token("bystander")
        psutil_rss = RssSampler(proc.pid)._rss
        with Bystander(url, bystander) as idle:
            time.sleep(3)
        result["bystander_idle"] = idle.summary()
        with httpx.Client(timeout=TIMEOUT) as client:
            for n in sizes:
                folder = base / f"d{n}"
                made = make_dir(folder, n)
                with RssSampler(proc.pid) as rss:
                    status, seconds, body = list_once(client, url, lister, str(folder))
                one: dict[str, Any] = {
                    "made_s": made,
                    "status": status,
                    "seconds": seconds,
                    "rss_before_mib": rss.before / MIB,
                    "rss_peak_mib": rss.peak / MIB,
                    "rss_after_mib": psutil_rss() / MIB,
                }
                if status == 200:
                    one["paged"] = page_through(client, url, lister, str(folder))
                    one["rss_after_paging_mib"] = psutil_rss() / MIB
                    one["cli"] = cli_ls(url, lister, str(folder))
                else:
                    one["problem"] = body.get("type")
                result["sizes"][n] = one
        if n_concurrent and len(sizes) > 1:
            second = str(base / f"d{sizes[1]}")
            result["concurrent_one_identity"] = concurrent(
                url, [lister] * n_concurrent, second, proc.pid, bystander
            )
            many = [token(f"list-bench-{i}") for i in range(n_concurrent)]
            result["concurrent_identities"] = concurrent(url, many, second, proc.pid, bystander)
        result["rss_end_mib"] = psutil_rss() / MIB
    finally:
        stop_api(proc)
        shutil.rmtree(base, ignore_errors=True)
    result["load_after"] = os.getloadavg()
    return result


def report(result: dict[str, Any]) -> str:
    lines = [
        "load average "
        + "/".join(f"{x:.2f}" for x in result["load_before"])
        + " before, "
        + "/".join(f"{x:.2f}" for x in result["load_after"])
        + " after",
        f"bystander idle: {result['bystander_idle']}",
    ]
    for n, one in result["sizes"].items():
        lines.append(
            f"{n:>9} entries: {one['status']} {one.get('problem') or ''} in {one['seconds']:.2f} s,"
            f" API RSS {one['rss_before_mib']:.0f} -> peak {one['rss_peak_mib']:.0f} -> "
            f"{one['rss_after_mib']:.0f} MiB"
        )
        if "paged" in one:
            p = one["paged"]
            lines.append(
                f"           {p['pages']} pages ({p['entries']} entries): first "
                f"{p['first_page_s']:.2f} s, next pages median {p['next_pages_median_ms']:.1f} ms"
                f" max {p['next_pages_max_ms']:.1f} ms, total {p['total_s']:.2f} s; RSS after "
                f"{one['rss_after_paging_mib']:.0f} MiB"
            )
            c = one["cli"]
            lines.append(
                f"           sshapi files ls: first line {c['first_line_s']:.2f} s, "
                f"{c['lines']} lines in {c['total_s']:.2f} s"
            )
    for key in ("concurrent_one_identity", "concurrent_identities"):
        if key in result:
            c = result[key]
            lines.append(
                f"{key}: {c['listings']} listings -> {c['statuses']}, slowest "
                f"{c['slowest_s']:.2f} s, RSS {c['rss_before_mib']:.0f} -> peak "
                f"{c['rss_peak_mib']:.0f} MiB; bystander {c['bystander']}"
            )
    lines.append(f"API RSS at the end: {result['rss_end_mib']:.0f} MiB")
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m loadtests.list_bench", description=__doc__.split("\n")[0]
    )
    p.add_argument(
        "--sizes",
        default="100000,150000,1000000",
        help="Directory sizes, comma-separated (the second one is listed concurrently).",
    )
    p.add_argument("--concurrent", type=int, default=20, help="Listings at once (0: none).")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    with tuned_host("list-bench") as (host, tmp):
        result = measure(host, tmp / "run", sizes, args.concurrent)
    print(report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
