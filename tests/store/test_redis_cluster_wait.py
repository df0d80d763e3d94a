"""`wait_replicas` on a real Redis Cluster with replicas (3 primaries + 3 replicas on
loopback): the WAIT goes to the primary of the session's slot, on the write's own
connection, so it counts that slot's replica and no other."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from session_server.store.base import StoreUnavailable
from session_server.store.redis import RedisStore
from tests.redis_topologies import cluster
from tests.store.turns import meta, turn


async def test_wait_counts_the_slot_primarys_replica(tmp_path: Path) -> None:
    with cluster(tmp_path, masters=3, replicas=1) as nodes:
        store = RedisStore(nodes.url, wait_replicas=1, wait_timeout_ms=300, retry_s=1)
        try:
            await store.create_session(meta("s"))
            stored = turn(None)
            assert await store.append_turns("s", [stored], [["k1"]]) == [1]
            # The write is on the slot's replica itself, not only acknowledged.
            turns_key = store.session_keys("s")[1]
            primary, replica = nodes.serving(turns_key)
            on = {port: redis.Redis(port=port) for port in (primary, replica)}
            on[replica].readonly()  # else a replica answers MOVED
            held = {port: client.hgetall(turns_key) for port, client in on.items()}
            for client in on.values():
                client.close()
            assert held[replica] == held[primary] and len(held[replica]) == 1
            [record] = await store.all_turns("s")
            assert record.completion_ids == stored.completion_ids
            # That replica gone: the other primaries' replicas do not count.
            nodes.kill(replica)
            with pytest.raises(StoreUnavailable, match="0 of 1 replicas"):
                await store.append_turns("s", [turn(1)], [["k2"]])
        finally:
            await store.close()
