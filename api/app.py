"""The FastAPI application factory. The lifespan owns
the pool and the store (tests may inject their own; injected objects stay the caller's to start
and close). Nothing here imports the dev rig (`sshpool.devhost`): without a configuration the
app reads what `sshapi dev` left as a plain file (api/local.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI

from api import docs, problems
from api.auth import Authenticator
from api.config import Config, HostConfig
from api.deps import Services
from api.files import FileService
from api.gate import TokenGate
from api.jobs.batch import BatchJobs
from api.jobs.service import JobService
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
from api.settings import Settings
from api.store import Store
from api.tls import tls_context
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
        the_store = store or Store(settings.resolved_database_url, schema=settings.database_schema)
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
