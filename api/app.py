"""The FastAPI application factory and `serve`, which runs it under uvicorn. The lifespan owns
the pool and the store (tests may inject their own; injected objects stay the caller's to start
and close). Nothing here imports the dev rig (`sshpool.devhost`): without a configuration the
app reads what `sshapi dev` left as a plain file (api/local.py)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import multiprocessing
import os
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI

from api import docs, problems
from api.auth import Authenticator
from api.batch import BatchJobs
from api.client import tls_context
from api.config import Config, HostConfig
from api.deps import Services
from api.files import FileService
from api.gate import TokenGate
from api.jobs import JobService
from api.local import resolve_config
from api.metrics import Metrics
from api.middleware import RequestContext
from api.policy import Policy
from api.quota import make_quota
from api.relay import make_relay
from api.routes.files import router as files_router
from api.routes.hosts import router as hosts_router
from api.routes.jobs import router as jobs_router
from api.routes.live import router as live_router
from api.routes.ops import router as ops_router
from api.server import EdgeLimits, connection_limit, guarded_protocol
from api.settings import Settings
from api.store import Store
from sshpool import Pool, SSHPoolError

log = logging.getLogger("sshapi")

DESCRIPTION = """\
Run commands on HPC login hosts over pooled, multiplexed SSH connections.

