"""The FastAPI application: `create_app(engine, config)`."""

from __future__ import annotations

import hmac
import logging
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

import radixlm
from radixlm.runtime.engine import Engine
from radixlm.server import control_api, dashboard, native_api, openai_api, router_api
from radixlm.server.client import EngineClient
from radixlm.server.errors import ApiError, OrjsonResponse, install_error_handlers
from radixlm.server.limits import BodyGuard
from radixlm.server.metrics import ServerMetrics
from radixlm.server.server_config import ServerConfig
from radixlm.server.serving import ClientDisconnected

logger = logging.getLogger(__name__)

# Open without a key: liveness probes and scrapers (SGLang and vLLM do the same), and the
# dashboard's page and static files (its data stream needs the key: `dashboard.is_public`).
# Exact paths: `/health_generate` runs a generation and needs the key.
PUBLIC_PATHS = frozenset({"/health", "/metrics"})


class ApiKeyMiddleware:
    """Pure ASGI (no BaseHTTPMiddleware: it would get in the way of streaming and of
    disconnect detection). Requires `Authorization: Bearer <key>` on every non-public path."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        path: str = scope.get("path", "")
        if path in PUBLIC_PATHS or dashboard.is_public(path):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        given = headers.get(b"authorization", b"")
        if not hmac.compare_digest(given, self._expected):
            err = ApiError(
                "Incorrect or missing API key: send `Authorization: Bearer <key>`",
                status_code=401,
                code="invalid_api_key",
            )
            response = OrjsonResponse(err.body(), status_code=401)
            response.headers["WWW-Authenticate"] = "Bearer"
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def create_app(engine: Engine, config: ServerConfig | None = None) -> FastAPI:
    """The HTTP server for `engine`: OpenAI-compatible and SGLang-native endpoints, metrics."""
    config = config or ServerConfig()
    app = FastAPI(
        title="radixlm",
        version=radixlm.__version__,
        default_response_class=OrjsonResponse,
    )
    metrics = ServerMetrics(engine.stats)
    app.state.client = EngineClient(engine, config, metrics)
    install_error_handlers(app)

    @app.exception_handler(ClientDisconnected)
    async def _gone(_: Request, __: Any) -> Response:
        return Response(status_code=499)

    app.include_router(openai_api.router)
    app.include_router(native_api.router)
    app.include_router(control_api.router)
    app.include_router(router_api.router)
    app.state.dashboard = dashboard.DashboardHub(
        engine, metrics, show_text=config.dashboard_show_text
    )
    app.include_router(dashboard.router)
    app.mount("/dashboard/static", dashboard.static_files(), name="dashboard-static")
    # NOTE: the last middleware added runs first: the key is checked before a body is read.
    app.add_middleware(BodyGuard, max_body_bytes=config.max_body_bytes)
    if config.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    return app
