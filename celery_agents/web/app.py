"""The FastAPI application of `agents serve`: the `/v1` API, the page, `/metrics`, `/docs`, behind
the `Guard` (auth, same-site, body bounds, security headers). It holds no state of its own (one
`Client` on Redis), so any number of `serve` processes answer alike."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles

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


def create_app(settings: Settings | None = None, client: Client | None = None) -> Any:
    """The ASGI application (the FastAPI app wrapped in the `Guard`)."""
    settings = settings or Settings.from_env()
    client = client or Client(settings)
    client.store  # noqa: B018 — made now, not raced for by the first requests' threads
    if not client.inline:
        client.dispatcher  # noqa: B018

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
    app.state.metrics = registry_for(client.store)
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
    return Guard(app, app.state.credentials, max_body, app.state.throttle)


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
        return request.url.path.startswith("/v1/")

    @app.exception_handler(AgentsError)
    async def agents_error(request: Request, exc: AgentsError) -> Response:
        if is_api(request):
            return api.error_response(exc)
        return page.problem_page(request, exc)

    @app.exception_handler(redis.RedisError)
    async def redis_error(request: Request, exc: redis.RedisError) -> Response:
        return api.redis_error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg', 'invalid')}"
            for e in exc.errors()
        )
        return api.error_response(InvalidInput(problems[:2000] or "invalid request"))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        message = "an unexpected error; the server's log has the details"
        return JSONResponse({"error": {"code": "internal_error", "message": message}}, status_code=500)
