"""Researchers as themselves, measured: N researcher accounts (the rig's `sshapi-r0001`...,
real Unix accounts) on the rig's stock sshd run as root, each logged in with a fresh
certificate of the rig's user CA per connection.

    .venv/bin/python -m loadtests.certificates --accounts 200

(a) burst: one `id -un` per account, all released at once, then again on the same pool:
    statuses, p50/p99, how many answered another account than their own, and sshd's
    "Refusing certificate" lines;
(b) connect: --connects fresh logins one after another of the host's account, with its key
    file and with a certificate: median and p90 ms (the certificate adds its minting and a
    longer signature check);
(c) CPU per job on a warm connection: --jobs `true` one after another, key file vs
    certificate, this process's CPU seconds per job (the certificate costs only at connect).

Measured at the pool (the API adds the same per job either way). Run as root (the accounts are
real). Prints one JSON object per part and a summary.

    .venv/bin/python -m loadtests.certificates --http --accounts 200

The same through HTTP: `sshapi serve` (its own process) with host `hpc` (certificates, the
same stock sshd) and the local issuer's `account_claim = "preferred_username"`; each
researcher's token names their account. (a) one POST /v1/jobs `id -un` per researcher released
at once, then again: statuses, p50/p99, `id -un` right, sshd's "Refusing certificate" lines;
(c) CPU per job of the API process and of sshd (its whole tree), one warm researcher on `hpc`
against the host's account with its key file on host `keys`, --jobs requests one after
another, interleaved rounds. The server takes up to 256 connections from one address (the
load comes from one client here, from many users' addresses in a real portal).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import secrets
import statistics
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from api.local import LOCAL_AUDIENCE, LOCAL_ISSUER, mint
from loadtests import hdr
from loadtests.cpu import tree_seconds
from loadtests.server import free_port, limits, stop_api, wait_ready
from sshpool import Pool, SSHPoolError, Target
from sshpool.backends import load_backend
from sshpool.devhost import LocalHost, Rig, RigSpec
from sshpool.devhost.accounts import ensure_accounts


async def whoami(pool: Pool, target: Target, deadline: float) -> tuple[str, float]:
    send = time.perf_counter()
    try:
        result = await pool.run(target, ["id", "-un"], timeout=30, acquire_timeout=deadline)
        status = "ok" if result.stdout.decode().strip() == target.username else "wrong-account"
    except SSHPoolError as exc:
        status = type(exc).__name__
    return status, (time.perf_counter() - send) * 1000.0


def log_since(host: LocalHost, offset: int) -> bytes:
    with open(host.log_path, "rb") as f:
        f.seek(offset)
        return f.read()


def _burst_figures(done: list[tuple[Any, float]], makespan: float, log: bytes) -> dict[str, Any]:
    """A burst's statuses, latency, makespan and what sshd's log says of its logins."""
    pct = hdr.percentiles(hdr.histogram(ms for _, ms in done))
    return {
        "statuses": dict(Counter(s for s, _ in done)),
        "p50_ms": pct["p50"],
        "p99_ms": pct["p99"],
        "makespan_s": round(makespan, 2),
        # The researchers' own: the API's login as the host's account (its account lookups,
        # api/accounts.py) is not one of them.
        "certificate_logins": sum(
            1 for line in log.splitlines() if b"ED25519-CERT" in line and b" ID researcher-" in line
        ),
        "refusing_certificate_lines": log.count(b"Refusing certificate"),
    }


async def burst(host: LocalHost, names: list[str], rounds: int, deadline: float) -> list[Any]:
    base = limits("pooled")
    targets = [
        dataclasses.replace(host.certificate_target(f"researcher-{i}", username=name), limits=base)
        for i, name in enumerate(names)
    ]
    rows = []
    async with Pool() as pool:
        for round_ in range(rounds):
            offset = host.log_path.stat().st_size
            t0 = time.perf_counter()
            done = await asyncio.gather(*(whoami(pool, t, deadline) for t in targets))
            makespan = time.perf_counter() - t0
            row = {"part": "burst", "round": round_ + 1, "accounts": len(targets)}
            rows.append(row | _burst_figures(done, makespan, log_since(host, offset)))
            print(json.dumps(rows[-1]), flush=True)
    return rows


async def connects(host: LocalHost, n: int) -> dict[str, Any]:
    """Fresh logins one after another, interleaved key / certificate."""
    backend = load_backend("asyncssh")
    # The host's service account takes only the API's own certificates (key id "sshapi/...":
    # deploy/sshapi-principals), as on a site.
    kinds = {"key": host.target(), "certificate": host.certificate_target("sshapi")}
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(n):
        for kind, target in kinds.items():
            t0 = time.perf_counter()
            conn = await backend.connect(target)
            times[kind].append((time.perf_counter() - t0) * 1000.0)
            await conn.close()
    row: dict[str, Any] = {"part": "connect", "connects": n}
    for kind, values in times.items():
        row[f"{kind}_p50_ms"] = round(statistics.median(values), 2)
        row[f"{kind}_p90_ms"] = round(statistics.quantiles(values, n=10)[-1], 2)
    print(json.dumps(row), flush=True)
    return row


async def cpu_per_job(host: LocalHost, jobs: int, rounds: int) -> dict[str, Any]:
    """This process's CPU per `true` on a warm connection, interleaved rounds."""
    kinds = {"key": host.target(), "certificate": host.certificate_target("sshapi")}
    cpu: dict[str, list[float]] = {k: [] for k in kinds}
    async with Pool() as pool:
        for target in kinds.values():
            await pool.run(target, ["true"], timeout=30)  # warm: the connection is made
        for _ in range(rounds):
            for kind, target in kinds.items():
                c0 = time.process_time()
                for _ in range(jobs):
                    await pool.run(target, ["true"], timeout=30)
                cpu[kind].append((time.process_time() - c0) / jobs * 1000.0)
    row: dict[str, Any] = {"part": "cpu", "jobs": jobs, "rounds": rounds}
    for kind, values in cpu.items():
        row[f"{kind}_cpu_ms_per_job"] = round(statistics.median(values), 3)
    print(json.dumps(row), flush=True)
    return row


