"""Finished rollouts: which sessions a batch export takes, and its rows.

A batch is either named (`session_ids`: each must exist and be finished) or selected (every
finished session whose metadata matches a selector and whose finish time is in a range).
Everything is checked before the first row is produced, so an export that cannot be whole
fails before it starts.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from session_server import export
from session_server.store.base import Finish, SessionMeta, SessionNotFound, SessionStore

Selected = tuple[str, SessionMeta, Finish]


class BatchError(ValueError):
    """A batch that cannot be exported as asked; `status` is the HTTP status to answer."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def parse_selector(text: str | None) -> dict[str, str]:
    """`key=value,key2=value2` (Kubernetes label-selector style, equality only)."""
    selector: dict[str, str] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise BatchError(400, f"selector terms are key=value, got {part!r}", "selector")
        selector[key.strip()] = value.strip()
    return selector


def matches(metadata: dict[str, Any], selector: dict[str, str]) -> bool:
    """Every selector key is in the session's metadata with that value (compared as text;
    JSON true/false/null as written in JSON)."""
    for key, wanted in selector.items():
        if key not in metadata:
            return False
        value = metadata[key]
        text = value if isinstance(value, str) else _json_scalar(value)
        if text != wanted:
            return False
    return True


def _json_scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


async def select(
    store: SessionStore,
    *,
    selector: dict[str, str],
    since: float | None,
    until: float | None,
    limit: int,
) -> list[Selected]:
    """Finished sessions matching `selector` and the finish-time range, oldest first.
    The store filters by time only, so the index is read in pages until `limit` match."""
    page_size = max(limit, 256)
    found: list[Selected] = []
    seen: set[str] = set()
    after = since
    while True:
        page = await store.list_finished(since=after, until=until, limit=page_size)
        new = [item for item in page if item[0] not in seen]
        for item in new:
            seen.add(item[0])
            if matches(item[1].metadata, selector):
                found.append(item)
                if len(found) == limit:
                    return found
        if len(page) < page_size or not new:
            return found
        after = page[-1][2].finished_at


async def named(store: SessionStore, session_ids: list[str]) -> list[Selected]:
    """The named sessions; every one must exist and be finished."""
    out: list[Selected] = []
    for session_id in dict.fromkeys(session_ids):
        try:
            finish = await store.get_finish(session_id)
            meta = await store.get_session(session_id)
        except SessionNotFound:
            meta = None
        if meta is None:
            raise BatchError(404, f"session {session_id!r} not found", "session_ids")
        if finish is None:
            raise BatchError(
                409,
                f"session {session_id!r} is not finished (POST /sessions/{session_id}/finish)",
                "session_ids",
            )
        out.append((session_id, meta, finish))
    return out


async def rows(
    store: SessionStore,
    batch: list[Selected],
    staleness: export.Staleness | None,
    which: export.Branches = "all",
) -> AsyncIterator[dict[str, Any]]:
    """The export rows of each session in turn (one session's turns in memory at a time).
    Raises SessionNotFound if a session vanished after it was selected."""
    for session_id, meta, finish in batch:
        turns = await store.all_turns(session_id)
        for row in export.rows(meta, finish, turns, staleness, which):
            yield row
