"""The Redis store behind Sentinel: a master + 2 replicas + 3 sentinels on loopback, the
master killed (SIGKILL) while sessions append, a replica promoted, the store following it.

Replication is asynchronous: a turn acknowledged by the old master may not have reached the
replica when the master dies. `wait_replicas=1` (Redis WAIT) acknowledges a turn only once
a replica holds it; the test counts lost acknowledged turns with and without it. (With
WAIT for N replicas, fewer than N live replicas refuse every turn: hence 2 replicas here, so
that the promoted master still has one.)"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from session_server.store.base import SessionNotFound, StoreUnavailable
from session_server.store.redis import RedisStore
from tests.redis_topologies import SentinelSet
from tests.store.turns import meta, turn

SESSIONS, TURNS = 20, 10


async def _load(
    store: RedisStore, sentinels: SentinelSet
) -> tuple[list[tuple[str, int]], int, int]:
    """Chains of TURNS turns in SESSIONS sessions, the master killed after the first
    turns; (acknowledged (session, turn id), turns refused with StoreUnavailable, sessions
    whose acknowledged creation did not survive the failover)."""
    acked: list[tuple[str, int]] = []
    refused = vanished = 0

    async def session(n: int) -> None:
        nonlocal refused, vanished
        sid = f"s{n}"
        await store.create_session(meta(sid))
        parent = None
        for i in range(TURNS):
            try:
                (parent,) = await store.append_turns(sid, [turn(parent)], [[f"k{i}"]])
            except StoreUnavailable:
                refused += 1
                continue
            except SessionNotFound:
                vanished += 1
                return
            acked.append((sid, parent))
            await asyncio.sleep(0.05)

    async def kill() -> None:
        await asyncio.sleep(0.2)
        await asyncio.to_thread(sentinels.kill_master)

    await asyncio.gather(kill(), *(session(n) for n in range(SESSIONS)))
    return acked, refused, vanished


@pytest.mark.parametrize("wait_replicas", [0, 1])
async def test_master_killed_under_load(tmp_path: Path, wait_replicas: int) -> None:
    sentinels = SentinelSet(tmp_path, replicas=2)
    store = RedisStore(sentinels.url, retry_s=30, wait_replicas=wait_replicas)
    try:
        started = time.monotonic()
        acked, refused, vanished = await _load(store, sentinels)
        assert sentinels.promoted()
        held: dict[str, set[int]] = {}
        for sid, _ in acked:
            try:
                held[sid] = {r.turn_id for r in await store.all_turns(sid)}
            except SessionNotFound:  # the creation itself was lost
                held[sid] = set()
        lost = sum(turn_id not in held[sid] for sid, turn_id in acked)
        print(
            f"\nsentinel failover, wait_replicas={wait_replicas}: {len(acked)} turns acked, "
            f"{refused} refused (503), {lost} acked turns lost, {vanished} sessions lost, "
            f"{time.monotonic() - started:.1f} s"
        )
        assert refused == 0  # the store rode through the failover within retry_s
        if wait_replicas:
            assert lost == vanished == 0
    finally:
        await store.close()
        sentinels.stop()
