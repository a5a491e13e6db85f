"""The FastAPI application of `agents serve`: the `/v1` API, the page, `/metrics`, `/docs`, behind
the `Guard` (auth, same-site, body bounds, security headers). It holds no state of its own (one
`Client` on Redis), so any number of `serve` processes answer alike."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException

from celery_agents import __version__
from celery_agents.client import Client
from celery_agents.config import Settings
from celery_agents.errors import AgentsError, InvalidInput
from celery_agents.web import api, page
from celery_agents.web.metrics import CONTENT_TYPE, registry_for, render
from celery_agents.web.security import Credentials, Guard, Throttle

HERE = Path(__file__).parent
log = logging.getLogger("celery_agents.serve")
#: JSON escapes can make a body several times the text it carries; an agent object comes on top
_BODY_OVERHEAD = 1024 * 1024
#: the contract's code for each status the framework answers by itself
_HTTP_CODES = {400: "invalid_input", 404: "not_found", 405: "method_not_allowed"}


def create_app(settings: Settings | None = None, client: Client | None = None) -> Any:
    """The ASGI application (the FastAPI app wrapped in the `Guard`)."""
    settings = settings or Settings.from_env()
    client = (client or Client(settings)).connect()  # now, not raced for by the first requests' threads

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        client.close()

    app = FastAPI(
        title="celery-agents",
        version=__version__,
        description="Durable, step-wise LLM agent sessions: the HTTP API of `agents serve`. Bodies and replies "
        'are the CLI\'s `--json` documents; errors are `{"error": {"code", "message"}}`.',
        docs_url=None,
        redoc_url=None,
        lifespan=lifespan,
    )
    app.state.client = client
    app.state.credentials = Credentials(settings.api_token)
    app.state.metrics = registry_for(client)
    app.include_router(api.router)
    app.include_router(page.router)
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")
    _mount_docs(app)
    _handle_errors(app)

    @app.get("/metrics", include_in_schema=False)
    def metrics(request: Request) -> Response:
        return Response(render(request.app.state.metrics), media_type=CONTENT_TYPE)

    max_body = 6 * max(settings.max_prompt_bytes, settings.max_result_bytes) + _BODY_OVERHEAD
    app.state.throttle = Throttle()
    return Guard(app, app.state.credentials, max_body, app.state.throttle, settings.trusted_proxies)


def _mount_docs(app: FastAPI) -> None:
    """Swagger UI from the files of the `swagger-ui-bundle` package: no CDN, no inline script."""
    try:
        from swagger_ui_bundle import swagger_ui_path
    except ImportError:  # the description stays at /openapi.json
        swagger_ui_path = None
    if swagger_ui_path is not None:
        app.mount("/docs-assets", StaticFiles(directory=swagger_ui_path), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    def docs() -> HTMLResponse:
        return HTMLResponse((HERE / "templates" / "docs.html").read_text())


def _handle_errors(app: FastAPI) -> None:
    def is_api(request: Request) -> bool:
        """Programs' paths: their errors are JSON (the page's are pages)."""
        return request.url.path.startswith("/v1/") or request.url.path == "/metrics"

    @app.exception_handler(AgentsError)
    async def agents_error(request: Request, exc: AgentsError) -> Response:
        if is_api(request):
            return api.error_response(exc)
        return page.problem_page(request, exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        problems = "; ".join(_problem(e) for e in exc.errors())
        return api.error_response(InvalidInput(problems[:2000] or "invalid request"))

    @app.exception_handler(HTTPException)
    async def refused(request: Request, exc: HTTPException) -> Response:
        """What the framework refuses itself: a body it cannot parse, an unknown route, a method
        the route does not take."""
        code = _HTTP_CODES.get(exc.status_code, "invalid_input" if exc.status_code < 500 else "internal_error")
        body = {"error": {"code": code, "message": str(exc.detail)}}
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        message = "an unexpected error; the server's log has the details"
        return JSONResponse({"error": {"code": "internal_error", "message": message}}, status_code=500)


def _problem(error: Any) -> str:
    """One of FastAPI's validation errors as a person reads it: where, then what."""
    if error.get("type") == "json_invalid":  # its `loc` is a character position, not a field
        why = (error.get("ctx") or {}).get("error", "")
        return f"the body is not JSON (at character {error['loc'][-1]}{': ' + why if why else ''})"
    where = ".".join(str(p) for p in error.get("loc", ()) if p != "body") or "body"
    return f"{where}: {error.get('msg', 'invalid')}"
