"""Fixtures shared by every test package."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.redis_server import start_redis_server, stop_redis_server


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a real redis-server started once for the test run. Tests share it: give each
    test its own key prefix or session ids instead of flushing."""
    proc, url = start_redis_server(tmp_path_factory.mktemp("redis"))
    try:
        yield url
    finally:
        stop_redis_server(proc)
