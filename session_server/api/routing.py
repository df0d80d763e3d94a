"""The turn endpoints' request path, without per-request framework work it does not need.

FastAPI stays where it serves users: routing, the OpenAPI schema (the routes are declared as
usual) and validation errors in each API's shape (`RequestValidationError`, as FastAPI
raises it). What a `LeanRoute` skips per request is the generic machinery: dependency solving,
`json.loads` followed by a second validation pass over the Python objects, and
`jsonable_encoder` walking every element of the reply before it is serialised. Instead the
body is validated straight from its bytes by a validator built once per route (pydantic-core
parses the JSON itself), and a dict reply is serialised by orjson.

A route whose signature needs more than path parameters, one JSON body and the `Request`
falls back to FastAPI's handler.

A body that would take more than a few ms to validate (many small objects: validation cost
follows the number of objects, not the bytes) is validated in a worker thread, and the
front-end's conversion of it runs there too (`convert`): /healthz and every other session
keep being served while it is parsed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import orjson
from fastapi import routing as fastapi_routing
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import TypeAdapter, ValidationError
from starlette.requests import Request
from starlette.responses import Response

T = TypeVar("T")

# ~1,000 JSON objects are ~1-2 ms of validation and conversion here (an 8 MiB body of tiny
# messages: ~4 s); long strings cost little per byte.
OFF_LOOP_OBJECTS = 1_024
OFF_LOOP_BYTES = 2 << 20


def off_loop_body(raw: bytes) -> bool:
    return len(raw) > OFF_LOOP_BYTES or raw.count(b"{") > OFF_LOOP_OBJECTS


async def convert(request: Request, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)`, in a worker thread when the request's body was big enough to be
    validated in one (a front-end's conversion of it costs about as much again)."""
    if request.scope.get("tokenkeep.off_loop"):
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


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


class LeanRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        dependant = _effective_dependant(self)
        if (
            len(dependant.body_params) != 1
            or dependant.dependencies
            or dependant.query_params
            or dependant.header_params
            or dependant.cookie_params
            or not dependant.request_param_name
        ):
            return super().get_route_handler()
        body_field = dependant.body_params[0]
        validator = TypeAdapter(body_field.field_info.annotation)
        path_params = [(p.name, p.alias) for p in dependant.path_params]
        request_name = dependant.request_param_name
        endpoint = dependant.call
        status_code = self.status_code or 200
        assert endpoint is not None

        async def handler(request: Request) -> Response:
            raw = await request.body()
            if not raw:
                raise RequestValidationError(
                    [{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}]
                )
            try:
                if off_loop_body(raw):
                    request.scope["tokenkeep.off_loop"] = True
                    body = await asyncio.to_thread(validator.validate_json, raw)
                else:
                    body = validator.validate_json(raw)
            except ValidationError as exc:
                raise RequestValidationError(
                    [{**error, "loc": ("body", *error["loc"])} for error in exc.errors()]
                ) from None
            kwargs: dict[str, Any] = {
                name: request.path_params[alias] for name, alias in path_params
            }
            kwargs[body_field.name] = body
            kwargs[request_name] = request
            result = await endpoint(**kwargs)
            if isinstance(result, Response):
                return result
            return JSONBytes(result, status_code=status_code)

        return handler
