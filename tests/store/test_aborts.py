"""Recorded aborts in every store (memory, Redis, Redis Cluster): what a server generating
reads back to cut the generations an abort through another server reached."""

from __future__ import annotations

import time

from session_server.store.base import ABORTS_KEPT_S, SessionStore


async def test_aborts_are_read_back_from_a_time_on(store: SessionStore) -> None:
    now = time.time()
    assert await store.aborts_since(now - 60) == {}
    await store.record_abort("a", now - 10)
    await store.record_abort("b", now)
    assert await store.aborts_since(now - 60) == {"a": now - 10, "b": now}
    assert await store.aborts_since(now - 5) == {"b": now}
    # A session aborted again keeps its latest abort; an earlier time never replaces it.
    await store.record_abort("a", now + 1)
    await store.record_abort("a", now - 30)
    assert await store.aborts_since(now - 5) == {"a": now + 1, "b": now}


async def test_old_aborts_are_dropped(store: SessionStore) -> None:
    now = time.time()
    await store.record_abort("old", now - ABORTS_KEPT_S - 60)
    await store.record_abort("new", now)
    assert await store.aborts_since(0) == {"new": now}
