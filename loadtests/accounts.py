"""One sshd, many accounts: N researcher accounts (the rig's `sshapi-r0001`..., real Unix
accounts, each with its own key) on the rig's stock sshd, run as root as a site's is; the pool
with its per-sshd budget against per-account limits (`Limits(per_sshd=False)` with the old gate
of 4 per account: the behaviour before it), interleaved in one run.

    .venv/bin/python -m loadtests.accounts --accounts 200 --rounds 2
    .venv/bin/python -m loadtests.accounts --accounts 1000 --rate 50 --duration 300
    .venv/bin/python -m loadtests.accounts --via pool --accounts 1000
    .venv/bin/python -m loadtests.accounts --accounts 400 --workers 2 --redis-url redis://127.0.0.1:6379/0
    .venv/bin/python -m loadtests.accounts --accounts 400 --workers 2 --fault redis
    .venv/bin/python -m loadtests.accounts --accounts 400 --replicas 2 --fault replica
    .venv/bin/python -m loadtests.accounts --accounts 400 --workers 2 --credentials certificate \
        --ceiling 5

--via api (the default): `sshapi serve` (a fresh API per cell) with one `[[policy]]` rule and
key per account, each account's caller its own token, one job per request via POST /v1/jobs;
with --replicas N, N `sshapi serve` processes on one fresh PostgreSQL schema and one Redis
(--redis-url, else one of the run's own), the requests spread over them round robin (a replica
that refuses a connection leaves the rotation, as behind a load balancer).
--via pool: the pool alone, without HTTP. Per mode and round:
(a) burst: one `true` per account, all released at once (the pool's acquire timeout, the API's
    queue_timeout: --deadline): statuses, p50/p90/p99 and makespan;
(b) rate (--rate > 0): an open-model stream of --rate commands/s for --duration s, each from a
    random account, so most find their account's connection closed for another's.
--credentials certificate: the accounts log in with certificates the API mints (the rig's user
CA) instead of their keys. --ceiling S: the handshake ceiling (loadtests.handshakes, 6 in
flight, S seconds) measured before the first cell and after the last, each row's makespan
given against accounts / the first; with certificates, also the ceiling of certificate logins
of the rig's CA (sshd does more per such login) and the makespan against it.
Each reports the statuses, latency, handshakes made (sshd's "Accepted publickey" lines) and per
second, evictions (the pool's count), SSH connections open at most (sampled from the kernel
through netlink, and as /proc/net/tcp lists them page by page), the sshd log's "drop
connection" lines (MaxStartups), sshd's processes and their
memory (RSS and PSS) at the end, and CPU per job of the SSH client (the API process, or this
one), of this process (through the API: the generator) and of sshd (the connections closed by
the end). Run as root (the accounts are real). Prints one
JSON object per cell and a table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import re
import secrets
import signal
import subprocess
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
from pydantic import SecretStr

from loadtests import hdr
from loadtests.cpu import own_seconds
from loadtests.handshakes import tree_cpu
from loadtests.replicas import PG_URL, drop_schema
from loadtests.server import free_port, limits, serve_config, stop_api
from sshpool import Limits, Pool, SSHPoolError
from sshpool.devhost import LocalHost
from sshpool.devhost.accounts import Account, ensure_accounts
from sshpool.devhost.procs import children

MODES = ("budget", "per-account")
SUBJECT = "researcher-{}"


def sshd_memory(host: LocalHost) -> tuple[int, int, int]:
    """(processes, RSS in MiB, PSS in MiB) of sshd's per-connection processes and what they
    run. RSS counts every shared page (sshd's code and libraries, the listener's memory the fork
    shares) once per process; PSS splits each among the processes sharing it, so the sum is
    what they cost the host: 64 connections, 979 MiB RSS and 122 MiB PSS."""
    if host.pid is None:
        return 0, 0, 0
    rss = pss = 0
    found = children(host.pid)
    for pid in found:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Rss:"):
                    rss += int(line.split()[1])
                elif line.startswith("Pss:"):
                    pss += int(line.split()[1])
        except OSError:
            continue
    return len(found), rss // 1024, pss // 1024


def log_count(host: LocalHost, offset: int, what: bytes) -> int:
    with open(host.log_path, "rb") as f:
        f.seek(offset)
        return f.read().count(what)


def drops(host: LocalHost, offset: int) -> int:
    return log_count(host, offset, b"drop connection")


def connections(port: int) -> int:
    """TCP connections to `port` established, as /proc/net/tcp lists them (the sshd's side of
    each: whoever opened them, handshakes included), each (local, remote) pair once. Not a
    snapshot: the table (every socket of the machine, thousands) is read page by page while
    it changes, so a connection closed after its page was read and another opened into a
    later page are both counted though never open together: 5 against a budget of 4 in 3 of 4
    runs where the API's own count of its open SSH sockets never passed 4 and netlink never
    read more than 4 (docs/benchmarks.md, "The kernel's count"). `established` is the
    figure; this one is kept beside it. Scanned with one regular expression (parsing the
    table line by line in Python ten times a second was 9 % of the generator's CPU in
    py-spy's profile of a 1,000-account burst)."""
    pattern = rb"^ *\d+: ([0-9A-F]{8}:%04X [0-9A-F]{8}:[0-9A-F]{4}) 01 " % port
    try:
        table = Path("/proc/net/tcp").read_bytes()
    except OSError:
        return 0
    return len(set(re.findall(pattern, table, re.MULTILINE)))


async def established(port: int) -> int | None:
    """TCP connections to `port` established now, through netlink (`ss`, iproute2): the kernel
    walks its table in one call, filtering it itself, so closes and opens meanwhile are not
    added up as `connections`' pages are. None: no `ss` here."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *("ss", "-Htn", "state", "established", f"( sport = :{port} )"),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )
    except OSError:
        return None
    out, _ = await proc.communicate()
    return sum(1 for line in out.splitlines() if line.strip()) if proc.returncode == 0 else None


def config(
    host: LocalHost,
    accounts: list[Account],
    lim: Limits,
    deadline: float,
    credentials: str = "keys",
) -> Any:
    """One host `local`, and one policy rule per account, each for its own subject,
    unthrottled: with its key (the way before certificates), or (`credentials` "certificate")
    its name alone, the API minting a certificate of the rig's user CA for it."""
    from api.local import LOCAL_AUDIENCE, LOCAL_ISSUER

    local: dict[str, Any] = {
        "hostname": host.address,
        "port": host.port,
        "username": accounts[0].name,
        "client_keys": [str(accounts[0].key)],
        "known_hosts": host.known_hosts,
        "limits": dataclasses.asdict(lim),
        # Channels: this measures logins against the per-sshd budget, and its figures compare
        # with those before the default became "auto" (which would add an executor's start to
        # each account's connection: docs/pool.md).
        "exec_mode": "channel",
    }
    if credentials == "certificate":
        del local["client_keys"]
        local |= {"username": host.username, "credentials": {"kind": "certificate"}}
        local["credentials"]["ca_key"] = host.user_ca_key
    return {
        # The queue's deadline is the burst's; a job's answer waits for it and its run.
        "api": {
            "queue_timeout": deadline,
            "wait_default": deadline + 30,
            "wait_max": 600,
            # The benchmark reads the evictions from /metrics, without a token.
            "metrics_require_admin": False,
        },
        "issuers": [{"issuer": LOCAL_ISSUER, "audience": LOCAL_AUDIENCE, "algorithms": ["HS256"]}],
        "hosts": {"local": local},
        "policy": [
            {
                "issuer": LOCAL_ISSUER,
                "subject": SUBJECT.format(a.name),
                "hosts": ["local"],
                "accounts": {
                    "local": {"username": a.name}
                    if credentials == "certificate"
                    else {"username": a.name, "client_keys": [str(a.key)]}
                },
                "rate": 1e6,
                "burst": 1_000_000,
                "max_concurrent": 1_000_000,
            }
            for a in accounts
        ],
    }


async def post(url: str, path: str, body: bytes, token: str) -> tuple[int, bytes]:
    """POST a JSON `body` on a connection of its own (HTTP/1.1, closed after the answer):
    (status, body). Not httpx: its connection pool scans every connection at each request and
    each answer, so a thousand requests at once cost it about a second of CPU per hundred (60 %
    of the generator's CPU in py-spy's profile of a 1,000-account burst, on the 2 cores the API
    and sshd need)."""
    where = urlsplit(url)
    reader, writer = await asyncio.open_connection(where.hostname, where.port)
    try:
        writer.write(
            f"POST {path} HTTP/1.1\r\nHost: {where.netloc}\r\n"
            f"Authorization: Bearer {token}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
        head = await reader.readuntil(b"\r\n\r\n")
        answer = await reader.read()  # to the end: the server closes after its answer
    except asyncio.IncompleteReadError as exc:
        raise EOFError("the API closed the connection before its answer") from exc
    finally:
        writer.close()
    length = re.search(rb"(?im)^content-length:\s*(\d+)\s*$", head)
    if length is not None and len(answer) < int(length[1]):
        # A replica killed between its answer's head and its body (`--fault replica`).
        raise EOFError("the API closed the connection in the middle of its answer")
    return int(head.split(b" ", 2)[1]), answer


class PrivateRedis:
    """A Redis of this run's own on a free port, nothing on disk (`--fault redis` kills it)."""

    def __init__(self, data_dir: Path) -> None:
        self.port = free_port()
        self.dir = data_dir
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            *("redis-server", "--port", str(self.port), "--bind", "127.0.0.1"),
            *("--save", "", "--appendonly", "no", "--dir", str(self.dir)),
            stdout=asyncio.subprocess.DEVNULL,
        )
        async with asyncio.timeout(30):
            while True:
                try:
                    _, writer = await asyncio.open_connection("127.0.0.1", self.port)
                except OSError:
                    await asyncio.sleep(0.05)
                    continue
                writer.close()
                return

    async def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()


async def redis_fault(redis: PrivateRedis, at: float, down: float) -> tuple[float, float]:
    """SIGKILL `redis` `at` s into the cell, start it again (empty) `down` s later: (killed,
    back) in seconds from the cell's start."""
    t0 = time.perf_counter()
    await asyncio.sleep(at)
    await redis.kill()
    killed = time.perf_counter() - t0
    await asyncio.sleep(down)
    await redis.start()
    return round(killed, 2), round(time.perf_counter() - t0, 2)


def kill_a_worker(api_pid: int) -> bool:
    """SIGKILL one worker of the API at `api_pid` (its supervisor starts another)."""
    for pid in children(api_pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn" in cmdline:
            os.kill(pid, signal.SIGKILL)
            return True
    return False


async def worker_fault(api_pid: int, at: float) -> list[float]:
    """`kill_a_worker` `at` s into the cell: [seconds into the cell], or [] when it found none."""
    t0 = time.perf_counter()
    await asyncio.sleep(at)
    killed = await asyncio.to_thread(kill_a_worker, api_pid)
    return [round(time.perf_counter() - t0, 2)] if killed else []


def metric(text: str, name: str) -> int:
    """The sum of metric `name`'s samples in a /metrics answer."""
    lines = [x for x in text.splitlines() if x.startswith(name + "{")]
    return sum(int(float(x.split()[-1])) for x in lines)


async def replica_fault(via: ViaApi, at: float, budget: int) -> list[float | None]:
    """SIGKILL the first replica (and its workers) `at` s into the cell, then watch the
    survivors' /metrics: [killed, when no survivor counts its lease any more (the processes
    holding leases drop to the survivors'), when a survivor's share is the whole `budget`]
    in seconds into the cell (None: not within 20 s of the kill)."""
    t0 = time.perf_counter()
    await asyncio.sleep(at)
    await asyncio.to_thread(via.kill, 0)
    killed = time.perf_counter() - t0
    freed: float | None = None
    full: float | None = None
    processes = (len(via.urls) - 1) * via.workers
    async with httpx.AsyncClient(timeout=5) as client:
        while time.perf_counter() - t0 < killed + 20 and (freed is None or full is None):
            texts = []
            for url in via.live:
                with contextlib.suppress(httpx.HTTPError):
                    texts.append((await client.get(url + "/metrics")).text)
            now = round(time.perf_counter() - t0, 2)
            if (
                freed is None
                and texts
                and all(0 < metric(t, "sshpool_sshd_processes") <= processes for t in texts)
            ):
                freed = now
            if full is None and any(
                metric(t, "sshpool_sshd_share_connections") >= budget for t in texts
            ):
                full = now
            await asyncio.sleep(0.25)
    return [round(killed, 2), freed, full]


class ViaPool:
    """Each command through a Pool of this process."""

    def __init__(self, host: LocalHost, accounts: list[Account], lim: Limits, deadline: float):
        self.targets = [dataclasses.replace(a.target(host), limits=lim) for a in accounts]
        self.deadline = deadline
        self.pool = Pool()

    async def __aenter__(self) -> ViaPool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.pool.close()

    async def one(self, i: int) -> str:
        try:
            target = self.targets[i]
            result = await self.pool.run(
                target, ["true"], timeout=30, acquire_timeout=self.deadline
            )
            return "ok" if result.ok else f"exit {result.exit_status}"
        except SSHPoolError as exc:
            return type(exc).__name__

    def budget(self) -> tuple[int, int]:
        """(evictions, connections held at most) as the pool's budget counts them."""
        evicted = sum(s["counters"].get("evicted", 0) for s in self.pool.stats().values())
        held = max((s["connections_max"] for s in self.pool.sshd_stats().values()), default=0)
        return evicted, held

    def cpu(self) -> float:
        """CPU seconds of the SSH client so far: this process."""
        return own_seconds()


class ViaApi:
    """Each command a POST /v1/jobs to a fresh API (`sshapi serve`, `workers` processes sharing
    each sshd's budget: through Redis at `redis_url`, else in static shares), as its account's
    caller; `replicas` of them on one PostgreSQL schema, the requests spread round robin."""

    def __init__(
        self,
        host: LocalHost,
        accounts: list[Account],
        lim: Limits,
        deadline: float,
        workers: int = 1,
        redis_url: str | None = None,
        replicas: int = 1,
        credentials: str = "keys",
    ):
        from api.config import Config
        from api.local import local_token
        from api.settings import Settings

        self.data = Path(tempfile.mkdtemp(prefix="accounts-api-"))
        secret = secrets.token_urlsafe(32)
        self.config = config(host, accounts, lim, deadline, credentials)
        self.env = {
            "SSHAPI_JWT_SECRET": secret,
            "SSHAPI_LOG_LEVEL": "error",
            "SSHAPI_WORKERS": str(workers),
        }
        if redis_url:
            self.env["SSHAPI_REDIS_URL"] = redis_url
        self.replicas, self.workers = replicas, workers
        self.schema: str | None = None
        if replicas > 1:
            self.schema = f"sshapi_accounts_{uuid.uuid4().hex[:12]}"
            self.env |= {
                "SSHAPI_DATABASE_URL": PG_URL,
                "SSHAPI_DATABASE_SCHEMA": self.schema,
                "SSHAPI_REPLICAS": str(replicas),
            }
        parsed = Config.model_validate(self.config)
        settings = Settings(jwt_secret=SecretStr(secret), data_dir=self.data)
        scopes = ["jobs:read", "jobs:write"]
        self.tokens = [
            local_token(settings, parsed, SUBJECT.format(a.name), scopes) for a in accounts
        ]
        self.timeout = deadline + 60

    async def __aenter__(self) -> ViaApi:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.urls: list[str] = []
        for n in range(1, self.replicas + 1):  # one by one: the first creates the schema
            name = f"r{n}"
            data = self.data if self.replicas == 1 else self.data / name
            proc, url = await asyncio.to_thread(
                serve_config,
                self.config,
                backend="asyncssh",
                data_dir=data,
                log=data / "api.log",
                env={**self.env, "SSHAPI_REPLICA": name},
            )
            self.procs.append(proc)
            self.urls.append(url)
        self.proc, self.url = self.procs[0], self.urls[0]
        # The replicas in the rotation, and the next one's place in it.
        self.live = list(self.urls)
        self._turn = 0
        return self

    async def __aexit__(self, *exc: object) -> None:
        for proc in self.procs:
            await asyncio.to_thread(stop_api, proc)
        if self.schema is not None:
            await drop_schema(PG_URL, self.schema)

    def kill(self, n: int) -> None:
        """SIGKILL replica `n` and its workers; it leaves the rotation."""
        with contextlib.suppress(ValueError):
            self.live.remove(self.urls[n])
        for pid in [*children(self.procs[n].pid), self.procs[n].pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    async def one(self, i: int) -> str:
        body = json.dumps({"host": "local", "argv": ["true"]}).encode()
        while True:
            if not self.live:
                return "no replica"
            self._turn += 1
            url = self.live[self._turn % len(self.live)]
            try:
                status, answer = await asyncio.wait_for(
                    post(url, "/v1/jobs", body, self.tokens[i]), self.timeout
                )
                break
            except ConnectionRefusedError:
                # Never reached it: out of the rotation, the request to the next one.
                with contextlib.suppress(ValueError):
                    self.live.remove(url)
            except (OSError, EOFError, ValueError, TimeoutError) as exc:
                return type(exc).__name__
        if status != 201:
            return str(status)
        state = json.loads(answer).get("state")
        return "ok" if state == "succeeded" else f"201 {state}"

    def cpu(self) -> float:
        """CPU seconds of the SSH client so far: the API processes."""
        return sum(tree_cpu(proc.pid) for proc in self.procs)

    def budget(self) -> tuple[int, int]:
        """(evictions, connections held at most) as the API's pools count them (/metrics), over
        the replicas still in the rotation (the most each held, summed)."""
        evictions = held = 0
        for url in self.live:
            resp = httpx.get(url + "/metrics", timeout=10)
            resp.raise_for_status()  # a refused read is no figure, not 0 evictions
            evictions += metric(resp.text, "sshpool_sshd_evictions_total")
            held += metric(resp.text, "sshpool_sshd_connections_max")
        return evictions, held


async def cell(
    host: LocalHost, accounts: list[Account], lim: Limits, part: str, args: argparse.Namespace
) -> dict[str, Any]:
    offset = host.log_path.stat().st_size
    statuses: Counter[str] = Counter()
    hist = hdr.histogram()
    via: ViaApi | ViaPool
    redis: PrivateRedis | None = None
    if args.fault == "redis" or (args.replicas > 1 and not args.redis_url):
        redis = PrivateRedis(Path(tempfile.mkdtemp(prefix="accounts-redis-")))
        await redis.start()
    if args.via == "api":
        via = ViaApi(
            host,
            accounts,
            lim,
            args.deadline,
            args.workers,
            redis.url if redis else args.redis_url,
            args.replicas,
            args.credentials,
        )
    else:
        via = ViaPool(host, accounts, lim, args.deadline)
    max_held = max_paged = 0
    source = "netlink"
    try:
        async with via:

            async def sample() -> None:
                nonlocal max_held, max_paged, source
                while True:
                    max_paged = max(max_paged, connections(host.port))
                    now = await established(host.port)
                    if now is None:
                        source, now = "/proc/net/tcp", max_paged
                    max_held = max(max_held, now)
                    await asyncio.sleep(0.1)

            def record(status: str, send: float) -> None:
                statuses[status] += 1
                hist.record_value(max(1, int((time.perf_counter() - send) * 1e6)))

            async def timed(i: int, send: float) -> None:
                record(await via.one(i), send)

            sampler = asyncio.create_task(sample())
            assert host.pid is not None
            cpu0 = (via.cpu(), tree_cpu(host.pid), own_seconds())
            t0 = time.perf_counter()
            fault: asyncio.Task[Any] | None = None
            if args.fault == "redis" and redis is not None:
                fault = asyncio.create_task(redis_fault(redis, args.fault_at, args.fault_down))
            elif args.fault == "replica" and isinstance(via, ViaApi):
                budget = int(lim.max_total_connections)
                fault = asyncio.create_task(replica_fault(via, args.fault_at, budget))
            elif args.fault == "worker" and isinstance(via, ViaApi):
                fault = asyncio.create_task(worker_fault(via.proc.pid, args.fault_at))
            if part == "burst":
                await asyncio.gather(*(timed(i, t0) for i in range(len(accounts))))
            else:
                await open_model(timed, len(accounts), args.rate, args.duration, t0)
            makespan = time.perf_counter() - t0
            sampler.cancel()
            killed = None if fault is None else await fault
            memory = sshd_memory(host)
            # sshd's CPU: its listener's reaped children, so the connections closed by now.
            cpu = (via.cpu() - cpu0[0], tree_cpu(host.pid) - cpu0[1], own_seconds() - cpu0[2])
            try:
                evictions, held = await asyncio.to_thread(via.budget)
            except httpx.HTTPError as exc:
                # An API too busy to answer /metrics in 10 s: the run's other figures stand.
                print(json.dumps({"budget_figures": f"not read: {exc!r}"}), flush=True)
                evictions = held = -1
    finally:
        if redis is not None:
            # Never left running (it would hold our stderr open).
            await redis.kill()
    handshakes = log_count(host, offset, b"Accepted publickey")
    p = hdr.percentiles(hist)
    return {
        "via": args.via,
        "part": part,
        "accounts": len(accounts),
        "statuses": dict(statuses),
        "failed": sum(v for k, v in statuses.items() if k != "ok"),
        "p50_ms": p["p50"],
        "p90_ms": p["p90"],
        "p99_ms": p["p99"],
        "makespan_s": round(makespan, 2),
        "handshakes": handshakes,
        "handshakes_per_s": round(handshakes / makespan, 1),
        "evictions": evictions,
        "client_cpu_ms_per_job": round(cpu[0] / max(1, hist.get_total_count()) * 1000, 2),
        "sshd_cpu_ms_per_job": round(cpu[1] / max(1, hist.get_total_count()) * 1000, 2),
        # This process: through the API the generator (its share of the 2 cores), through the
        # pool the SSH client again.
        "generator_cpu_ms_per_job": round(cpu[2] / max(1, hist.get_total_count()) * 1000, 2),
        # The kernel's count (netlink, one walk of its table: `established`), and the same
        # read page by page (`connections`: it can add up a close and a later open).
        "connections_max": max_held,
        "connections_source": source,
        "connections_max_paged": max_paged,
        # The budget's own count (held + closing, and handshakes in flight).
        "budget_connections_max": held,
        "sshd_drop_lines": drops(host, offset),
        # --fault redis: when its Redis was SIGKILLed and when it answered again (s into it);
        # --fault worker: when a worker was SIGKILLed; --fault replica: when the first replica
        # was SIGKILLed, when its leases were freed, when a survivor's share was the budget.
        "fault_s": killed,
        "sshd_processes": memory[0],
        "sshd_rss_mib": memory[1],
        "sshd_pss_mib": memory[2],
    }


async def open_model(
    timed: Callable[[int, float], Coroutine[Any, Any, None]],
    accounts: int,
    rate: float,
    duration: float,
    t0: float,
) -> None:
    """`rate` commands per second for `duration` seconds, sent on schedule whatever the answers,
    each from a random account."""
    tasks: list[asyncio.Task[None]] = []
    for n in range(int(rate * duration)):
        send = t0 + n / rate
        await asyncio.sleep(max(0.0, send - time.perf_counter()))
        tasks.append(asyncio.create_task(timed(random.randrange(accounts), send)))
    await asyncio.gather(*tasks)


async def run_cells(
    host: LocalHost, accounts: list[Account], args: argparse.Namespace
) -> list[dict[str, Any]]:
    per_mode = {
        "budget": dataclasses.replace(
            limits("pooled"),
            max_handshakes=args.max_handshakes,
            max_total_connections=args.max_total_connections,
        ),
        "per-account": limits("per-account"),
    }
    rows = []
    parts = [p for p in args.parts if p == "burst" or args.rate > 0]
    certificates = args.via == "api" and args.credentials == "certificate"
    ceilings = [await ceiling(host, accounts, args.ceiling)] if args.ceiling > 0 else []
    # With certificates, sshd does more per login (the certificate, the principals command):
    # its ceiling for the same logins, measured too, beside the issue's key ceiling.
    cert_ceilings = (
        [await ceiling(host, accounts, args.ceiling, certificates=True)]
        if ceilings and certificates
        else []
    )
    for round_ in range(args.rounds):
        # Interleaved, the order flipped every round: neither mode always runs first.
        modes = args.modes if round_ % 2 == 0 else args.modes[::-1]
        for part in parts:
            for mode in modes:
                figures = await cell(host, accounts, per_mode[mode], part, args)
                row = {"mode": mode, "round": round_ + 1, **figures}
                if ceilings:
                    # The makespan against the issue's target: accounts / the ceiling.
                    row["ceiling_per_s"] = ceilings[0]
                    row["makespan_x_floor"] = round(
                        row["makespan_s"] / (len(accounts) / ceilings[0]), 2
                    )
                if cert_ceilings:
                    row["certificate_ceiling_per_s"] = cert_ceilings[0]
                    row["makespan_x_certificate_floor"] = round(
                        row["makespan_s"] / (len(accounts) / cert_ceilings[0]), 2
                    )
                row["load"] = [round(x, 2) for x in os.getloadavg()]
                print(json.dumps(row), flush=True)
                rows.append(row)
                await asyncio.sleep(args.pause)
    if ceilings:
        after = await ceiling(host, accounts, args.ceiling)
        print(json.dumps({"ceiling_per_s": [ceilings[0], after]}), flush=True)
    if cert_ceilings:
        after = await ceiling(host, accounts, args.ceiling, certificates=True)
        print(json.dumps({"certificate_ceiling_per_s": [cert_ceilings[0], after]}), flush=True)
    return rows


async def ceiling(
    host: LocalHost, accounts: list[Account], seconds: float, *, certificates: bool = False
) -> float:
    """The handshake ceiling now: connections per second the sshd completes with 6 handshakes
    in flight (fresh connection, login, `true`, close; loadtests.handshakes), each account
    logging in with its key or (`certificates`) with a fresh certificate of the rig's user CA,
    as the API's certificate logins do."""
    from loadtests.handshakes import cell as handshake_cell

    if certificates:
        targets = [host.certificate_target(a.name, username=a.name) for a in accounts]
    else:
        targets = [a.target(host) for a in accounts]
    row = await handshake_cell(host, targets, 6, seconds)
    print(
        json.dumps({"ceiling": {"credentials": "certificate" if certificates else "keys", **row}}),
        flush=True,
    )
    return float(row["handshakes_per_s"])


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "mode        via  round part  accts failed  p50ms  p90ms  p99ms  make_s  hs/s evict "
        "conn_max held drops procs rss_MiB pss_MiB cli_ms sshd_ms"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['mode']:11} {r['via']:4} {r['round']:5} {r['part']:5} {r['accounts']:5} "
            f"{r['failed']:6} {r['p50_ms'] or 0:6.0f} {r['p90_ms'] or 0:6.0f} "
            f"{r['p99_ms'] or 0:6.0f} {r['makespan_s']:7.2f} {r['handshakes_per_s']:5} "
            f"{r['evictions']:5} {r['connections_max']:8} {r['budget_connections_max']:4} "
            f"{r['sshd_drop_lines']:5} "
            f"{r['sshd_processes']:5} {r['sshd_rss_mib']:7} {r['sshd_pss_mib']:7} "
            f"{r['client_cpu_ms_per_job']:6} "
            f"{r['sshd_cpu_ms_per_job']:7}"
        )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m loadtests.accounts", description=__doc__)
    parser.add_argument("--accounts", type=int, default=200)
    parser.add_argument("--via", choices=("api", "pool"), default="api")
    parser.add_argument("--rounds", type=int, default=1, help="A/B rounds, interleaved")
    parser.add_argument("--rate", type=float, default=0.0, help="commands/s of part (b); 0: none")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of part (b)")
    parser.add_argument("--deadline", type=float, default=30.0, help="acquire timeout, s")
    parser.add_argument("--pause", type=float, default=5.0, help="seconds between cells")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--parts", nargs="+", choices=("burst", "rate"), default=["burst", "rate"])
    parser.add_argument(
        "--max-handshakes", type=int, default=Limits().max_handshakes, help="the budget's gate"
    )
    parser.add_argument(
        "--max-total-connections",
        type=int,
        default=Limits().max_total_connections,
        help="the budget's connections to the sshd",
    )
    parser.add_argument(
        "--workers", type=int, default=1, help="--via api: API processes (SSHAPI_WORKERS)"
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="--via api: `sshapi serve` processes on one PostgreSQL schema and one Redis, the "
        "requests spread round robin",
    )
    parser.add_argument(
        "--redis-url",
        default=None,
        help="--via api: SSHAPI_REDIS_URL (the workers lease each sshd's budget; else static "
        "shares)",
    )
    parser.add_argument(
        "--fault",
        choices=("redis", "worker", "replica"),
        default=None,
        help="redis: each cell with a Redis of its own, SIGKILLed --fault-at s into the cell and "
        "started again (empty) --fault-down s later (the workers' budget falls back to static "
        "shares, then leases again); worker: one API worker SIGKILLed --fault-at s into the "
        "cell (its leases lapse; its jobs are lost)",
    )
    parser.add_argument(
        "--credentials",
        choices=("keys", "certificate"),
        default="keys",
        help="--via api: each account's key file, or certificates the API mints (the rig's CA)",
    )
    parser.add_argument(
        "--ceiling",
        type=float,
        default=0.0,
        help="seconds to measure the handshake ceiling (loadtests.handshakes, 6 in flight) "
        "before the first cell and after the last; 0: not measured",
    )
    parser.add_argument("--fault-at", type=float, default=1.0)
    parser.add_argument("--fault-down", type=float, default=1.0)
    parser.add_argument("--data-dir", default=".data-accounts")
    return parser


def options(**given: Any) -> argparse.Namespace:
    """This program's options at their defaults, with `given` set: what `cell` reads, for a
    caller that runs a cell of its own (loadtests.bench)."""
    args = _parser().parse_args([])
    vars(args).update(given)
    return args


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.via == "pool" and (args.workers != 1 or args.replicas != 1 or args.fault):
        parser.error("--workers, --replicas and --fault need --via api")
    if args.fault == "replica" and args.replicas < 2:
        parser.error("--fault replica needs --replicas 2 or more")
    return args


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The accounts, the stock host logging them in, and every cell: one row per cell."""
    data_dir = Path(args.data_dir).absolute()
    accounts = ensure_accounts(args.accounts, data_dir=data_dir)
    with LocalHost("accounts", "stock", data_dir=data_dir, researchers=True) as host:
        return asyncio.run(run_cells(host, accounts, args))


def main(argv: list[str] | None = None) -> int:
    print(table(measure(parse(argv))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
