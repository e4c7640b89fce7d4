"""The token check ahead of the app, before any byte of a body is read.

FastAPI reads a route's body (its JSON parameters) before it solves the route's dependencies, so
a request with no token, or a bad one, to a route taking a JSON body (`POST /v1/jobs`) kept its
connection waiting for that body, and a connection whose request is still arriving is one the
edge (api/server.py) gives a full deadline. `TokenGate` finds the route as the router will, and
if that route needs a token (`api.deps.needs_token`: `get_principal` among its dependencies,
the one place deciding what is public) checks the Authorization header with
`api.deps.authenticate` (api/auth.py's verification, nothing of its own). A refusal is the 401
problem the route would have answered; a success leaves the principal in the request's scope
state, where `get_principal` takes it instead of verifying the token again. Requests no route
takes (404, 405) and public routes pass through untouched.
"""

from __future__ import annotations

from collections.abc import Iterable

from starlette.requests import Request
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Receive, Scope, Send

from api.deps import PRINCIPAL, authenticate, bearer, needs_token
from api.problems import Problem


class TokenGate:
    """`routes`: the routes of the app's routers (the ones it includes, with their paths as
    served), of which those needing a token are checked here."""

    def __init__(self, app: ASGIApp, routes: Iterable[BaseRoute]) -> None:
        self.app = app
        self._guarded = [route for route in routes if needs_token(route)]

    def _route(self, scope: Scope) -> BaseRoute | None:
        """The route needing a token that `scope` is for, if any. The public routes' paths
        (probes, metrics, docs) are disjoint from these, so the first full match is the route
        the router picks."""
        for route in self._guarded:
            match, _ = route.matches(scope)
            if match is Match.FULL:
                return route
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = self._route(scope)
        services = getattr(scope["app"].state, "services", None)
        if route is None or services is None:
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        try:
            principal = await authenticate(services, await bearer(request))
        except Problem as problem:
            scope["route"] = route  # the request metrics name the route, as for any 401
            await problem.response(request.url.path)(scope, receive, send)
            return
        scope.setdefault("state", {})[PRINCIPAL] = principal
        await self.app(scope, receive, send)
