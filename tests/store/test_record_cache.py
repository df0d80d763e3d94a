"""lookup(known=RecordCache): records the caller holds are neither transferred nor decoded
again, and a cache never outlives the session incarnation it was filled from."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from session_server.store.base import (
    RecordCache,
    SessionNotFound,
    SessionStore,
    TurnRecord,
)
from session_server.store.redis import RedisStore
from tests.store.test_store import as_stored, chain
from tests.store.turns import meta, turn


def assert_from_cache(records: list[TurnRecord], cache: RecordCache) -> None:
    assert all(r is cache.records[r.turn_id] for r in records)


async def test_a_warm_lookup_decodes_nothing_and_returns_the_cached_objects(
    store: SessionStore, decoded_ids: list[int]
) -> None:
    await store.create_session(meta("s"))
    records = await chain(store, "s", 5)
    cache = RecordCache()

    cold = await store.lookup("s", ["r4", "r5"], "miss", known=cache)
    assert cold.parent_path == records
    assert cold.incarnation is not None and cache.incarnation == cold.incarnation
    assert cache.records == {r.turn_id: r for r in records}
    assert_from_cache(cold.parent_path, cache)
    assert sorted(decoded_ids) == [1, 2, 3, 4, 5]

    decoded_ids.clear()
    warm = await store.lookup("s", ["r4", "r5"], "miss", known=cache)
    assert decoded_ids == []
    assert warm.parent_path == records
    assert_from_cache(warm.parent_path, cache)
    assert (warm.matched_key_index, warm.turn_count, warm.incarnation) == (1, 5, cold.incarnation)


async def test_a_partial_cache_fetches_only_the_missing_records(
    store: SessionStore, decoded_ids: list[int]
) -> None:
    await store.create_session(meta("s"))
    records = await chain(store, "s", 6)
    cache = RecordCache()
    await store.lookup("s", ["r3"], None, known=cache)
    assert sorted(cache.records) == [1, 2, 3]

    decoded_ids.clear()
    found = await store.lookup("s", ["r6"], None, known=cache)
    assert sorted(decoded_ids) == [4, 5, 6]
    assert found.parent_path == records
    assert_from_cache(found.parent_path, cache)
    assert sorted(cache.records) == [1, 2, 3, 4, 5, 6]

    # Holes anywhere on the path, not only at its end.
    kept = {i: cache.records[i] for i in (2, 5)}
    cache.records = dict(kept)
    decoded_ids.clear()
    found = await store.lookup("s", ["r6"], None, known=cache)
    assert sorted(decoded_ids) == [1, 3, 4, 6]
    assert found.parent_path == records
    assert found.parent_path[1] is kept[2] and found.parent_path[4] is kept[5]


async def test_retry_paths_use_the_cache(store: SessionStore, decoded_ids: list[int]) -> None:
    await store.create_session(meta("s"))
    t1, t2, t3 = await chain(store, "s", 3)
    cache = RecordCache()
    await store.lookup("s", ["r3"], None, known=cache)

    decoded_ids.clear()
    found = await store.lookup("s", ["r1", "r2"], "i3", known=cache)
    assert decoded_ids == []
    assert found.retry_of == t3 and found.retry_of is cache.records[3]
    assert found.retry_path == [t1, t2] and found.parent_path == [t1, t2]
    assert_from_cache([*found.retry_path, *found.parent_path], cache)

    # A sibling of t3 the cache has never seen: only it is decoded.
    sibling = turn(t2.turn_id, seed=40)
    (s4,) = await store.append_turns("s", [sibling], [["r4", "i4"]])
    decoded_ids.clear()
    found = await store.lookup("s", ["r1", "r2"], "i4", known=cache)
    assert decoded_ids == [s4]
    assert found.retry_of == as_stored(sibling, s4)
    assert found.retry_of is cache.records[s4]
    assert_from_cache(found.retry_path, cache)


async def test_a_recreated_session_never_serves_the_old_incarnations_records(
    store: SessionStore,
) -> None:
    await store.create_session(meta("s"))
    await chain(store, "s", 3)
    cache = RecordCache()
    old = await store.lookup("s", ["r3"], None, known=cache)
    stale = dict(cache.records)

    await store.delete_session("s")
    await store.create_session(meta("s"))
    # Same ids and the same reply keys as before, different tokens.
    first, second = turn(None, seed=101), turn(1, seed=102)
    assert await store.append_turns("s", [first], [["r1"]]) == [1]
    assert await store.append_turns("s", [second], [["r2"]]) == [2]

    found = await store.lookup("s", ["r1", "r2"], None, known=cache)
    assert found.parent_path == [as_stored(first, 1), as_stored(second, 2)]
    assert found.incarnation is not None and found.incarnation != old.incarnation
    assert not any(r is stale[r.turn_id] for r in found.parent_path)
    assert cache.incarnation == found.incarnation
    assert cache.records == {1: as_stored(first, 1), 2: as_stored(second, 2)}


async def test_a_cache_without_an_incarnation_is_never_trusted(
    store: SessionStore, decoded_ids: list[int]
) -> None:
    await store.create_session(meta("s"))
    (t1,) = await chain(store, "s", 1)
    bogus = dataclasses.replace(t1, completion_ids=[7, 7, 7])
    cache = RecordCache(incarnation=None, records={1: bogus})

    found = await store.lookup("s", ["r1"], None, known=cache)
    assert decoded_ids == [1]
    assert found.parent_path == [t1]
    assert cache.records == {1: t1} and cache.incarnation == found.incarnation


async def test_lookup_of_a_missing_session_leaves_the_cache_alone(store: SessionStore) -> None:
    await store.create_session(meta("s"))
    await chain(store, "s", 2)
    cache = RecordCache()
    await store.lookup("s", ["r2"], None, known=cache)
    before = (cache.incarnation, cache.records, dict(cache.records))
    await store.delete_session("s")
    with pytest.raises(SessionNotFound):
        await store.lookup("s", ["r2"], None, known=cache)
    assert (cache.incarnation, cache.records, dict(cache.records)) == before


def test_a_new_incarnation_replaces_the_records_dict_instead_of_emptying_it() -> None:
    """A lookup still awaiting its reply keeps reading the dict it announced to the store."""
    t1 = dataclasses.replace(turn(None), turn_id=1)
    cache = RecordCache(incarnation="a" * 16, records={1: t1})
    announced = cache.records
    cache.learn("b" * 16, {})
    assert announced == {1: t1}
    assert cache.records == {} and cache.incarnation == "b" * 16
    t2 = dataclasses.replace(turn(1), turn_id=2)
    cache.learn("b" * 16, {2: t2})
    assert cache.records == {2: t2}


# --- Redis: what crosses the wire, other server processes, older sessions ------------------


@pytest.fixture
async def redis_pair(redis_server: str) -> AsyncIterator[tuple[RedisStore, RedisStore]]:
    """Two stores on one Redis and one key prefix: two server processes."""
    prefix = f"t{uuid.uuid4().hex[:8]}"
    first, second = (
        RedisStore(redis_server, key_prefix=prefix),
        RedisStore(redis_server, key_prefix=prefix),
    )
    yield first, second
    await first.close()
    await second.close()


async def test_a_warm_redis_lookup_transfers_no_record(
    redis_pair: tuple[RedisStore, RedisStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    store, _ = redis_pair
    await store.create_session(meta("s"))
    await chain(store, "s", 4)
    replies: list[list[Any]] = []
    script = store._lookup

    async def spy(**kwargs: Any) -> Any:
        replies.append(await script(**kwargs))
        return replies[-1]

    monkeypatch.setattr(store, "_lookup", spy)
    cache = RecordCache()
    await store.lookup("s", ["r2"], None, known=cache)
    found = await store.lookup("s", ["r4"], "i3", known=cache)
    await store.lookup("s", ["r4"], "i3", known=cache)

    cold, partial, warm = ([x for x in reply if isinstance(x, bytes)] for reply in replies)
    assert found.incarnation is not None
    incarnation = found.incarnation.encode()
    assert cold[0] == partial[0] == warm[0] == incarnation
    assert len(cold) == 1 + 2 and len(partial) == 1 + 2  # records 1-2, then 3-4
    assert warm == [incarnation]
    assert [r.turn_id for r in found.parent_path] == [1, 2, 3, 4]


async def test_a_session_recreated_by_another_process_invalidates_the_cache(
    redis_pair: tuple[RedisStore, RedisStore],
) -> None:
    mine, other = redis_pair
    await mine.create_session(meta("s"))
    await chain(mine, "s", 2)
    cache = RecordCache()
    await mine.lookup("s", ["r2"], None, known=cache)

    await other.delete_session("s")
    await other.create_session(meta("s"))
    fresh = turn(None, seed=55)
    await other.append_turns("s", [fresh], [["r1"]])

    found = await mine.lookup("s", ["r1", "r2"], None, known=cache)
    assert found.parent_path == [as_stored(fresh, 1)]
    assert cache.records == {1: as_stored(fresh, 1)}


async def test_a_session_without_an_incarnation_never_uses_a_cache(
    redis_pair: tuple[RedisStore, RedisStore], redis_server: str, decoded_ids: list[int]
) -> None:
    """Sessions written by a server version that predates incarnations and the parents hash."""
    store, _ = redis_pair
    await store.create_session(meta("s"))
    records = await chain(store, "s", 2)
    cache = RecordCache()
    await store.lookup("s", ["r2"], None, known=cache)
    raw = aioredis.Redis.from_url(redis_server)
    meta_key, _, _, parents_key = store.session_keys("s")
    await raw.hdel(meta_key, "inc")
    await raw.delete(parents_key)
    await raw.aclose()

    for _ in range(2):
        decoded_ids.clear()
        found = await store.lookup("s", ["r2"], None, known=cache)
        assert sorted(decoded_ids) == [1, 2]
        assert found.parent_path == records and found.incarnation is None
        assert cache.incarnation is None
