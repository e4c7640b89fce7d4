"""Liveness, readiness and metrics: no token needed (metrics can require admin by config)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Response
from fastapi.security import HTTPAuthorizationCredentials
from prometheus_client import CONTENT_TYPE_LATEST

from api.deps import Svc, authenticate, bearer
from api.problems import Problem

router = APIRouter(tags=["operations"])


@router.get("/healthz", summary="Liveness: the process answers")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", summary="Readiness: store reachable and pool started")
async def readyz(svc: Svc) -> dict[str, str]:
    if not svc.ready:
        raise Problem(503, "not-ready", "Not ready", "starting or stopping")
    try:
        await svc.store.ping()
    except Exception as exc:
        raise Problem(503, "not-ready", "Not ready", f"store: {type(exc).__name__}") from exc
    return {"status": "ready"}


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def metrics(
    svc: Svc,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
) -> Response:
    if svc.config.api.metrics_require_admin:
        who = await authenticate(svc, credentials)
        if not who.is_admin:
            raise Problem(403, "insufficient-scope", "Insufficient scope", "metrics need admin")
    # Redis is checked by the scrape itself: an idle API calls it for nothing, so a loss
    # would otherwise show only with the next job.
    svc.metrics.redis_up = await svc.quota.ping()
    return Response(svc.metrics.render(), media_type=CONTENT_TYPE_LATEST)