# ---- through HTTP

CLAIM = "preferred_username"


def http_config(host: LocalHost) -> str:
    """Host `hpc`: certificates of the rig's CA, each caller as their token's account; host
    `keys`: the host's own account with its key file (the CPU comparison)."""
    return f"""
[api]
wait_max = 300
queue_timeout = 120

[[issuers]]
issuer = "{LOCAL_ISSUER}"
audience = "{LOCAL_AUDIENCE}"
algorithms = ["HS256"]
account_claim = "{CLAIM}"

[hosts.hpc]
hostname = "{host.address}"
port = {host.port}
username = "{host.username}"
known_hosts = "{host.known_hosts}"
[hosts.hpc.credentials]
kind = "certificate"
ca_key = "{host.user_ca_key}"

[hosts.keys]
hostname = "{host.address}"
port = {host.port}
username = "{host.username}"
client_keys = ["{host.client_key}"]
known_hosts = "{host.known_hosts}"

[[policy]]
issuer = "{LOCAL_ISSUER}"
hosts = ["*"]
rate = 1e6
burst = 1000000
max_concurrent = 1000000
"""


@contextlib.contextmanager
def serving(host: LocalHost, data_dir: Path) -> Iterator[tuple[int, str, str]]:
    """`sshapi serve` with `http_config`: its pid, base URL and JWT secret; stopped on exit."""
    data_dir.mkdir(parents=True, exist_ok=True)
    config = data_dir / "sshapi.toml"
    config.write_text(http_config(host))
    secret = secrets.token_urlsafe(32)
    port = free_port()
    env = {
        **os.environ,
        "SSHAPI_CONFIG": str(config),
        "SSHAPI_DATA_DIR": str(data_dir / "api"),
        "SSHAPI_PORT": str(port),
        "SSHAPI_HOST": "127.0.0.1",
        "SSHAPI_JWT_SECRET": secret,
        "SSHAPI_LOG_LEVEL": "warning",
        "SSHAPI_MAX_CONNECTIONS_PER_ADDRESS": "256",
    }
    sshapi = Path(__file__).resolve().parent.parent / ".venv" / "bin" / "sshapi"
    with (data_dir / "serve.log").open("ab") as log:
        proc = subprocess.Popen([str(sshapi), "serve"], env=env, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url, log=data_dir / "serve.log")
        yield proc.pid, url, secret
    finally:
        stop_api(proc)


def token(secret: str, subject: str, account: str | None) -> str:
    claims = {CLAIM: account} if account else None
    scopes = ["jobs:read", "jobs:write"]
    return mint(
        secret,
        issuer=LOCAL_ISSUER,
        audience=LOCAL_AUDIENCE,
        subject=subject,
        scopes=scopes,
        claims=claims,
    )


async def post_job(
    client: httpx.AsyncClient, url: str, bearer: str, host: str, account: str
) -> tuple[str, float]:
    send = time.perf_counter()
    headers = {"Authorization": f"Bearer {bearer}", "Prefer": "wait=300"}
    try:
        r = await client.post(
            f"{url}/v1/jobs", json={"host": host, "argv": ["id", "-un"]}, headers=headers
        )
        job = r.json()
        if r.status_code not in (200, 201) or job.get("state") != "succeeded":
            status = f"{r.status_code} {job.get('state') or job.get('type', '')}"
        else:
            status = "ok" if job["stdout"].strip() == account else "wrong-account"
    except httpx.HTTPError as exc:
        status = type(exc).__name__
    return status, (time.perf_counter() - send) * 1000.0


