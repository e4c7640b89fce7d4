"""Several API replicas on one PostgreSQL schema behind nginx, all on loopback: what
tests/deploy/test_deploy.py runs, and the measurement behind the README's two-replica figures.

    python -m loadtests.replicas                       # 1, 2, 1, 2 replicas; sweep profile x0.5
    python -m loadtests.replicas --replicas 1 2 --load-profile paper --duration-factor 1

nginx runs from the OS package with deploy/nginx-sshapi.conf itself (listen and upstream ports
rewritten), as an unprivileged-port process whose pid, logs and temp files live in a work dir.
Each replica is `loadtests.server` (the API's own create_app) with SSHAPI_REPLICA, the shared
database and the shared JWT secret, so one token works on both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtests.server import free_port, start_api, stop_api
from sshpool.devhost import LocalHost, Rig, RigSpec

REPO = Path(__file__).resolve().parent.parent
NGINX = "/usr/sbin/nginx"
NGINX_CONF = REPO / "deploy" / "nginx-sshapi.conf"
LOCUST = Path(sys.executable).parent / "locust"
PG_URL = os.environ.get("SSHAPI_TEST_PG", "postgresql+asyncpg://postgres@127.0.0.1:5432/test")


def nginx_conf(listen: int, upstreams: Sequence[int], workdir: Path) -> str:
    """A main nginx.conf around the shipped site file: ports rewritten, everything under
    workdir, in the foreground."""
    site = NGINX_CONF.read_text()
    site, n = re.subn(r"listen 127\.0\.0\.1:\d+;", f"listen 127.0.0.1:{listen};", site)
    servers = "".join(f"    server 127.0.0.1:{p} max_fails=1 fail_timeout=5s;\n" for p in upstreams)
    site, m = re.subn(r"(    server 127\.0\.0\.1:\d+ [^\n]*\n)+", servers, site)
    if (n, m) != (1, 1):
        raise ValueError(f"{NGINX_CONF} no longer has one listen line and one upstream list")
    temp = "\n".join(
        f"    {kind}_temp_path {workdir}/{kind};"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    return (
        f"daemon off;\nworker_processes 1;\npid {workdir}/nginx.pid;\n"
        f"error_log {workdir}/error.log warn;\nevents {{ worker_connections 4096; }}\n"
        f"http {{\n    access_log off;\n{temp}\n{site}\n}}\n"
    )


def start_nginx(listen: int, upstreams: Sequence[int], workdir: Path) -> subprocess.Popen[bytes]:
    workdir.mkdir(parents=True, exist_ok=True)
    conf = workdir / "nginx.conf"
    conf.write_text(nginx_conf(listen, upstreams, workdir))
    subprocess.run([NGINX, "-t", "-q", "-c", str(conf)], check=True, capture_output=True)
    with (workdir / "nginx.out").open("ab") as log:  # the child keeps its copy
        proc = subprocess.Popen([NGINX, "-c", str(conf)], stdout=log, stderr=log)
    wait_ready(f"http://127.0.0.1:{listen}/healthz", proc)
    return proc


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer in {timeout:g} s")


@dataclass
class Cluster:
    """Replicas (by name) behind one nginx; `url` is nginx's."""

    host: LocalHost
    workdir: Path
    env: dict[str, str]
    url: str = ""
    ports: dict[str, int] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    nginx: subprocess.Popen[bytes] | None = None

    def start_replica(self, name: str) -> None:
        port = self.ports.setdefault(name, free_port())
        self.procs[name], _ = start_api(
            self.host,
            backend="asyncssh",
            pool_mode="pooled",
            data_dir=self.workdir / name,
            port=port,
            log=self.workdir / f"{name}.log",
            env={**self.env, "SSHAPI_REPLICA": name},
        )

    def kill(self, name: str) -> None:
        """SIGKILL: no graceful shutdown, requests in flight on it are cut."""
        proc = self.procs.pop(name)
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def stop(self) -> None:
        if self.nginx is not None:
            self.nginx.terminate()
            self.nginx.wait(timeout=10)
        for proc in self.procs.values():
            stop_api(proc)


@contextmanager
def cluster(
    host: LocalHost, workdir: Path, replicas: int, database_url: str = PG_URL
) -> Iterator[Cluster]:
    """`replicas` API processes (r1, r2, ...) on a fresh PostgreSQL schema, behind nginx."""
    schema = f"sshapi_replicas_{uuid.uuid4().hex[:12]}"
    env = {
        "SSHAPI_DATABASE_URL": database_url,
        "SSHAPI_DATABASE_SCHEMA": schema,
        "SSHAPI_JWT_SECRET": secrets.token_urlsafe(48),
        "SSHAPI_REPLICAS": str(replicas),
    }
    c = Cluster(host, workdir, env)
    try:
        for n in range(1, replicas + 1):
            c.start_replica(f"r{n}")  # one by one: each creates the schema if missing
        listen = free_port()
        c.nginx = start_nginx(listen, list(c.ports.values()), workdir / "nginx")
        c.url = f"http://127.0.0.1:{listen}"
        yield c
    finally:
        c.stop()
        asyncio.run(drop_schema(database_url, schema))


