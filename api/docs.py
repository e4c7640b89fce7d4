"""/docs (Swagger UI) and /redoc with no request leaving the host: their JavaScript and CSS come
from the installed fastapi-offline package (Swagger UI, Apache-2.0; ReDoc, MIT), served under
/static-docs, and a Content-Security-Policy keeps the browser on this origin (ReDoc's sidebar
would otherwise load its logo from a CDN). HPC service networks are often offline."""

from __future__ import annotations

from importlib.resources import files

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

STATIC_URL = "/static-docs"
# 'unsafe-inline': both pages start their bundle from an inline script; blob: for ReDoc's worker.
CSP = (
    "default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; font-src 'self' data:; connect-src 'self'; worker-src 'self' blob:"
)


def install(app: FastAPI) -> None:
    """Serve /docs and /redoc for `app` (created with docs_url=None, redoc_url=None)."""
    static = files("fastapi_offline") / "static"
    app.mount(STATIC_URL, StaticFiles(directory=str(static)), name="static-docs")
    openapi_url = app.openapi_url or "/openapi.json"

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        page = get_swagger_ui_html(
            openapi_url=f"{root}{openapi_url}",
            title=f"{app.title} - Swagger UI",
            swagger_js_url=f"{root}{STATIC_URL}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{STATIC_URL}/swagger-ui.css",
            swagger_favicon_url=f"{root}{STATIC_URL}/favicon.png",
            # Swagger UI would send the spec's URL to validator.swagger.io from a non-local host.
            swagger_ui_parameters={"validatorUrl": None},
        )
        page.headers["Content-Security-Policy"] = CSP
        return page

    @app.get("/redoc", include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        page = get_redoc_html(
            openapi_url=f"{root}{openapi_url}",
            title=f"{app.title} - ReDoc",
            redoc_js_url=f"{root}{STATIC_URL}/redoc.standalone.js",
            redoc_favicon_url=f"{root}{STATIC_URL}/favicon.png",
            with_google_fonts=False,
        )
        page.headers["Content-Security-Policy"] = CSP
        return page
