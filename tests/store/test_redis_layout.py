"""What the Redis store leaves in Redis: its keys, their TTLs, and surviving a script flush."""

from __future__ import annotations

import re
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from session_server.store import open_store
from session_server.store.memory import MemoryStore
from session_server.store.redis import RedisStore
from tests.store.turns import meta, turn


@pytest.fixture
async def prefix() -> str:
    return f"t{uuid.uuid4().hex[:8]}"


@pytest.fixture
async def store(redis_server: str, prefix: str) -> AsyncIterator[RedisStore]:
    impl = RedisStore(redis_server, key_prefix=prefix)
    yield impl
    await impl.close()


@pytest.fixture
async def raw(redis_server: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_server)
    yield client
    await client.aclose()


async def test_a_session_is_four_keys_in_one_cluster_slot(
    store: RedisStore, raw: aioredis.Redis, prefix: str
) -> None:
    await store.create_session(meta("agent-7"))
    (a,) = await store.append_turns("agent-7", [turn(None)], [["k"]])
    await store.append_turns("agent-7", [turn(a)], [["k2"]])
    keys = sorted(k.decode() for k in await raw.keys(f"{prefix}:*"))
    assert keys == sorted(store.session_keys("agent-7"))
    # Redis Cluster hashes only what is inside the first {...}: the session id.
    assert {re.search(r"\{(.*?)\}", key).group(1) for key in keys} == {"agent-7"}  # type: ignore[union-attr]

    assert await store.delete_session("agent-7")
    assert await raw.keys(f"{prefix}:*") == []


async def test_every_key_gets_the_session_ttl(store: RedisStore, raw: aioredis.Redis) -> None:
    await store.create_session(meta("s", ttl_seconds=300))
    await store.append_turns("s", [turn(None)], [["k"]])
    ttls = [await raw.pttl(key) for key in store.session_keys("s")]
    assert all(299_000 < ttl <= 300_000 for ttl in ttls), ttls

    await store.create_session(meta("forever"))
    await store.append_turns("forever", [turn(None)], [["k"]])
    assert [await raw.pttl(key) for key in store.session_keys("forever")] == [-1, -1, -1, -1]


async def test_scripts_reload_after_a_script_flush(store: RedisStore, raw: aioredis.Redis) -> None:
    await store.create_session(meta("s"))
    (a,) = await store.append_turns("s", [turn(None)], [["k"]])
    await raw.script_flush()
    (b,) = await store.append_turns("s", [turn(a)], [["k2"]])
    await raw.script_flush()
    found = await store.lookup("s", ["k", "k2"], None)
    assert [r.turn_id for r in found.parent_path] == [a, b]


async def test_ping_reports_an_unreachable_server() -> None:
    unreachable = RedisStore("redis://127.0.0.1:1/0")
    assert await unreachable.ping() is False
    await unreachable.close()


async def test_open_store_picks_the_backend(redis_server: str) -> None:
    assert isinstance(open_store(None), MemoryStore)
    store = open_store(redis_server)
    assert isinstance(store, RedisStore)
    assert await store.ping()
    await store.close()


async def test_an_append_sent_again_after_a_lost_reply_is_stored_once(
    store: RedisStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store retries an append whose reply it lost (Redis died after running it): the
    append's token makes the second run answer with the turns the first one stored."""
    await store.create_session(meta("s"))
    monkeypatch.setattr("session_server.store.redis.secrets.token_hex", lambda _n: "ab" * 8)
    first = await store.append_turns("s", [turn(None), turn(None)], [["k1"], ["k2"]])
    again = await store.append_turns("s", [turn(None), turn(None)], [["k1"], ["k2"]])
    assert again == first == [1, 2]
    assert (await store.counters("s")).turns == 2
    monkeypatch.undo()
    (third,) = await store.append_turns("s", [turn(None)], [["k3"]])
    assert third == 3