async def drop_schema(database_url: str, schema: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(database_url.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    finally:
        await conn.close()


def locust(
    locustfile: str, url: str, env: dict[str, str], report_dir: Path, *args: str
) -> subprocess.Popen[str]:
    """A headless Locust run in the background (collect with `finish`)."""
    child = {**os.environ, **env}
    child.pop("SSHAPI_TOKEN", None)
    child.pop("SSHAPI_CONFIG", None)
    argv = [str(LOCUST), "-f", str(REPO / "loadtests" / locustfile), "--headless", "-H", url]
    return subprocess.Popen(
        [*argv, "--report-dir", str(report_dir), *args],
        env=child,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(proc: subprocess.Popen[str], report_dir: Path, timeout: float) -> dict[str, Any]:
    """Wait for a Locust run; its summary.json plus `exit_code`, `output` and `run_dir`."""
    output, _ = proc.communicate(timeout=timeout)
    runs = sorted(report_dir.iterdir())
    if not runs:
        raise RuntimeError(f"Locust wrote no report:\n{output[-3000:]}")
    summary: dict[str, Any] = json.loads((runs[-1] / "summary.json").read_text())
    summary.update(exit_code=proc.returncode, output=output, run_dir=str(runs[-1]))
    return summary


def measure(
    replicas: int, profile: str, factor: float, workdir: Path, host: LocalHost
) -> list[dict[str, Any]]:
    """One sustained run through nginx in front of `replicas` replicas; one row per measured
    stage: offered and achieved rate, percentiles of the successes, errors, the run's validity."""
    with cluster(host, workdir / "cluster", replicas) as c:
        env = {"SSHAPI_DATA_DIR": str(workdir / "cluster" / "r1"), **c.env}
        args = ("--load-profile", profile, "--duration-factor", str(factor))
        reports = workdir / "reports"
        s = finish(locust("sustained.py", c.url, env, reports, *args), reports, 3600)
    print(f"replicas={replicas}: {s['run_dir']}", flush=True)
    return [
        {
            "replicas": replicas,
            "offered_rate": st["offered_rate"],
            "requests": st["requests"],
            "ok": st["ok"],
            "throughput": st["throughput"] or 0,
            "p50_ms": st["latency_ms"]["p50"],
            "p99_ms": st["latency_ms"]["p99"],
            "errors": st["errors"],
            "valid": bool(s["validity"]["valid"]),
        }
        for st in s.get("stages", [])
    ]


def row(r: dict[str, Any]) -> str:
    """One stage as a row of the Markdown table main prints."""
    errors = ", ".join(f"{k}: {v}" for k, v in r["errors"].items()) or "-"
    return (
        f"| {r['replicas']} | {r['offered_rate']:g} | {r['requests']} | {r['ok']} "
        f"| {r['throughput']:.1f} | {r['p50_ms']} | {r['p99_ms']} | {errors} "
        f"| {'valid' if r['valid'] else 'INVALID'} |"
    )


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--replicas", type=int, nargs="+", default=[1, 2, 1, 2], help="Replica counts, in order."
    )
    parser.add_argument("--load-profile", default="sweep")
    parser.add_argument("--duration-factor", type=float, default=0.5)
    return parser.parse_args(argv)


def measure_all(o: argparse.Namespace, host: LocalHost, workdir: Path) -> list[dict[str, Any]]:
    """Each replica count of `o.replicas` in order, one sustained run each: every stage's row."""
    rows = []
    for n, count in enumerate(o.replicas):
        rows += measure(count, o.load_profile, o.duration_factor, workdir / f"{n}-x{count}", host)
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    o = parse(argv)
    workdir = Path(tempfile.mkdtemp(prefix="sshapi-replicas-"))
    with Rig(RigSpec("replicas", "tuned"), data_dir=workdir / "host") as rig:
        rows = measure_all(o, rig.host, workdir)
    print(f"\n{o.load_profile} x{o.duration_factor:g}, through nginx, {os.cpu_count()} CPUs:\n")
    print("| replicas | offered/s | requests | ok | ok/s | p50 ms | p99 ms | errors | run |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(map(row, rows)))


if __name__ == "__main__":
    main()
