"""Finished rollouts: which sessions a batch export takes, and its rows.

A batch is either named (`session_ids`: each must exist and be finished) or selected (every
finished session whose metadata matches a selector and whose finish time is in a range).
Everything is checked before the first row is produced, so an export that cannot be whole
fails before it starts.

Groups (the G rollouts of one prompt, tagged `group` with a `group_size` at creation) are
exported whole: a group leaves only once `group_size` of its sessions are finished. A
complete group with a failed member (finish status other than `ok`) is held back
(`failed_members="hold"`: nothing exported, nothing lost; export it later with "drop") or
exported without that member (`"drop"`). Finding a group's members is a pass over the live
sessions (no index is written per session), like the viewer's listing.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any, Literal

from session_server import export
from session_server.store.base import Finish, SessionMeta, SessionNotFound, SessionStore

Selected = tuple[str, SessionMeta, Finish]
FailedMembers = Literal["hold", "drop"]


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


@dataclass(slots=True)
class Group:
    """One group's members as they stand: finished ones with their finish, running ones
    with None."""

    group_id: str
    size: int
    members: list[tuple[SessionMeta, Finish | None]]

    @property
    def finished(self) -> list[Selected]:
        return [(m.session_id, m, f) for m, f in self.members if f is not None]

    @property
    def complete(self) -> bool:
        return len(self.finished) >= self.size

    @property
    def failed(self) -> list[str]:
        return [sid for sid, _, finish in self.finished if finish.status != "ok"]

    def state(self) -> dict[str, Any]:
        statuses: dict[str, int] = {}
        for _, _, finish in self.finished:
            statuses[finish.status] = statuses.get(finish.status, 0) + 1
        finished = len(self.finished)
        return {
            "group": self.group_id,
            "size": self.size,
            "sessions": len(self.members),
            "finished": finished,
            "running": len(self.members) - finished,
            "complete": self.complete,
            "statuses": statuses,
            "failed": self.failed,
        }


async def groups(store: SessionStore, wanted: Iterable[str] | None = None) -> dict[str, Group]:
    """The groups named in `wanted` (every group when None) from one pass over the live
    sessions; members ordered by creation."""
    names = None if wanted is None else set(wanted)
    found: dict[str, Group] = {}
    for meta, _counters in await store.list_sessions():
        if meta.group is None or (names is not None and meta.group not in names):
            continue
        try:
            finish = await store.get_finish(meta.session_id)
        except SessionNotFound:
            continue  # deleted or expired since the pass began
        group = found.setdefault(meta.group, Group(meta.group, meta.group_size or 1, []))
        group.members.append((meta, finish))
    for group in found.values():
        group.members.sort(key=lambda member: (member[0].created_at, member[0].session_id))
    return found


async def whole_groups(
    store: SessionStore,
    selected: list[Selected],
    *,
    failed_members: FailedMembers,
    strict: bool,
) -> list[Selected]:
    """Replace the grouped sessions of `selected` by their complete groups (every finished
    member, whether or not the selection reached it). A group still running is held back,
    or, when `strict` (the sessions were named), refused with 409; so is a held group
    (a failed member under "hold"). Ungrouped sessions pass
    as they are."""
    names = {meta.group for _, meta, _ in selected if meta.group is not None}
    if not names:
        return selected
    found = await groups(store, names)
    out: list[Selected] = []
    emitted: set[str] = set()
    for session_id, meta, finish in selected:
        if meta.group is None:
            out.append((session_id, meta, finish))
            continue
        if meta.group in emitted:
            continue
        emitted.add(meta.group)
        group = found.get(meta.group)
        if group is None or not group.complete:
            if strict:
                done = len(group.finished) if group else 0
                raise BatchError(
                    409,
                    f"group {meta.group!r} is still running ({done} of "
                    f"{meta.group_size} sessions finished)",
                    "group",
                )
            continue
        if group.failed and failed_members == "hold":
            if strict:
                raise BatchError(
                    409,
                    f"group {meta.group!r} has failed sessions ({', '.join(group.failed)}); "
                    'it is held: export it with "failed_members": "drop" to leave them out',
                    "failed_members",
                )
            continue
        out.extend(item for item in group.finished if item[2].status == "ok")
    return out


def with_status(selected: list[Selected], statuses: list[str] | None) -> list[Selected]:
    """Only the sessions finished with one of `statuses` (all when None)."""
    if statuses is None:
        return selected
    return [item for item in selected if item[2].status in statuses]
