"""The FastAPI application: wiring only (settings -> store, engine, model -> service)."""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import FrameType

import orjson
import uvicorn
from fastapi import FastAPI
from prometheus_client import Counter, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from session_server import __version__
from session_server.admission import Admission, AdmissionMiddleware
from session_server.api import (
    chat,
    completions,
    errors,
    generate,
    health,
    messages,
    policy,
    responses,
    sessions,
    viewer,
)
from session_server.api.auth import Guard
from session_server.api.lane import LanedFastAPI
from session_server.api.limits import BodyLimit
from session_server.engine_wire import wire_for
from session_server.engines import EngineClient
from session_server.management import SessionService
from session_server.metrics import Metrics
from session_server.policy.fleet import PolicyFleet
from session_server.policy.transfer import FleetTransfer
from session_server.sampling import check_sampling, generation_defaults
from session_server.service_config import ServiceConfig
from session_server.settings import Settings
from session_server.splice import GENERIC, ChatModel
from session_server.store import open_store
from session_server.store.base import SessionStore
from session_server.tokenizer import load_tokenizer
from session_server.tokenizer_match import TokenizerProbe
from session_server.turns.service import TurnService

log = logging.getLogger("tokenkeep.requests")


def build_service(
    settings: Settings,
    *,
    store: SessionStore | None = None,
    engine: EngineClient | None = None,
    model: ChatModel | None = None,
    metrics: Metrics | None = None,
) -> TurnService:
    model = model or ChatModel(
        load_tokenizer(
            settings.tokenizer,
            settings.shared_tokens_bytes,
            revision=settings.tokenizer_revision,
        ),
        settings.renderer,
    )
    logging.getLogger("tokenkeep").info(
        "renderer: %s (stop tokens %s, end-of-turn token %s)",
        model.family,
        model.stop_token_ids,
        model.close_token_id,
    )
    context = settings.context_length or min(
        int(getattr(model.tokenizer, "model_max_length", 32768) or 32768), 1 << 20
    )
    # No token is longer than the vocabulary's longest entry, so a text with more characters
    # than this cannot fit the context, and is refused without being tokenized.
    longest_token = max((len(t) for t in model.tokenizer.get_vocab()), default=1)
    config = ServiceConfig(
        model_name=settings.model,
        context_length=context,
        max_text_chars=context * longest_token,
        create_on_first_use=settings.create_sessions_on_first_use,
        default_ttl_seconds=settings.session_ttl_seconds,
        routed_experts=settings.routed_experts,
        max_policy_lag=settings.max_policy_lag,
        # Checked as a session's overrides are: a bad one would fail every turn, not start.
        sampling_overrides=check_sampling(
            settings.sampling_overrides, prefix="sampling_overrides."
        ),
        generation_defaults=generation_defaults(settings.tokenizer) if settings.tokenizer else {},
    )
    metrics = metrics or Metrics()
    shared = getattr(model.tokenizer, "shared", None)
    if shared is not None:
        metrics.watch_shared_tokens(shared)
    metrics.generic_splice.set(1 if model.family == GENERIC else 0)
    metrics.model_path.labels(
        renderer=model.family,
        bridge="template" if model.template_bridge else "renderer",
        reason=model.path.reason,
    ).set(1)
    if model.family == GENERIC:
        logging.getLogger("tokenkeep").warning(
            "no hand-written renderer for this model: the generic end-of-turn splice is used (%s)",
            model.path.reason,
        )
    else:
        logging.getLogger("tokenkeep").info("path: %s", model.path.reason)
    return TurnService(
        store=store
        or open_store(
            settings.redis_url,
            password=settings.redis_password,
            timeout_s=settings.redis_timeout_s,
            retry_s=settings.redis_retry_s,
            wait_replicas=settings.redis_wait_replicas,
            wait_timeout_ms=settings.redis_wait_timeout_ms,
        ),
        engine=engine
        or EngineClient(
            settings.engine_urls,
            model=settings.model,
            discover=settings.engine_discovery,
            health_interval_s=settings.engine_health_interval_s,
            max_inflight_per_replica=settings.engine_max_inflight,
            wire=wire_for(settings.engine_kind, settings.model),
            engine_key=settings.engine_key,
            # No turn goes to a replica that tokenizes otherwise (tokenizer_match.py).
            tokenizer_probe=TokenizerProbe.of(model.tokenizer),
        ),
        model=model,
        config=config,
        metrics=metrics,
    )