Authenticate with `Authorization: Bearer <JWT>` (scopes `jobs:read`, `jobs:write`,
`files:read`, `files:write`, `admin`).
`POST /v1/jobs` answers 201 with the result when the command finishes within `Prefer: wait=N`
seconds (default 30), else 202 with `Location` to poll. Errors are `application/problem+json`.
Output is decoded as UTF-8 with invalid bytes replaced by U+FFFD.
"""


async def _prewarm(pool: Pool, name: str, host: HostConfig) -> None:
    try:
        await pool.prewarm(host.target())
    except SSHPoolError as exc:
        # Not fatal: the host may come up later; jobs then connect on demand.
        log.warning("prewarm of host %s failed: %s", name, exc)


def create_app(
    settings: Settings | None = None,
    *,
    pool: Pool | None = None,
    store: Store | None = None,
    config: Config | None = None,
) -> FastAPI:
    settings = settings or Settings()
    config = config or resolve_config(settings)
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        settings.secure_data_dir()
        own_store = store is None
        the_store = store or Store(
            settings.resolved_database_url,
            schema=settings.database_schema,
            upgrade=settings.db_upgrade == "auto",
        )
        if own_store:
            await the_store.start()
        lost = await the_store.mark_lost(settings.replica)
        if lost:
            log.warning("%d job(s) left active by a previous run are now `lost`", lost)
        own_pool = pool is None
        the_pool = pool or Pool(backend=settings.backend)
        http = httpx.AsyncClient(follow_redirects=False, verify=tls_context())
        policy = Policy(config)
        quota = make_quota(settings.redis_url)
        batch = BatchJobs(config, policy, the_store, the_pool, metrics, quota)
        services = Services(
            settings=settings,
            config=config,
            policy=policy,
            auth=Authenticator(config.issuers, settings.hs256_secret, http),
            store=the_store,
            pool=the_pool,
            jobs=JobService(
                config,
                policy,
                the_store,
                the_pool,
                metrics,
                settings.replica,
                batch,
                quota,
                make_relay(settings.redis_url, settings.replica),
            ),
            metrics=metrics,
            http=http,
            files=FileService(config, policy, the_pool, quota, metrics),
        )
        for name, host in config.hosts.items():
            # Every worker of every replica has its own pool: the host sees all of them.
            for problem in host.ssh_budget(settings.replicas * settings.workers):
                log.warning("SSH budget of host %s: %s", name, problem)

        def pools_by_host() -> dict[str, list[dict[str, Any]]]:
            stats = the_pool.stats()
            return {n: [stats[t] for t in policy.targets(n) if t in stats] for n in config.hosts}

        metrics.watch_pool(pools_by_host)
        metrics.watch_trackers(lambda: batch.trackers)
        await batch.start(settings.replica)
        app.state.services = services
        warm = [
            asyncio.create_task(_prewarm(the_pool, name, host))
            for name, host in config.hosts.items()
            if host.limits.min_connections > 0
        ]
        services.ready = True
        try:
            yield
        finally:
            services.ready = False
            for task in warm:
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*warm, return_exceptions=True)
            await services.jobs.close(settings.shutdown_grace)
            await services.jobs.quota.close()
            if own_pool:
                await the_pool.close()
            await http.aclose()
            if own_store:
                await the_store.close()

    app = FastAPI(
        title="sshapi",
        version="1.0.0",
        description=DESCRIPTION,
        lifespan=lifespan,
        docs_url=None,  # api/docs.py serves /docs and /redoc offline
        redoc_url=None,
    )
    docs.install(app)
    problems.install(app)
    routers = (jobs_router, live_router, hosts_router, files_router, ops_router)
    for router in routers:
        app.include_router(router)
    # Added first, so it runs inside RequestContext (request id, metrics, body cap) and before
    # the router: the token is checked before any body is read (api/gate.py).
    app.add_middleware(TokenGate, routes=[route for r in routers for route in r.routes])
    app.add_middleware(RequestContext, metrics=metrics, max_body=config.api.max_body_bytes)
    return app


# Seconds between checks of the workers; a worker that died is started again after this.
SUPERVISE_INTERVAL = 0.5


def _configure_logging(settings: Settings) -> None:
    level = logging.getLevelNamesMapping().get(settings.log_level.upper(), logging.INFO)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    # asyncssh logs every channel at INFO: far too much for a server running hundreds a second.
    logging.getLogger("asyncssh").setLevel(max(level, logging.WARNING))


def _uvicorn_options(settings: Settings, config: Config) -> dict[str, Any]:
    """What every server process runs uvicorn with: the keep-alive timeout clients rely on, and
    the edge bounds of api/server.py (header size, header and body deadlines, connections in
    all and per address)."""
    policy = Policy(config)
    ssh = sum(h.limits.max_connections * len(policy.targets(n)) for n, h in config.hosts.items())
    limits = EdgeLimits(
        max_header_bytes=settings.max_header_bytes,
        header_timeout=settings.header_timeout,
        body_timeout=settings.body_timeout,
        body_min_rate=settings.body_min_rate,
        max_connections=connection_limit(settings.max_connections, ssh),
        max_per_address=settings.max_connections_per_address,
        trusted_proxies=settings.trusted_proxy_networks,
    )
    return {
        "log_level": settings.log_level,
        "ws": "none",
        "timeout_keep_alive": settings.keepalive_timeout,
        "http": guarded_protocol(limits),
        # The same list decides whose X-Forwarded-For is believed (the client address in logs).
        "forwarded_allow_ips": settings.trusted_proxies,
    }


def serve(settings: Settings, config: Config | None = None) -> None:
    """Run the API in this process until it is stopped: logging at `settings.log_level`, the
    app from `create_app(settings, config=config)`, uvicorn on `settings.host:settings.port`.
    With `settings.workers` > 1, that many worker processes share the port (`_supervise`)."""
    _configure_logging(settings)
    config = config or resolve_config(settings)
    if (warning := per_process_limits(settings)) is not None:
        log.warning("%s", warning)
    if settings.workers > 1:
        _supervise(settings, config)
        return
    api = create_app(settings, config=config)
    _freeze_startup_heap()
    uvicorn.run(api, host=settings.host, port=settings.port, **_uvicorn_options(settings, config))


def per_process_limits(settings: Settings) -> str | None:
    """The start's warning when per-identity limits are counted by each process on its own:
    several workers (or replicas) without Redis. Each process has its own LocalQuota (api/
    quota.py), so an identity whose requests land on N processes gets up to N times each limit.
    Said at the start, with the factor, rather than found out from a user's bill."""
    processes = settings.workers * settings.replicas
    if processes == 1 or settings.redis_url:
        return None
    return (
        f"per-identity limits are counted by each of the {processes} API processes on its own "
        f"({settings.workers} worker(s) x {settings.replicas} replica(s), no SSHAPI_REDIS_URL): "
        f"an identity may get up to {processes} times each per-identity limit (the policy's "
        "rate, burst, max_concurrent and max_transfers; max_followers); set SSHAPI_REDIS_URL "
        f"to share them, or divide them by {processes} in the configuration"
    )


