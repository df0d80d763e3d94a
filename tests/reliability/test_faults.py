"""One fault per test, under load, against real processes on loopback (see harness.py).

Each test asserts what issue 10 asks: 0 lost acknowledged turns, 0 corrupted sessions, no
connection dropped by a process that stays up, and no error status but the documented
transient 503/429 (with Retry-After), then writes its figures to bench/results/reliability.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.reliability.harness import Engine, Redis, Server, Tally, check_store, drive, record

pytestmark = pytest.mark.reliability

SESSIONS, TURNS = 40, 4


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[Redis]:
    server = Redis(tmp_path)
    yield server
    server.stop()


@contextlib.contextmanager
def _running(*processes: Engine | Server) -> Iterator[None]:
    """Wait for processes started side by side; stop them all afterwards."""
    try:
        for process in processes:
            process.ready()
        yield
    finally:
        for process in processes:
            process.stop()


def _assert_clean(tally: Tally, lost: int, corrupted: int, *, alive: list[str]) -> None:
    assert lost == 0
    assert corrupted == 0
    assert tally.unfinished == 0
    assert tally.undocumented() == {}
    assert not {url: n for url, n in tally.dropped.items() if url in alive}


async def _after(delay_s: float, action: object) -> None:
    await asyncio.sleep(delay_s)
    await asyncio.to_thread(action)  # type: ignore[arg-type]


async def test_redis_killed_and_restarted(tmp_path: Path, redis: Redis) -> None:
    engine = Engine()
    server = Server(tmp_path, redis.url, [engine.url])
    with _running(engine, server):
        readiness: list[int] = []

        def outage() -> None:
            redis.kill()
            time.sleep(0.5)
            readiness.append(httpx.get(server.url + "/readyz", timeout=5).status_code)
            time.sleep(1.0)
            redis.restart()

        load = drive([server.url], sessions=SESSIONS, turns=TURNS, prefix="redis")
        tally, _ = await asyncio.gather(load, _after(0.8, outage))
        lost, corrupted = await check_store(redis.url, tally)
        record("Redis kill -9, restart 1.5 s later", tally, lost, corrupted)
        _assert_clean(tally, lost, corrupted, alive=[server.url])
        assert readiness == [503]
        assert httpx.get(server.url + "/readyz").status_code == 200
        log = server.log()
        assert "Traceback" not in log
        assert '"event": "store_unavailable"' in log and '"event": "store_available"' in log
