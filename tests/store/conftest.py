"""The store fixture: every test in this package runs against both stores."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest

from session_server.store.base import SessionStore
from session_server.store.memory import MemoryStore
from session_server.store.redis import RedisStore


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[SessionStore]:
    if request.param == "memory":
        impl: SessionStore = MemoryStore()
    else:
        url = request.getfixturevalue("redis_server")
        impl = RedisStore(url, key_prefix=f"t{uuid.uuid4().hex[:8]}")
    try:
        yield impl
    finally:
        await impl.close()