def _freeze_startup_heap() -> None:
    """Put every object alive before serving (the imported libraries, the app) out of the
    garbage collector's reach. Each full collection walked them all with the event loop
    stopped: 94-238 ms, about once a second at 250-400 jobs/s (gc.callbacks in the API,
    2026-11-24), and those pauses were the p99 of such rates. They live as long as the process
    anyway; whatever is allocated from here on is collected as before (the thresholds stay
    Python's: raising them let garbage holding SSH read buffers pile up, commit 76dca0f)."""
    gc.collect()
    gc.freeze()


def _exit_with_parent(parent: int) -> None:
    """A worker whose supervisor died (SIGKILL leaves no chance to stop it) shuts down
    gracefully instead of serving on as an orphan nobody supervises."""
    while os.getppid() == parent:
        time.sleep(SUPERVISE_INTERVAL)
    os.kill(os.getpid(), signal.SIGTERM)


def _worker(
    settings: Settings, config: Config, index: int, sock: socket.socket, supervisor: int
) -> None:
    """One worker process: its own app, pool and store writer, serving the inherited socket.
    `supervisor` is the parent's pid, passed in: read here, after a start of a second or two,
    the parent could already be gone (and the orphan would watch init)."""
    _configure_logging(settings)
    threading.Thread(target=_exit_with_parent, args=(supervisor,), daemon=True).start()
    settings = settings.model_copy(update={"replica": f"{settings.replica}-w{index}"})
    server = uvicorn.Server(
        uvicorn.Config(create_app(settings, config=config), **_uvicorn_options(settings, config))
    )
    _freeze_startup_heap()
    server.run(sockets=[sock])


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def _supervise(settings: Settings, config: Config) -> None:
    """Bind the port once, start `settings.workers` processes that all accept on it (the kernel
    spreads connections), and start again any that dies, under the same index. uvicorn's own
    `workers=` does the same but names no worker: here worker i is always replica
    `<replica>-w<i>`, so a restarted worker marks its own unfinished jobs `lost` (and never a
    sibling's, which a shared name would). Ctrl-C or SIGTERM stops them all."""
    sock = uvicorn.Config(None, host=settings.host, port=settings.port).bind_socket()  # type: ignore[arg-type]
    ctx = multiprocessing.get_context("spawn")

    def start(index: int) -> multiprocessing.process.BaseProcess:
        proc = ctx.Process(
            target=_worker,
            args=(settings, config, index, sock, os.getpid()),
            name=f"sshapi-worker-{index}",
        )
        proc.start()
        return proc

    # SIGTERM (systemd, `kill`) stops the workers through the `finally` below, as Ctrl-C does.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    workers = {i: start(i) for i in range(settings.workers)}
    log.info("%d workers on %s:%d", settings.workers, settings.host, settings.port)
    try:
        while True:
            time.sleep(SUPERVISE_INTERVAL)
            for index, proc in list(workers.items()):
                if not proc.is_alive():
                    log.warning("worker %d exited with %s: starting it again", index, proc.exitcode)
                    workers[index] = start(index)
    finally:
        for proc in workers.values():
            if proc.is_alive():
                proc.terminate()  # uvicorn's graceful shutdown: running jobs get the grace
        for proc in workers.values():
            proc.join(settings.shutdown_grace + 5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        sock.close()
