"""The FastAPI application: wiring only (settings -> store, engine, model -> service)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request, Response

from session_server import __version__
from session_server.api import chat, completions, errors, health, messages, responses, sessions
from session_server.api.session_ids import bearer_token
from session_server.engines import EngineClient
from session_server.metrics import Metrics
from session_server.sampling import generation_defaults
from session_server.settings import Settings
from session_server.splice import ChatModel
from session_server.store import open_store
from session_server.store.base import SessionStore
from session_server.tokenizer import load_tokenizer
from session_server.turns import ServiceConfig, TurnService

log = logging.getLogger("tokenkeep.requests")
_UNAUTHENTICATED = ("/healthz", "/readyz", "/metrics")


def build_service(
    settings: Settings,
    *,
    store: SessionStore | None = None,
    engine: EngineClient | None = None,
    model: ChatModel | None = None,
    metrics: Metrics | None = None,
) -> TurnService:
    model = model or ChatModel(load_tokenizer(settings.tokenizer), settings.renderer)
    logging.getLogger("tokenkeep").info(
        "renderer: %s (stop tokens %s, end-of-turn token %s)",
        model.family,
        model.stop_token_ids,
        model.close_token_id,
    )
    context = settings.context_length or min(
        int(getattr(model.tokenizer, "model_max_length", 32768) or 32768), 1 << 20
    )
    config = ServiceConfig(
        model_name=settings.model,
        context_length=context,
        create_on_first_use=settings.create_sessions_on_first_use,
        default_ttl_seconds=settings.session_ttl_seconds,
        routed_experts=settings.routed_experts,
        sampling_overrides=settings.sampling_overrides,
        generation_defaults=generation_defaults(settings.tokenizer) if settings.tokenizer else {},
    )
    return TurnService(
        store=store or open_store(settings.redis_url),
        engine=engine
        or EngineClient(
            settings.engine_urls, model=settings.model, discover=settings.engine_discovery
        ),
        model=model,
        config=config,
        metrics=metrics or Metrics(),
    )


def create_app(settings: Settings, service: TurnService | None = None) -> FastAPI:
    service = service or build_service(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await service.engine.start()
        try:
            yield
        finally:
            await service.engine.close()
            await service.store.close()

    app = FastAPI(title="tokenkeep session server", version=__version__, lifespan=lifespan)
    app.state.turns = service
    app.state.settings = settings
    errors.install(app)
    for module in (chat, messages, responses, completions, sessions, health):
        app.include_router(module.router)

    @app.middleware("http")
    async def access_log(request: Request, call_next: Any) -> Response:
        started = time.perf_counter()
        if settings.api_key and request.url.path not in _UNAUTHENTICATED:
            presented = request.headers.get("x-api-key") or bearer_token(
                request.headers.get("authorization")
            )
            if presented != settings.api_key:
                response: Response = errors.error_response(request, 401, "missing or wrong API key")
                _log_line(request, response.status_code, started)
                return response
        response = await call_next(request)
        _log_line(request, response.status_code, started)
        api = getattr(request.state, "api", None)
        if api:
            service.metrics.requests.labels(api=api, status=str(response.status_code)).inc()
            service.metrics.request_seconds.labels(api=api).observe(time.perf_counter() - started)
        return response

    return app


def _log_line(request: Request, status: int, started: float) -> None:
    state = request.state
    log.info(
        json.dumps(
            {
                "method": request.method,
                "path": request.url.path,
                "status": status,
                "ms": round((time.perf_counter() - started) * 1000, 2),
                "session": getattr(state, "session_id", None),
                "api": getattr(state, "api", None),
                "kind": getattr(state, "turn_kind", None),
            },
            separators=(",", ":"),
        )
    )
