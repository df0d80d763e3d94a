"""The store fixture: every test in this package runs against both stores."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator

import pytest

from session_server.store.base import SessionStore
from session_server.store.memory import MemoryStore
from session_server.store.redis import RedisStore
from tests.redis_topologies import redis_cluster


@pytest.fixture(scope="session")
def redis_cluster_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real 3-master Redis Cluster for the run (every session is one slot, so every
    script runs on one node)."""
    with redis_cluster(tmp_path_factory.mktemp("cluster")) as url:
        yield url


@pytest.fixture(params=["memory", "redis", "cluster"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[SessionStore]:
    if request.param == "memory":
        impl: SessionStore = MemoryStore()
    else:
        fixture = "redis_server" if request.param == "redis" else "redis_cluster_url"
        url = request.getfixturevalue(fixture)
        impl = RedisStore(url, key_prefix=f"t{uuid.uuid4().hex[:8]}")
    try:
        yield impl
    finally:
        await impl.close()
