"""Dashboard panels as pictures: a real Prometheus (Debian's `prometheus`, `make prometheus`),
run from deploy/prometheus/prometheus.yml with a 1-s interval, scrapes an API on its own rig
while a burst of slow jobs saturates the host's pool; the pool dashboard's panels (the queries
of deploy/grafana/dashboards/sshapi-pool.json, as Grafana would send them) are then read over
the run and drawn with matplotlib, one PNG (docs/operations.md, "Seeing inside").

    python -m loadtests.panels --out docs/img --jobs 240 --in-flight 48

`run_prometheus` is also what tests/api/test_api_prometheus.py starts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
DASHBOARDS = ROOT / "deploy" / "grafana" / "dashboards"
PROMETHEUS = os.environ.get("PROMETHEUS_BIN", "/usr/bin/prometheus")
# The panels drawn, by title, from the pool dashboard.
PANELS = ("Connections by state", "Callers waiting for a slot", "Wait for a slot, p50 and p99")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.contextmanager
def run_prometheus(target: str, token: str, workdir: Path) -> Iterator[str]:
    """Prometheus on 127.0.0.1 (a free port), its storage under `workdir`, from the shipped
    configuration with a 1-s scrape and evaluation interval, the shipped rules, and `target`
    (host:port) as the `sshapi` job's only target, scraped with `token`; yields its URL and is
    stopped (terminated, killed after 15 s) on exit."""
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = [str(PROMETHEUS_DIR / "sshapi-rules.yml")]
    (job,) = config["scrape_configs"]
    token_file = workdir / "prometheus.token"
    token_file.write_text(token)
    job["authorization"]["credentials_file"] = str(token_file)
    job["static_configs"] = [{"targets": [target]}]
    job["scrape_timeout"] = "1s"
    path = workdir / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    port = free_port()
    with (workdir / "prometheus.log").open("wb") as log:
        proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={path}",
                f"--storage.tsdb.path={workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--storage.tsdb.retention.time=1h",
                "--log.level=warn",
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def panel_targets(dashboard: str, titles: tuple[str, ...]) -> dict[str, list[dict[str, Any]]]:
    model = json.loads((DASHBOARDS / f"{dashboard}.json").read_text())
    return {p["title"]: p["targets"] for p in model["panels"] if p["title"] in titles}


def grafana(expr: str, host: str, rate_interval: str) -> str:
    """A panel's query with Grafana's variables put in."""
    return expr.replace("$__rate_interval", rate_interval).replace("$host", host)


def query_range(url: str, expr: str, start: float, end: float) -> list[dict[str, Any]]:
    params = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": 1})
    with urllib.request.urlopen(f"{url}/api/v1/query_range?{params}", timeout=30) as r:
        answer = json.load(r)
    if answer["status"] != "success":
        raise RuntimeError(f"{expr}: {answer}")
    result: list[dict[str, Any]] = answer["data"]["result"]
    return result


def wait_scraped(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            params = urllib.parse.urlencode({"query": 'up{job="sshapi"} == 1'})
            with urllib.request.urlopen(f"{url}/api/v1/query?{params}", timeout=5) as r:
                if json.load(r)["data"]["result"]:
                    return
        time.sleep(0.5)
    raise RuntimeError(f"Prometheus at {url} did not scrape the API within {timeout:g} s")


async def burst(url: str, token: str, jobs: int, in_flight: int, seconds: float) -> None:
    """`jobs` jobs of `sleep seconds`, `in_flight` at once, each waited for (Prefer: wait)."""
    import httpx

    gate = asyncio.Semaphore(in_flight)
    headers = {"Authorization": f"Bearer {token}", "Prefer": "wait=120"}
    body = {"host": "local", "argv": ["sleep", f"{seconds:g}"]}

    async def one(client: httpx.AsyncClient) -> None:
        async with gate:
            await client.post(f"{url}/v1/jobs", json=body, headers=headers)

    async with httpx.AsyncClient(timeout=180) as client:
        await asyncio.gather(*(one(client) for _ in range(jobs)))


def draw(series: dict[str, list[tuple[str, list[tuple[float, float]]]]], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(series), 1, figsize=(8, 2.4 * len(series)), sharex=True)
    for ax, (title, lines) in zip(axes, series.items(), strict=True):
        for legend, points in lines:
            ax.plot([t for t, _ in points], [v for _, v in points], label=legend)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8, loc="upper right")
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("seconds since the burst began")
    fig.suptitle("sshapi-pool dashboard: a burst past the pool's connections", fontsize=11)
    fig.tight_layout()
    path = out / "pool-panels.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def legend_of(template: str, labels: dict[str, str]) -> str:
    for name, value in labels.items():
        template = template.replace(f"{{{{{name}}}}}", value)
    return template


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "img", help="Where the PNG goes.")
    p.add_argument("--jobs", type=int, default=240, help="Jobs in the burst.")
    p.add_argument("--in-flight", type=int, default=48, help="Jobs submitted at once.")
    p.add_argument("--seconds", type=float, default=0.5, help="Each job's `sleep`.")
    args = p.parse_args(argv)

    from api.local import local_token, resolve_config
    from api.settings import Settings
    from loadtests.server import start_api, stop_api, tuned_host

    with tuned_host("panels") as (host, tmp):
        data = tmp / "api"
        proc, url = start_api(host, backend="asyncssh", pool_mode="pooled", data_dir=data)
        try:
            settings = Settings(data_dir=data)
            scopes = ["jobs:read", "jobs:write", "admin"]
            token = local_token(settings, resolve_config(settings), "panels", scopes)
            with run_prometheus(url.removeprefix("http://"), token, tmp) as prom:
                wait_scraped(prom)
                time.sleep(3)  # a few idle scrapes before the burst
                start = time.time()
                asyncio.run(burst(url, token, args.jobs, args.in_flight, args.seconds))
                time.sleep(5)  # and after it
                end = time.time()
                wanted = panel_targets("sshapi-pool", PANELS)
                series = {}
                for title in PANELS:
                    lines = []
                    for target in wanted[title]:
                        expr = grafana(target["expr"], "local", "5s")
                        for s in query_range(prom, expr, start - 3, end):
                            points = [(t - start, float(v)) for t, v in s["values"]]
                            lines.append((legend_of(target["legendFormat"], s["metric"]), points))
                    series[title] = lines
        finally:
            stop_api(proc)
    args.out.mkdir(parents=True, exist_ok=True)
    print(draw(series, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
