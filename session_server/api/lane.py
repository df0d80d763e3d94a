"""The turn requests' lane: served in front of FastAPI, through our own checks only.

A turn request routed by FastAPI passes ~15 generic ASGI layers (Starlette's error and
exception middlewares, FastAPI's telemetry, exit stacks and body limit, the router matching
route after route, `request_response`, a `Response` object), most with their own `send`
wrapper: ~130 Python calls per turn. The lane recognises the turn routes (every `LeanRoute`
whose endpoint is lean: the POSTs of the session APIs) by method and path with one
precompiled match, runs the app's own middlewares (access log, body limit, credentials,
admission: the same classes, composed around the lane's endpoint; inlining them would save
~3 us more and keep their order in two places) and calls the endpoint as `LeanRoute`'s
handler does, replying with the bytes directly.

What users see does not change: the routes stay declared in FastAPI (OpenAPI schema,
everything else routed by it); an exception the endpoint raises is answered by the app's
own exception handlers, looked up as Starlette does (status handlers for an
`HTTPException`, then the exception class's MRO); any other exception gets Starlette's 500
(`ServerErrorMiddleware`, the app's 500 handler if it has one) and is re-raised to the server,
which logs it. With FastAPI's native OpenTelemetry configured (before the first request, as
`opentelemetry-instrument` does), every request takes FastAPI's path.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

from fastapi import FastAPI
from fastapi.routing import APIRouter
from starlette._utils import get_route_path, is_async_callable
from starlette.concurrency import run_in_threadpool
from starlette.convertors import Convertor
from starlette.exceptions import HTTPException
from starlette.middleware.errors import ServerErrorMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from session_server.api.routing import LeanEndpoint, LeanRoute, dumps

_JSON = (b"content-type", b"application/json")
Handler = Callable[[Request, Exception], Awaitable[Response | None]]


class Lane:
    def __init__(self, app: FastAPI, routes: Iterable[LeanRoute]) -> None:
        self.app = app
        self._static: dict[str, LeanRoute] = {}
        # group name -> the route, and (group, parameter, convertor) of each path parameter
        self._routes: dict[str, tuple[LeanRoute, list[tuple[str, str, Convertor[Any]]]]] = {}
        alternatives: list[str] = []
        for route in routes:
            if route.lean is None or route.methods != {"POST"}:
                continue
            if not route.param_convertors:
                self._static[route.path] = route
                continue
            # One pattern for all: each route's own, its groups renamed apart; `lastgroup`
            # names the route that matched (its outermost group closes last).
            name = f"r{len(self._routes)}"
            params = [(f"{name}_{p}", p, c) for p, c in route.param_convertors.items()]
            self._routes[name] = route, params
            body = route.path_regex.pattern.removeprefix("^").removesuffix("$")
            body = re.sub(r"\(\?P<(\w+)>", rf"(?P<{name}_\1>", body)
            alternatives.append(f"(?P<{name}>{body})")
        self._pattern = re.compile(f"^(?:{'|'.join(alternatives)})$") if alternatives else None

        error_handler = None
        handlers: dict[Any, Any] = {}
        status_handlers: dict[int, Any] = {}
        for key, handler in app.exception_handlers.items():
            if key in (500, Exception):
                error_handler = handler  # Starlette's ServerErrorMiddleware answers with it
            elif isinstance(key, int):
                status_handlers[key] = handler
            else:
                handlers[key] = handler
        # Where Starlette's ExceptionMiddleware puts them for the code below it.
        self._scope_handlers = (handlers, status_handlers)
        self._handlers = {key: _awaitable(h) for key, h in handlers.items()}
        self._status_handlers = {key: _awaitable(h) for key, h in status_handlers.items()}
        inner: ASGIApp = self._endpoint
        for cls, args, kwargs in reversed(app.user_middleware):
            inner = cls(inner, *args, **kwargs)
        self._stack = ServerErrorMiddleware(inner, handler=error_handler, debug=app.debug)

    def match(self, scope: Scope) -> tuple[LeanRoute, dict[str, Any]] | None:
        if scope["method"] != "POST":
            return None
        path = get_route_path(scope)
        route = self._static.get(path)
        if route is not None:
            return route, {}
        found = self._pattern.match(path) if self._pattern else None
        if found is None or found.lastgroup is None:
            return None
        route, params = self._routes[found.lastgroup]
        return route, {param: convertor.convert(found[group]) for group, param, convertor in params}

    async def __call__(
        self, scope: Scope, receive: Receive, send: Send, route: LeanRoute, params: dict[str, Any]
    ) -> None:
        # What Starlette's app, exception middleware and router put in the scope.
        scope["app"] = self.app
        scope["router"] = self.app.router
        scope["starlette.exception_handlers"] = self._scope_handlers
        scope["route"] = route
        scope["endpoint"] = route.endpoint
        scope["path_params"] = params
        await self._stack(scope, receive, send)

    async def _endpoint(self, scope: Scope, receive: Receive, send: Send) -> None:
        lean: LeanEndpoint = scope["route"].lean
        request = Request(scope, receive, send)
        started = False

        async def sender(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            result = await lean(request)
            if isinstance(result, Response):  # a stream
                await result(scope, receive, sender)
                return
            body = dumps(result)
        except Exception as exc:
            handler = self._handler(exc)
            if handler is None:
                raise
            if started:
                raise RuntimeError(
                    "Caught handled exception, but response already started."
                ) from exc
            response = await handler(request, exc)
            if response is not None:
                await response(scope, receive, send)
            exc.__traceback__ = None  # as Starlette: a reused exception must not keep frames
            return
        headers = [(b"content-length", str(len(body)).encode()), _JSON]
        await send({"type": "http.response.start", "status": lean.status_code, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    def _handler(self, exc: Exception) -> Handler | None:
        if isinstance(exc, HTTPException):
            handler = self._status_handlers.get(exc.status_code)
            if handler is not None:
                return handler
        for cls in type(exc).__mro__:
            if cls in self._handlers:
                return self._handlers[cls]
        return None


def _awaitable(handler: Any) -> Handler:
    """A handler as Starlette calls it: a plain function runs in the thread pool."""
    if is_async_callable(handler):
        return handler

    async def in_thread(request: Request, exc: Exception) -> Response | None:
        return await run_in_threadpool(handler, request, exc)

    return in_thread


class LanedFastAPI(FastAPI):
    """FastAPI, with the lean routes of `lane_routers` served by a `Lane` in front of it."""

    lane_routers: Sequence[APIRouter] = ()
    _lane: Lane | None = None

    def lane(self) -> Lane:
        """Built at the first request, as Starlette builds its middleware stack: routes,
        middlewares and exception handlers are all in place by then. FastAPI asks whether
        its native OpenTelemetry is on at every request (~5 us); the lane asks once: when it
        is, the lane takes no route and every request keeps FastAPI's spans."""
        if self._lane is None:
            telemetry = getattr(self, "_native_telemetry", None)
            routes: list[LeanRoute] = []
            if telemetry is None or not telemetry.enabled():
                for router in self.lane_routers:
                    # FastAPI's own body limit (`max_body_size`), where one is set, is
                    # FastAPI's to enforce.
                    routes += (
                        route
                        for route in router.routes
                        if isinstance(route, LeanRoute) and _no_limit(self, router, route)
                    )
            self._lane = Lane(self, routes)
        return self._lane

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            if self.root_path:
                scope["root_path"] = self.root_path
            lane = self._lane or self.lane()
            served = lane.match(scope)
            if served is not None:
                await lane(scope, receive, send, *served)
                return
        await super().__call__(scope, receive, send)


def _no_limit(*levels: Any) -> bool:
    return all(getattr(level, "max_body_size", None) is None for level in levels)
