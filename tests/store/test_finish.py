"""Finished sessions in both stores: finish once, read back, list by time, gone on delete."""

from __future__ import annotations

import time
import uuid

import pytest

from session_server.store.base import (
    AlreadyFinished,
    Finish,
    SessionMeta,
    SessionNotFound,
    SessionStore,
)


async def created(store: SessionStore, ttl: int | None = None) -> str:
    sid = uuid.uuid4().hex
    await store.create_session(SessionMeta(sid, time.time(), ttl, metadata={"task": "t"}))
    return sid


async def test_finish_is_stored_once(store: SessionStore) -> None:
    sid = await created(store)
    assert await store.get_finish(sid) is None
    finish = Finish(finished_at=100.5, reward=0.25, metadata={"judge": "exact"})
    await store.finish_session(sid, finish)
    assert await store.get_finish(sid) == finish
    with pytest.raises(AlreadyFinished):
        await store.finish_session(sid, Finish(200.0, reward=1.0))
    assert await store.get_finish(sid) == finish


async def test_finish_of_a_missing_session(store: SessionStore) -> None:
    with pytest.raises(SessionNotFound):
        await store.finish_session("nope-" + uuid.uuid4().hex, Finish(1.0))
    with pytest.raises(SessionNotFound):
        await store.get_finish("nope-" + uuid.uuid4().hex)


async def test_list_finished_by_time_oldest_first(store: SessionStore) -> None:
    base = 1e9 + (uuid.uuid4().int % 10**6) * 100  # a time range no other test uses
    a, b, c, unfinished = [await created(store) for _ in range(4)]
    await store.finish_session(b, Finish(base + 2, reward=1.0))
    await store.finish_session(a, Finish(base + 1, reward=0.0))
    await store.finish_session(c, Finish(base + 3))
    listed = await store.list_finished(since=base, until=base + 10)
    assert [sid for sid, _, _ in listed] == [a, b, c]
    assert listed[0][1].metadata == {"task": "t"}
    assert listed[1][2].reward == 1.0
    assert [s for s, _, _ in await store.list_finished(since=base + 2, until=base + 2)] == [b]
    assert [s for s, _, _ in await store.list_finished(since=base, until=base + 10, limit=1)] == [a]
    assert unfinished not in {s for s, _, _ in await store.list_finished()}


async def test_a_deleted_session_is_no_longer_listed(store: SessionStore) -> None:
    base = 2e9 + (uuid.uuid4().int % 10**6) * 100
    sid = await created(store)
    await store.finish_session(sid, Finish(base))
    assert await store.delete_session(sid)
    assert await store.list_finished(since=base, until=base) == []
