"""Images kept per session, once per content hash, on both stores."""

from __future__ import annotations

import uuid

import pytest

from session_server.store.base import SessionNotFound, SessionStore
from session_server.store.redis import RedisStore
from tests.store.turns import meta


async def test_images_once_per_hash_and_gone_with_the_session(store: SessionStore) -> None:
    await store.create_session(meta("s", ttl_seconds=60))
    await store.put_images("s", {"aa": b"first", "bb": b"second"})
    await store.put_images("s", {"aa": b"other bytes under a known hash are ignored"})
    assert await store.get_image("s", "aa") == b"first"
    assert await store.get_image("s", "bb") == b"second"
    assert await store.get_image("s", "cc") is None
    await store.put_images("s", {})  # a turn that adds no image (Redis: refreshes the TTL)
    assert await store.delete_session("s")
    assert await store.get_image("s", "aa") is None


async def test_images_of_a_missing_session(store: SessionStore) -> None:
    with pytest.raises(SessionNotFound):
        await store.put_images("nope", {"aa": b"x"})
    assert await store.get_image("nope", "aa") is None


async def test_redis_images_expire_with_the_session(redis_server: str) -> None:
    store = RedisStore(redis_server, key_prefix=f"t{uuid.uuid4().hex[:8]}")
    try:
        await store.create_session(meta("t", ttl_seconds=60))
        await store.put_images("t", {"aa": b"x"})
        ttl_ms = await store._redis.pttl(store._images_key("t"))
        assert 50_000 < ttl_ms <= 60_000
    finally:
        await store.close()
