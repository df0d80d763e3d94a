"""Session storage: the interface (base), an embedded store and a Redis store."""

from __future__ import annotations

from session_server.store.base import SessionStore
from session_server.store.memory import MemoryStore
from session_server.store.redis import RedisStore


def open_store(redis_url: str | None) -> SessionStore:
    """Redis when a URL is given (replicas share sessions), else the embedded store."""
    return RedisStore(redis_url) if redis_url else MemoryStore()
