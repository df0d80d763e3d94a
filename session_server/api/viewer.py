"""The rollout viewer: static pages shipped in the package, and the JSON they read.

The pages (`session_server/ui/`) are plain HTML, CSS and JavaScript: no CDN, no build step,
nothing fetched from outside, so the viewer works air-gapped from the installed wheel. Every
text they show (token pieces, metadata, reasons) is untrusted and inserted as text, never as
markup; the Content-Security-Policy below forbids inline scripts as a second line of defence.
"""

from __future__ import annotations

from importlib.resources import files
from typing import Any, Literal

from fastapi import APIRouter, Request, Response
from fastapi.responses import RedirectResponse

from session_server.api import session_service
from session_server.api.errors import APIError
from session_server.api.session_ids import check_session_id

router = APIRouter()

_STATIC = {
    "viewer.js": "text/javascript; charset=utf-8",
    "viewer.css": "text/css; charset=utf-8",
}
_SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "object-src 'none'; base-uri 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def _ui_file(name: str) -> bytes:
    return files("session_server.ui").joinpath(name).read_bytes()


def _page() -> Response:
    return Response(
        _ui_file("index.html"), media_type="text/html; charset=utf-8", headers=_SECURITY_HEADERS
    )


@router.get("/ui", include_in_schema=False)
async def ui_root() -> RedirectResponse:
    return RedirectResponse("/ui/", status_code=307)


@router.get("/ui/", include_in_schema=False)
async def ui_sessions() -> Response:
    return _page()


@router.get("/ui/sessions/{session_id}", include_in_schema=False)
async def ui_session(session_id: str) -> Response:
    check_session_id(session_id)
    return _page()


@router.get("/ui/static/{name}", include_in_schema=False)
async def ui_static(name: str) -> Response:
    if name not in _STATIC:
        raise APIError(404, f"no such file: {name!r}")
    return Response(_ui_file(name), media_type=_STATIC[name], headers=_SECURITY_HEADERS)


@router.get("/ui/api/sessions")
async def list_sessions(
    request: Request,
    offset: int = 0,
    limit: int = 50,
    q: str | None = None,
    metadata: str | None = None,
    state: Literal["running", "finished"] | None = None,
) -> dict[str, Any]:
    """A page of sessions, newest first; `metadata` is a selector (`key=value,...`) with the
    export's semantics."""
    return await session_service(request).page(
        offset=offset, limit=limit, q=q, metadata=metadata, state=state
    )


@router.get("/ui/api/sessions/{session_id}")
async def session_view(session_id: str, request: Request) -> dict[str, Any]:
    """What the session page draws (`SessionService.view`)."""
    return await session_service(request).view(check_session_id(session_id))
