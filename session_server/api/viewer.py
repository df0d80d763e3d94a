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

from session_server import export
from session_server.api import turn_service
from session_server.api.errors import APIError
from session_server.api.session_ids import check_session_id
from session_server.images import thumbnail_data_url

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
MAX_PAGE = 500


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


def _metadata_filter(expression: str | None) -> dict[str, str]:
    """`key=value,key=value` -> a dict; every pair must match a session's metadata."""
    if not expression:
        return {}
    pairs: dict[str, str] = {}
    for part in expression.split(","):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise APIError(400, f"metadata filter {part!r}: expected key=value", param="metadata")
        pairs[key.strip()] = value.strip()
    return pairs


@router.get("/ui/api/sessions")
async def list_sessions(
    request: Request,
    offset: int = 0,
    limit: int = 50,
    q: str | None = None,
    metadata: str | None = None,
    state: Literal["running", "finished"] | None = None,
) -> dict[str, Any]:
    """A page of sessions, newest first: counters from the store, no turn records read."""
    if offset < 0 or not 1 <= limit <= MAX_PAGE:
        raise APIError(400, f"offset >= 0 and 1 <= limit <= {MAX_PAGE}", param="limit")
    wanted = _metadata_filter(metadata)
    store = turn_service(request).store
    rows = await store.list_sessions()
    finishes = {sid: finish for sid, _meta, finish in await store.list_finished(limit=len(rows))}
    matching = [
        (meta, counters)
        for meta, counters in rows
        if (not q or q in meta.session_id)
        and all(str(meta.metadata.get(k)) == v for k, v in wanted.items())
        and (state is None or (meta.session_id in finishes) == (state == "finished"))
    ]
    matching.sort(key=lambda row: (-row[0].created_at, row[0].session_id))
    page = matching[offset : offset + limit]
    return {
        "total": len(matching),
        "offset": offset,
        "limit": limit,
        "sessions": [
            {
                "id": meta.session_id,
                "created_at": meta.created_at,
                "metadata": meta.metadata,
                "turns": counters.turns,
                "segments": counters.segments,
                "breaks": counters.breaks,
                "tokens": counters.tokens,
                "state": "finished" if meta.session_id in finishes else "running",
                "reward": finish.reward if (finish := finishes.get(meta.session_id)) else None,
            }
            for meta, counters in page
        ],
    }


async def _thumbnail(
    store: Any, session_id: str, image: dict[str, Any], done: dict[str, str | None]
) -> str | None:
    sha256 = image["sha256"]
    if sha256 not in done:
        data = await store.get_image(session_id, sha256)
        done[sha256] = None if data is None else thumbnail_data_url(data)
    return done[sha256]


@router.get("/ui/api/sessions/{session_id}")
async def session_view(session_id: str, request: Request) -> dict[str, Any]:
    """What the session page draws: the summary, the whole turn tree, and every branch's
    segments with each token's decoded piece and whether it is a special token."""
    check_session_id(session_id)
    service = turn_service(request)
    meta = await service.store.get_session(session_id)
    if meta is None:
        raise APIError(404, f"session {session_id!r} not found", param="session_id")
    turns = await service.store.all_turns(session_id)
    data = export.trajectory(session_id, turns)
    tokenizer = service.model.tokenizer
    special = tokenizer.special_token_ids
    thumbnails: dict[str, str | None] = {}
    for branch in data["branches"]:
        for segment in branch["segments"]:
            ids = segment["token_ids"]
            segment["pieces"] = tokenizer.pieces(ids)
            segment["special"] = [1 if t in special else 0 for t in ids]
            # Each image's placeholder run is drawn as one block with a small thumbnail.
            segment["images"] = [
                {
                    **image,
                    "thumbnail": await _thumbnail(service.store, session_id, image, thumbnails),
                }
                for turn in segment["turns"]
                for image in turn.get("images", [])
            ]
    finish = await service.store.get_finish(session_id)
    return {
        "id": session_id,
        "created_at": meta.created_at,
        "metadata": meta.metadata,
        "model": service.config.model_name,
        "state": "finished" if finish else "running",
        "reward": finish.reward if finish else None,
        **export.summary(session_id, turns),
        "turn_tree": [
            {
                "turn_id": t.turn_id,
                "parent_id": t.parent_id,
                "kind": t.kind,
                "api": t.api,
                "break_reason": t.break_reason,
                "finish_reason": t.finish_reason,
                "created_at": t.created_at,
                "completion_tokens": len(t.completion_ids),
            }
            for t in turns
        ],
        "branches": data["branches"],
    }
