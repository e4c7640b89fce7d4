"""`Annotated` dependency aliases: route signatures say what they need, not how to get it."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.routing import BaseRoute

from api.auth import Principal
from api.handles import is_handle
from api.problems import Problem, revoked, unauthorized
from api.services import Services
from api.timing import stage


# async, though it never awaits: FastAPI runs a plain `def` dependency in a worker thread,
# one thread hop per request for an attribute read.
async def get_services(request: Request) -> Services:
    services: Services = request.app.state.services
    return services


# auto_error=False: a missing header is our 401 problem, not FastAPI's 403.
bearer = HTTPBearer(auto_error=False, description="A JWT from your identity provider.")

# The key in the request's scope state under which api/gate.py leaves the principal it
# verified, so that the route's own dependency does not verify the token a second time.
PRINCIPAL = "sshapi.principal"


async def authenticate(
    svc: Services, credentials: HTTPAuthorizationCredentials | None
) -> Principal:
    """The token check, wherever it runs (api/gate.py ahead of the app, `get_principal` in a
    route): 401 with `WWW-Authenticate` without a bearer token, else api/auth.py's verdict."""
    if credentials is None:
        raise Problem(
            401,
            "unauthorized",
            "Unauthorized",
            "send Authorization: Bearer <token>",
            headers={"WWW-Authenticate": 'Bearer realm="sshapi"'},
        )
    token = credentials.credentials
    with stage("auth"):
        if is_handle(token):
            who = await svc.handles.authenticate(token)
        else:
            who = await svc.auth.authenticate(token)
    refuse_revoked(svc, who)
    return who


def refuse_revoked(svc: Services, who: Principal) -> None:
    """403 `identity-revoked` when a revocation refuses `who`; for a job handle whose creator
    is refused, 401: the handle itself is over (api/handles.py)."""
    if svc.revocations.refused(who) is not None:
        if who.handle is not None:
            raise unauthorized("the handle's creator was revoked")
        raise revoked()


async def get_principal(
    request: Request,
    svc: Annotated[Services, Depends(get_services)],
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
) -> Principal:
    """The caller. A route needs a token exactly when this is among its dependencies
    (`needs_token`): that is the one place deciding which paths are public."""
    known = request.scope.get("state", {}).get(PRINCIPAL)
    if isinstance(known, Principal):
        # Verified by api/gate.py when the headers came; FastAPI has read the body since:
        # a revocation made meanwhile refuses it here, before the route does anything.
        refuse_revoked(svc, known)
        return known
    return await authenticate(svc, credentials)


def needs_token(route: BaseRoute) -> bool:
    """Whether `route` checks a token: whether `get_principal` is among its dependencies, at
    any depth. Public routes (probes, metrics, docs, static files) have none of it."""
    if not isinstance(route, APIRoute):
        return False
    pending: list[Dependant] = [route.dependant]
    while pending:
        dependant = pending.pop()
        if dependant.call is get_principal:
            return True
        pending.extend(dependant.dependencies)
    return False


def require(scope: str) -> Callable[..., Coroutine[Any, Any, Principal]]:
    async def check(who: Annotated[Principal, Depends(get_principal)]) -> Principal:
        if not who.has(scope):
            raise Problem(
                403,
                "insufficient-scope",
                "Insufficient scope",
                f"this needs the {scope!r} scope",
                headers={"WWW-Authenticate": f'Bearer error="insufficient_scope", scope="{scope}"'},
            )
        return who

    return check


_write_scope = require("jobs:write")


async def may_cancel(who: Annotated[Principal, Depends(get_principal)]) -> Principal:
    """`jobs:write`, or a job handle made with `cancel: true` (its job only: the service's
    `get` confines it)."""
    if who.handle is None:
        return await _write_scope(who)
    if not who.handle.cancel:
        raise Problem(403, "insufficient-scope", "Insufficient scope",
                      "this handle was made without `cancel`: it only reads")  # fmt: skip
    return who


Svc = Annotated[Services, Depends(get_services)]
Caller = Annotated[Principal, Depends(get_principal)]
Reader = Annotated[Principal, Depends(require("jobs:read"))]
Writer = Annotated[Principal, Depends(require("jobs:write"))]
Canceller = Annotated[Principal, Depends(may_cancel)]
FileReader = Annotated[Principal, Depends(require("files:read"))]
FileWriter = Annotated[Principal, Depends(require("files:write"))]