def create_app(settings: Settings, service: TurnService | None = None) -> LanedFastAPI:
    service = service or build_service(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await service.engine.start()
        await fleet.start()
        try:
            yield
        finally:
            await transfers.close()
            await fleet.close()
            await service.engine.close()
            await service.store.close()

    app = LanedFastAPI(title="tokenkeep session server", version=__version__, lifespan=lifespan)
    app.state.turns = service
    app.state.sessions = SessionService(service)
    fleet = PolicyFleet(
        service.engine,
        service.store,
        service.metrics,
        served_model=settings.tokenizer or None,
        interval_s=settings.engine_health_interval_s,
    )
    app.state.policy = fleet
    transfers = FleetTransfer(fleet)
    app.state.transfers = transfers
    app.state.settings = settings
    admission = Admission(
        service.metrics,
        max_inflight=settings.max_inflight,
        max_queue=settings.max_queue,
        queue_timeout_s=settings.queue_timeout_s,
    )
    app.state.admission = admission
    errors.install(app)
    for module in (
        chat,
        messages,
        responses,
        completions,
        generate,
        sessions,
        policy,
        health,
        viewer,
    ):
        app.include_router(module.router)
    # Their turn routes are served by the lane (api/lane.py), in front of FastAPI's stack.
    app.lane_routers = [m.router for m in (chat, messages, responses, completions, generate)]
    # Innermost first: a request is admitted (bounded in-flight work) only after its
    # credentials are checked and its body size, and the access log (outermost) records
    # whatever the answer was, refusals included.
    app.add_middleware(AdmissionMiddleware, admission=admission)
    app.add_middleware(Guard, settings=settings, service=service)
    app.add_middleware(
        BodyLimit,
        max_bytes=settings.max_body_bytes,
        max_strings=settings.max_body_strings,
        timeout_s=settings.body_timeout_s,
    )
    app.add_middleware(AccessLog, metrics=service.metrics, admission=admission)
    return app


class AccessLog:
    """One JSON log line and the request metrics, as a pure ASGI middleware:
    `@app.middleware("http")` (Starlette's BaseHTTPMiddleware) costs a task group and a
    memory stream per request and relays every streamed frame through them."""

    def __init__(self, app: ASGIApp, *, metrics: Metrics, admission: Admission) -> None:
        self.app = app
        self.metrics = metrics
        self.admission = admission
        # (api, status) -> its counter and histogram: `labels()` costs more than counting.
        self._counted: dict[tuple[str, int], tuple[Counter, Histogram]] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # unless a response starts: an exception escaped every handler

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                if self.admission.draining:
                    # Clients must not reuse a connection this process is about to close.
                    message["headers"] = [*message.get("headers", []), (b"connection", b"close")]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            _log_line(scope, status, started)
            api = scope.get("state", {}).get("api")
            if api:
                counted = self._counted.get((api, status))
                if counted is None:
                    counted = self._counted[api, status] = (
                        self.metrics.requests.labels(api=api, status=str(status)),
                        self.metrics.request_seconds.labels(api=api),
                    )
                counted[0].inc()
                counted[1].observe(time.perf_counter() - started)


def _log_line(scope: Scope, status: int, started: float) -> None:
    if not log.isEnabledFor(logging.INFO):
        return
    state = scope.get("state", {})
    log.info(
        orjson.dumps(
            {
                "method": scope["method"],
                "path": scope["path"],
                "status": status,
                "ms": round((time.perf_counter() - started) * 1000, 2),
                "session": state.get("session_id"),
                "api": state.get("api"),
                "kind": state.get("turn_kind"),
            }
            | ({"error": state["error"]} if status >= 400 and "error" in state else {})
        ).decode()
    )


class GracefulServer(uvicorn.Server):
    """uvicorn, with a drain before its shutdown. The first SIGTERM (or SIGINT) makes
    readiness fail and new generation requests answer 503 (`Retry-After`, connection closed)
    while the requests already admitted, streams included, finish; when none is left, or
    after `grace_s`, uvicorn's own shutdown runs. A second signal exits at once."""

    def __init__(self, config: uvicorn.Config, admission: Admission, grace_s: float) -> None:
        super().__init__(config)
        self._admission = admission
        self._grace_s = grace_s
        self._drain_deadline: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_deadline is not None:
            super().handle_exit(sig, frame)
            return
        self._drain_deadline = time.monotonic() + self._grace_s
        self._admission.draining = True
        log.warning(
            orjson.dumps(
                {
                    "event": "draining",
                    "signal": signal.Signals(sig).name,
                    "inflight": self._admission.inflight,
                    "queued": self._admission.waiting,
                    "grace_s": self._grace_s,
                }
            ).decode()
        )

    async def on_tick(self, counter: int) -> bool:
        if self._drain_deadline is not None and not self.should_exit:
            left = self._admission.inflight + self._admission.waiting
            if left == 0 or time.monotonic() >= self._drain_deadline:
                log.warning(orjson.dumps({"event": "drained", "cut": left}).decode())
                self.should_exit = True
        return await super().on_tick(counter)
