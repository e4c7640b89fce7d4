"""The FastAPI application factory: the app, its routes and middleware, and a lifespan that
runs api/services.py's `running` (every long-lived object and background task; tests may inject
their own pool and store, which stay the caller's to start and close). Nothing here imports the
dev rig (`sshpool.devhost`): without a configuration the app reads what `sshapi dev` left as a
plain file (api/local.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib.metadata import version

from fastapi import FastAPI

from api import docs, problems, tracing
from api.config import Config
from api.gate import TokenGate
from api.local import resolve_config
from api.metrics import Metrics
from api.middleware import RequestContext
from api.routes.admin import router as admin_router
from api.routes.files import router as files_router
from api.routes.hosts import router as hosts_router
from api.routes.jobs import router as jobs_router
from api.routes.live import router as live_router
from api.routes.nodes import router as nodes_router
from api.routes.ops import router as ops_router
from api.routes.portals import router as portals_router
from api.routes.webhooks import router as webhooks_router
from api.routes.whoami import router as whoami_router
from api.services import running
from api.settings import Settings
from api.store import Store
from sshpool import Pool

DESCRIPTION = """\
Run commands on HPC login hosts over pooled, multiplexed SSH connections.

Authenticate with `Authorization: Bearer <JWT>` (scopes `jobs:read`, `jobs:write`,
`files:read`, `files:write`, `admin`).
`POST /v1/jobs` answers 201 with the result when the command finishes within `Prefer: wait=N`
seconds (default 30), else 202 with `Location` to poll. Errors are `application/problem+json`.
Output is decoded as UTF-8 with invalid bytes replaced by U+FFFD.
"""


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
    # Traces when an OTEL_* variable asks for them (api/tracing.py); off, nothing is loaded.
    traced = tracing.configure(settings.replica)
    if traced:
        tracing.install_log_ids()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with running(settings, config, metrics, pool=pool, store=store) as services:
            app.state.services = services
            yield

    app = FastAPI(
        title="sshapi",
        version=version("sshapi"),  # the /docs badge: the installed package's, not a constant
        description=DESCRIPTION,
        lifespan=lifespan,
        docs_url=None,  # api/docs.py serves /docs and /redoc offline
        redoc_url=None,
        # FastAPI's own OpenTelemetry (0.16x) turns itself on in any app of a process with a
        # tracer provider: off, our middleware makes the request's span (api/tracing.py; it
        # cost less CPU per request: docs/benchmarks.md). Older FastAPI ignores the argument.
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    docs.install(app)
    problems.install(app)
    routers = (
        portals_router,  # first: /v1/jobs/events is the change feed, not a job
        jobs_router,
        live_router,
        webhooks_router,
        hosts_router,
        whoami_router,
        nodes_router,
        files_router,
        admin_router,
        ops_router,
    )
    for router in routers:
        app.include_router(router)
    # Added first, so it runs inside RequestContext (request id, metrics, body cap) and before
    # the router: the token is checked before any body is read (api/gate.py).
    app.add_middleware(TokenGate, routes=[route for r in routers for route in r.routes])
    app.add_middleware(
        RequestContext, metrics=metrics, max_body=config.api.max_body_bytes, traced=traced
    )
    return app
