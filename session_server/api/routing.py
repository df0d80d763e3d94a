"""The turn endpoints' request path, without per-request framework work it does not need.

FastAPI stays where it serves users: routing, the OpenAPI schema (the routes are declared as
usual) and validation errors in each API's shape (`RequestValidationError`, as FastAPI
raises it). What a `LeanRoute` skips per request is the generic machinery: dependency solving,
`json.loads` followed by a second validation pass over the Python objects, and
`jsonable_encoder` walking every element of the reply before it is serialised. Instead the
body is validated straight from its bytes by a validator built once per route (pydantic-core
parses the JSON itself), and a dict reply is serialised by orjson.

A route whose signature needs more than path parameters, one JSON body and the `Request`
falls back to FastAPI's handler. The turn requests do not even reach FastAPI: the lane in
front of it (`api/lane.py`) calls the same `LeanEndpoint`.

A body that would take more than a few ms to validate (many small objects: validation cost
follows the number of objects, not the bytes) is validated in a worker thread, and the
front-end's conversion of it runs there too (`convert`): /healthz and every other session
keep being served while it is parsed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from functools import cached_property
from typing import Any, TypeVar

import orjson
from fastapi import routing as fastapi_routing
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import TypeAdapter, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from session_server import images
from session_server.conversation import Conversation

T = TypeVar("T")

# ~1,000 JSON objects are ~1-2 ms of validation and conversion here (an 8 MiB body of tiny
# messages: ~4 s); long strings cost little per byte.
OFF_LOOP_OBJECTS = 1_024
OFF_LOOP_BYTES = 2 << 20


def off_loop_body(raw: bytes) -> bool:
    return len(raw) > OFF_LOOP_BYTES or raw.count(b"{") > OFF_LOOP_OBJECTS


async def convert(request: Request, fn: Callable[..., Conversation], *args: Any) -> Conversation:
    """`fn(*args)`, in a worker thread when the request's body was big enough to be
    validated in one (a front-end's conversion of it costs about as much again); then its
    images' pixels, decoded in a worker thread once the request is known to take them (the
    conversion read their headers and counted them)."""
    if request.scope.get("tokenkeep.off_loop"):
        conversation = await asyncio.to_thread(fn, *args)
    else:
        conversation = fn(*args)
    await images.admit(conversation.messages, request.app.state.turns.model.vision is not None)
    return conversation


def dumps(payload: Any) -> bytes:
    """JSON bytes of a reply or a stream frame, by orjson (what it does not know natively
    goes through FastAPI's encoder)."""
    return orjson.dumps(payload, default=jsonable_encoder)


class JSONBytes(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return dumps(content)


def _effective_dependant(route: APIRoute) -> Any:
    """The dependant as included into the app: FastAPI builds each inclusion's handler with
    the inclusion's context (prefix, router-level dependencies) set in a context variable."""
    context_var = getattr(fastapi_routing, "_effective_route_context_var", None)
    context = context_var.get() if context_var is not None else None
    if context is not None and getattr(context, "original_route", None) is route:
        return context.dependant
    return route.dependant


@dataclass(frozen=True)
class LeanEndpoint:
    """A route's endpoint called with its body validated from bytes: what both `LeanRoute`'s
    handler (requests routed by FastAPI) and the turn lane (`api/lane.py`) run."""

    endpoint: Callable[..., Coroutine[Any, Any, Any]]
    validator: TypeAdapter[Any]
    body_name: str
    request_name: str
    path_params: tuple[tuple[str, str], ...]
    status_code: int

    @classmethod
    def of(cls, dependant: Any, status_code: int | None) -> LeanEndpoint | None:
        """None for an endpoint that needs more than path parameters, one JSON body and the
        `Request` (FastAPI's own handler serves it)."""
        if (
            len(dependant.body_params) != 1
            or dependant.dependencies
            or dependant.query_params
            or dependant.header_params
            or dependant.cookie_params
            or not dependant.request_param_name
            or dependant.call is None
        ):
            return None
        body_field = dependant.body_params[0]
        return cls(
            endpoint=dependant.call,
            validator=TypeAdapter(body_field.field_info.annotation),
            body_name=body_field.name,
            request_name=dependant.request_param_name,
            path_params=tuple((p.name, p.alias) for p in dependant.path_params),
            status_code=status_code or 200,
        )

    async def __call__(self, request: Request) -> Any:
        raw = await request.body()
        if not raw:
            raise RequestValidationError(
                [{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}]
            )
        try:
            if off_loop_body(raw):
                request.scope["tokenkeep.off_loop"] = True
                body = await asyncio.to_thread(self.validator.validate_json, raw)
            else:
                body = self.validator.validate_json(raw)
        except ValidationError as exc:
            raise RequestValidationError(
                [{**error, "loc": ("body", *error["loc"])} for error in exc.errors()]
            ) from None
        path_params = request.path_params
        kwargs: dict[str, Any] = {name: path_params[alias] for name, alias in self.path_params}
        kwargs[self.body_name] = body
        kwargs[self.request_name] = request
        return await self.endpoint(**kwargs)


class LeanRoute(APIRoute):
    @cached_property
    def lean(self) -> LeanEndpoint | None:
        """The endpoint as declared, for the lane (which serves the route at its declared
        path: the turn routers are included without a prefix or dependencies)."""
        return LeanEndpoint.of(self.dependant, self.status_code)

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        lean = LeanEndpoint.of(_effective_dependant(self), self.status_code)
        if lean is None:
            return super().get_route_handler()

        async def handler(request: Request) -> Response:
            result = await lean(request)
            if isinstance(result, Response):
                return result
            return JSONBytes(result, status_code=lean.status_code)

        return handler