async def http_burst(
    host: LocalHost, url: str, secret: str, names: list[str], rounds: int
) -> list[Any]:
    bearers = [token(secret, f"researcher-{i}", name) for i, name in enumerate(names)]
    rows = []
    limits_ = httpx.Limits(max_connections=len(names) + 8, max_keepalive_connections=len(names))
    async with httpx.AsyncClient(timeout=600, limits=limits_) as client:
        for round_ in range(rounds):
            offset = host.log_path.stat().st_size
            t0 = time.perf_counter()
            done = await asyncio.gather(
                *(post_job(client, url, b, "hpc", n) for b, n in zip(bearers, names, strict=True))
            )
            makespan = time.perf_counter() - t0
            row = {"part": "http-burst", "round": round_ + 1, "researchers": len(names)}
            rows.append(row | _burst_figures(done, makespan, log_since(host, offset)))
            print(json.dumps(rows[-1]), flush=True)
    return rows


async def http_cpu(
    host: LocalHost, api_pid: int, url: str, secret: str, name: str, jobs: int, rounds: int
) -> dict[str, Any]:
    """CPU per job of the API process and of sshd, one warm caller after another: a researcher
    with certificates on `hpc`, the host's account with its key file on `keys`."""
    kinds = {
        "certificate": ("hpc", name, token(secret, "researcher-cpu", name)),
        "key": ("keys", host.username, token(secret, "keys-cpu", None)),
    }
    api: dict[str, list[float]] = {k: [] for k in kinds}
    sshd: dict[str, list[float]] = {k: [] for k in kinds}
    async with httpx.AsyncClient(timeout=120) as client:
        for target, account, bearer in kinds.values():  # warm: each connection is made
            assert (await post_job(client, url, bearer, target, account))[0] == "ok"
        for _ in range(rounds):
            for kind, (target, account, bearer) in kinds.items():
                a0, s0 = tree_seconds(api_pid), tree_seconds(host.pid)
                for _ in range(jobs):
                    status, _ms = await post_job(client, url, bearer, target, account)
                    assert status == "ok", status
                api[kind].append((tree_seconds(api_pid) - a0) / jobs * 1000.0)
                sshd[kind].append((tree_seconds(host.pid) - s0) / jobs * 1000.0)
    row: dict[str, Any] = {"part": "http-cpu", "jobs": jobs, "rounds": rounds}
    for kind in kinds:
        row[f"{kind}_api_cpu_ms_per_job"] = round(statistics.median(api[kind]), 3)
        row[f"{kind}_sshd_cpu_ms_per_job"] = round(statistics.median(sshd[kind]), 3)
    print(json.dumps(row), flush=True)
    return row


def http_main(host: LocalHost, names: list[str], args: argparse.Namespace) -> list[Any]:
    with serving(host, Path(args.data_dir).absolute() / "http") as (pid, url, secret):
        rows = asyncio.run(http_burst(host, url, secret, names, args.rounds))
        rows.append(asyncio.run(http_cpu(host, pid, url, secret, names[0], args.jobs, args.rounds)))
    return rows


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m loadtests.certificates", description=__doc__)
    parser.add_argument("--accounts", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2, help="bursts, and CPU rounds")
    parser.add_argument("--connects", type=int, default=30, help="fresh logins per kind")
    parser.add_argument("--jobs", type=int, default=300, help="jobs per CPU round")
    parser.add_argument("--deadline", type=float, default=60.0, help="acquire timeout, s")
    parser.add_argument("--data-dir", default=".data-certificates")
    parser.add_argument("--http", action="store_true", help="through `sshapi serve` (HTTP)")
    return parser.parse_args(argv)


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every part of `args` on the rig's stock sshd logging in `--accounts` researcher accounts
    (made when missing, as root): one row per part and round."""
    data_dir = Path(args.data_dir).absolute()
    names = [a.name for a in ensure_accounts(args.accounts, data_dir=data_dir)]
    spec = RigSpec("certificates", "stock", researchers=True)
    with Rig(spec, data_dir=data_dir) as rig:
        host = rig.host
        if args.http:
            return http_main(host, names, args)
        rows = asyncio.run(burst(host, names, args.rounds, args.deadline))
        rows.append(asyncio.run(connects(host, args.connects)))
        rows.append(asyncio.run(cpu_per_job(host, args.jobs, args.rounds)))
        return rows


def main(argv: list[str] | None = None) -> int:
    rows = measure(parse(argv))
    for row in rows:
        print(" ".join(f"{k}={v}" for k, v in row.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
