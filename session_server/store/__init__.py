"""Session storage: the interface (base), an embedded store and a Redis store."""

from __future__ import annotations

from typing import Any

from session_server.store.base import SessionStore
from session_server.store.memory import MemoryStore
from session_server.store.redis import RedisStore


def open_store(redis_url: str | None, **redis_options: Any) -> SessionStore:
    """Redis when a URL is given (replicas share sessions), else the embedded store.
    `redis_options` go to RedisStore."""
    return RedisStore(redis_url, **redis_options) if redis_url else MemoryStore()
