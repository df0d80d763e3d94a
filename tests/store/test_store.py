"""Behaviour every SessionStore shares; each test runs on MemoryStore and on RedisStore."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import random
import time

import pytest

from session_server.store.base import (
    Finish,
    SessionCounters,
    SessionExists,
    SessionFinished,
    SessionNotFound,
    SessionStore,
    TurnRecord,
    UnknownParent,
)
from session_server.store.memory import MemoryStore
from session_server.store.redis import RedisStore
from tests.store.turns import meta, turn


def as_stored(record: TurnRecord, turn_id: int) -> TurnRecord:
    return dataclasses.replace(record, turn_id=turn_id)


async def chain(store: SessionStore, sid: str, length: int) -> list[TurnRecord]:
    """Append a linear conversation t1 -> t2 -> ...; turn i is indexed under reply key `r<i>`
    and input key `i<i>`. Returns the records as stored."""
    records: list[TurnRecord] = []
    parent = None
    for i in range(1, length + 1):
        record = turn(parent, seed=i, n_prompt=3 + i, n_completion=2 + i)
        (turn_id,) = await store.append_turns(sid, [record], [[f"r{i}", f"i{i}"]])
        records.append(as_stored(record, turn_id))
        parent = turn_id
    return records


async def test_create_get_delete(store: SessionStore) -> None:
    created = await store.create_session(meta("s1", ttl_seconds=60))
    assert created == meta("s1", ttl_seconds=60)
    assert await store.get_session("s1") == created
    assert await store.get_session("other") is None
    with pytest.raises(SessionExists):
        await store.create_session(meta("s1"))
    assert await store.delete_session("s1") is True
    assert await store.get_session("s1") is None
    assert await store.delete_session("s1") is False


async def test_each_creation_of_an_id_has_its_own_incarnation(store: SessionStore) -> None:
    first = await store.create_session(meta("s1"))
    assert first.incarnation and (await store.get_session("s1")).incarnation == first.incarnation
    assert await store.append_turns("s1", [turn(None)], [["a"]], incarnation=first.incarnation) == [
        1
    ]
    assert (await store.lookup("s1", ["a"], None)).incarnation == first.incarnation
    await store.delete_session("s1")
    second = await store.create_session(meta("s1"))
    assert second.incarnation not in (None, first.incarnation)
    assert (await store.get_session("s1")).incarnation == second.incarnation
    # An append planned against the first creation never lands in the second.
    with pytest.raises(SessionNotFound):
        await store.append_turns("s1", [turn(None)], [["b"]], incarnation=first.incarnation)
    assert await store.all_turns("s1") == []
    assert (
        await store.append_turns("s1", [turn(None)], [["b"]], incarnation=second.incarnation)
    ) == [1]


async def test_a_finished_session_takes_no_turn(store: SessionStore) -> None:
    await store.create_session(meta("s"))
    (a,) = await store.append_turns("s", [turn(None)], [["a"]])
    assert not (await store.lookup("s", ["a"], None)).finished
    before = (await store.counters("s"), await store.all_turns("s"))
    await store.finish_session("s", Finish(finished_at=time.time(), reward=1.0))
    assert (await store.lookup("s", ["a"], None)).finished
    for unless_key in (None, "b"):
        with pytest.raises(SessionFinished):
            await store.append_turns("s", [turn(a)], [["b"]], unless_key=unless_key)
    assert (await store.counters("s"), await store.all_turns("s")) == before
    assert await store.resolve_key("s", "b") is None


async def test_recreated_session_starts_empty(store: SessionStore) -> None:
    await store.create_session(meta("s1"))
    await chain(store, "s1", 2)
    await store.delete_session("s1")
    await store.create_session(meta("s1"))
    assert await store.all_turns("s1") == []
    assert await store.resolve_key("s1", "r1") is None
    (turn_id,) = await store.append_turns("s1", [turn(None)], [["r1"]])
    assert turn_id == 1


async def test_missing_session_raises_everywhere(store: SessionStore) -> None:
    with pytest.raises(SessionNotFound):
        await store.lookup("nope", ["a"], "b")
    with pytest.raises(SessionNotFound):
        await store.append_turns("nope", [turn(None)], [["a"]])
    with pytest.raises(SessionNotFound):
        await store.resolve_key("nope", "a")
    with pytest.raises(SessionNotFound):
        await store.all_turns("nope")
    with pytest.raises(SessionNotFound):
        await store.get_turns("nope", [1])
    with pytest.raises(SessionNotFound):
        await store.get_turns("nope", [])
    with pytest.raises(SessionNotFound):
        await store.counters("nope")


async def test_lookup_takes_the_highest_index_hit_with_its_whole_path(
    store: SessionStore,
) -> None:
    await store.create_session(meta("s"))
    t1, t2, t3 = await chain(store, "s", 3)

    found = await store.lookup("s", ["r1", "r2", "unknown", "r3", "later"], None)
    assert found.matched_key_index == 3
    assert found.parent_path == [t1, t2, t3]
    assert found.retry_of is None and found.retry_path == []
    assert found.turn_count == 3

    # The position among the keys asked for decides, not the depth in the tree.
    found = await store.lookup("s", ["r3", "r1"], None)
    assert found.matched_key_index == 1
    assert found.parent_path == [t1]

    found = await store.lookup("s", ["x", "y"], None)
    assert found.matched_key_index is None
    assert found.parent_path == []

    found = await store.lookup("s", [], None)
    assert found.matched_key_index is None and found.turn_count == 3


async def test_paths_cross_segment_starts(store: SessionStore) -> None:
    await store.create_session(meta("s"))
    first = turn(None, seed=1)
    (a,) = await store.append_turns("s", [first], [["ra"]])
    second = turn(a, seed=2)
    (b,) = await store.append_turns("s", [second], [["rb"]])
    rewrite = turn(b, seed=3, segment_start=True, kind="rewrite", break_reason="compaction")
    (c,) = await store.append_turns("s", [rewrite], [["rc"]])
    fourth = turn(c, seed=4)
    (d,) = await store.append_turns("s", [fourth], [["rd"]])

    found = await store.lookup("s", ["ra", "rd"], None)
    assert found.parent_path == [
        as_stored(first, a),
        as_stored(second, b),
        as_stored(rewrite, c),
        as_stored(fourth, d),
    ]
    assert [r.segment_start for r in found.parent_path] == [True, False, True, False]
    assert found.parent_path[2].break_reason == "compaction"


async def test_retry_lookup_returns_the_turn_and_its_parents_path(store: SessionStore) -> None:
    await store.create_session(meta("s"))
    t1, t2, t3 = await chain(store, "s", 3)

    # A retry of t3: the request's history ends at t2's reply, its input is t3's input.
    found = await store.lookup("s", ["r1", "r2"], "i3")
    assert found.matched_key_index == 1
    assert found.parent_path == [t1, t2]
    assert found.retry_of == t3
    assert found.retry_path == [t1, t2]

    found = await store.lookup("s", [], "i1")
    assert found.retry_of == t1
    assert found.retry_path == []

    found = await store.lookup("s", ["r3"], "unknown")
    assert found.retry_of is None and found.retry_path == []
    assert found.parent_path == [t1, t2, t3]


async def test_siblings_get_consecutive_ids_and_share_a_parent(store: SessionStore) -> None:
    await store.create_session(meta("s"))
    (root,) = await store.append_turns("s", [turn(None)], [["r0"]])
    siblings = [turn(root, seed=s) for s in (10, 11, 12)]
    ids = await store.append_turns("s", siblings, [["a", "shared"], ["b", "shared"], ["c"]])
    assert ids == [2, 3, 4]
    assert await store.get_turns("s", [3, 99, 2]) == [
        as_stored(siblings[1], 3),
        None,
        as_stored(siblings[0], 2),
    ]
    found = await store.lookup("s", ["c"], None)
    assert [r.turn_id for r in found.parent_path] == [1, 4]


async def test_first_turn_stored_under_a_key_keeps_it(store: SessionStore) -> None:
    await store.create_session(meta("s"))
    (a,) = await store.append_turns("s", [turn(None, seed=1)], [["k", "resp_a"]])
    (b,) = await store.append_turns("s", [turn(a, seed=2)], [["k", "k2"]])
    ids = await store.append_turns("s", [turn(a, seed=3), turn(a, seed=4)], [["k3"], ["k3"]])
    assert await store.resolve_key("s", "k") == a
    assert await store.resolve_key("s", "k2") == b
    assert await store.resolve_key("s", "resp_a") == a
    assert await store.resolve_key("s", "k3") == ids[0]
    assert await store.resolve_key("s", "missing") is None


async def test_counters(store: SessionStore) -> None:
    await store.create_session(meta("s"))
    assert await store.counters("s") == SessionCounters(turns=0, segments=0, breaks={}, tokens=0)
    first = turn(None, n_prompt=10, n_completion=4)
    (a,) = await store.append_turns("s", [first], [["a"]])
    rewrites = [
        turn(a, n_prompt=20, n_completion=5, segment_start=True, break_reason="compaction"),
        turn(a, n_prompt=1, n_completion=0, segment_start=True, break_reason="template_drift"),
    ]
    await store.append_turns("s", rewrites, [[], []])
    await store.append_turns(
        "s", [turn(a, segment_start=True, break_reason="compaction", n_prompt=7)], [[]]
    )
    await store.append_turns("s", [turn(a, n_prompt=2, n_completion=2)], [[]])
    assert await store.counters("s") == SessionCounters(
        turns=5,
        segments=4,
        breaks={"compaction": 2, "template_drift": 1},
        tokens=14 + 25 + 1 + 10 + 4,
    )


async def test_list_sessions_gives_every_live_session_with_its_counters(
    store: SessionStore,
) -> None:
    assert await store.list_sessions() == []
    await store.create_session(meta("a"))
    await store.create_session(meta("b", ttl_seconds=60))
    await chain(store, "b", 2)
    await store.create_session(meta("gone"))
    await store.delete_session("gone")
    listed = {m.session_id: (m, c) for m, c in await store.list_sessions()}
    assert set(listed) == {"a", "b"}
    assert listed["b"][0] == await store.get_session("b")
    assert listed["b"][1] == await store.counters("b")
    assert listed["a"][1] == SessionCounters(turns=0, segments=0, breaks={}, tokens=0)


async def test_all_turns_in_id_order(store: SessionStore) -> None:
    await store.create_session(meta("s"))
    records = await chain(store, "s", 12)  # ids 10-12 sort after 9 only numerically
    assert await store.all_turns("s") == records


async def test_records_come_back_as_stored(store: SessionStore) -> None:
    await store.create_session(meta("s"))
    odd = TurnRecord(
        turn_id=0,
        parent_id=None,
        segment_start=True,
        kind="custom-kind",
        break_reason=None,
        prompt_delta=[0, 2**24 - 1, 2**24, 2**32 - 1],
        completion_ids=[],
        logprobs=[],
        finish_reason="content_filter",
        stop_reason="</tool_call>",
        n_messages=70_000,
        created_at=time.time(),
        api="sdk-x",
        extra={"timings": {"queue_ms": 1.5}, "response_id": "resp_é"},
    )
    (a,) = await store.append_turns("s", [odd], [["k"]])
    lossy = turn(a, n_completion=2)
    lossy.logprobs = [-0.1, float("nan")]
    (b,) = await store.append_turns("s", [lossy], [["k2"]])

    got_odd, got_lossy = await store.get_turns("s", [a, b])
    assert got_odd == as_stored(odd, a)
    assert got_lossy is not None
    # Logprobs are float32: -0.1 comes back as the float32 nearest to it, NaN stays NaN.
    assert got_lossy.logprobs[0] == pytest.approx(-0.1, abs=1e-8)
    assert got_lossy.logprobs[0] != -0.1
    assert got_lossy.logprobs[1] != got_lossy.logprobs[1]
    assert got_lossy.completion_ids == lossy.completion_ids


async def test_failed_appends_store_nothing(store: SessionStore) -> None:
    await store.create_session(meta("s"))
    (a,) = await store.append_turns("s", [turn(None)], [["a"]])
    before = await store.counters("s")

    with pytest.raises(UnknownParent):
        await store.append_turns("s", [turn(a, seed=1), turn(42, seed=2)], [["x"], ["y"]])
    bad_logprobs = turn(a, seed=3)
    bad_logprobs.logprobs = bad_logprobs.logprobs[:-1]
    with pytest.raises(ValueError, match="logprobs"):
        await store.append_turns("s", [turn(a, seed=4), bad_logprobs], [["x"], ["y"]])
    with pytest.raises(ValueError):
        await store.append_turns("s", [turn(a, seed=5)], [["x"], ["y"]])
    with pytest.raises(ValueError):
        await store.append_turns("s", [], [])
    negative = turn(a, seed=6)
    negative.prompt_delta = [-1]
    with pytest.raises(ValueError):
        await store.append_turns("s", [negative], [["x"]])

    assert await store.counters("s") == before
    assert await store.resolve_key("s", "x") is None
    assert [r.turn_id for r in await store.all_turns("s")] == [a]
    (b,) = await store.append_turns("s", [turn(a)], [["x"]])
    assert b == a + 1


async def test_append_to_a_deleted_session_writes_nothing(store: SessionStore) -> None:
    await store.create_session(meta("s"))
    (a,) = await store.append_turns("s", [turn(None)], [["a"]])
    await store.delete_session("s")
    with pytest.raises(SessionNotFound):
        await store.append_turns("s", [turn(a)], [["b"]])
    assert await store.get_session("s") is None
    await store.create_session(meta("s"))
    assert await store.all_turns("s") == []
    assert await store.resolve_key("s", "b") is None


async def test_concurrent_appends_never_corrupt_a_session(store: SessionStore) -> None:
    await store.create_session(meta("s"))
    (root,) = await store.append_turns("s", [turn(None)], [["root"]])
    rng = random.Random(7)

    async def one(i: int) -> list[int]:
        # Parents are any turn known to exist before the burst, or the root.
        siblings = [turn(root, seed=i * 10 + j, n_completion=i % 5) for j in range(1 + i % 3)]
        return await store.append_turns(
            "s", siblings, [[f"k{i}-{j}", "contended"] for j in range(len(siblings))]
        )

    order = list(range(50))
    rng.shuffle(order)
    results = await asyncio.gather(*(one(i) for i in order))
    ids = [turn_id for batch in results for turn_id in batch]
    assert sorted(ids) == list(range(2, 2 + len(ids)))
    for batch in results:
        assert batch == list(range(batch[0], batch[0] + len(batch)))

    records = await store.all_turns("s")
    assert [r.turn_id for r in records] == list(range(1, 2 + len(ids)))
    assert all(r.parent_id in (None, root) for r in records)
    counters = await store.counters("s")
    assert counters.turns == len(records)
    assert counters.tokens == sum(len(r.prompt_delta) + len(r.completion_ids) for r in records)
    assert await store.resolve_key("s", "contended") in ids
    for i, batch in zip(order, results, strict=True):
        for j, turn_id in enumerate(batch):
            assert await store.resolve_key("s", f"k{i}-{j}") == turn_id


async def test_concurrent_extends_build_valid_chains(store: SessionStore) -> None:
    """Ten tasks each extend their own conversation, interleaved, looking up the leaf to
    extend before each append as the core does."""
    await store.create_session(meta("s"))
    (root,) = await store.append_turns("s", [turn(None)], [["root"]])

    async def extend(worker: int) -> list[int]:
        keys = ["root"]
        for step in range(5):
            found = await store.lookup("s", keys, None)
            parent = found.parent_path[-1].turn_id
            keys.append(f"w{worker}s{step}")
            await store.append_turns("s", [turn(parent, seed=worker * 100 + step)], [[keys[-1]]])
        found = await store.lookup("s", keys, None)
        return [r.turn_id for r in found.parent_path]

    paths = await asyncio.gather(*(extend(w) for w in range(10)))
    assert all(len(path) == 6 and path[0] == root for path in paths)
    assert len({turn_id for path in paths for turn_id in path[1:]}) == 50
    records = await store.all_turns("s")
    by_id = {r.turn_id: r for r in records}
    for path in paths:
        for parent, child in itertools.pairwise(path):
            assert by_id[child].parent_id == parent


async def test_ttl_slides_on_append_and_expires_everything(store: SessionStore) -> None:
    """The slide is read from each store's own clock (no sleeping against a deadline); the
    expiry itself is real and waited for with a generous bound."""
    await store.create_session(meta("s", ttl_seconds=3600))
    await store.create_session(meta("forever"))
    if isinstance(store, RedisStore):
        keys = store.session_keys("s")
        await store._redis.pexpire(keys[0], 1000)  # as if 3599 s had passed
        (a,) = await store.append_turns("s", [turn(None)], [["a"]])
        remaining = [await store._redis.pttl(key) for key in keys]
        assert all(3_000_000 < ms <= 3_600_000 for ms in remaining), remaining
        for key in reversed(keys):  # now let it run out, the meta key last
            await store._redis.pexpire(key, 1)
    else:
        assert isinstance(store, MemoryStore)
        now = [0.0]
        store = MemoryStore(clock=lambda: now[0])
        await store.create_session(meta("s", ttl_seconds=3600))
        await store.create_session(meta("forever"))
        now[0] = 3599.0
        (a,) = await store.append_turns("s", [turn(None)], [["a"]])
        now[0] = 3599.0 + 3599.0  # alive only because the append slid it
        assert await store.resolve_key("s", "a") == a
        now[0] += 2.0
    deadline = time.monotonic() + 60  # a bound for a hung store, not a timing claim
    while await store.get_session("s") is not None:
        assert time.monotonic() < deadline, "session did not expire"
        await asyncio.sleep(0.05)
    if isinstance(store, RedisStore):
        assert not await store._redis.exists(*store.session_keys("s"))
    with pytest.raises(SessionNotFound):
        await store.lookup("s", ["a"], None)
    with pytest.raises(SessionNotFound):
        await store.append_turns("s", [turn(None)], [["b"]])
    assert await store.get_session("forever") is not None


async def test_ttl_must_be_positive(store: SessionStore) -> None:
    with pytest.raises(ValueError):
        await store.create_session(meta("s", ttl_seconds=0))
    assert await store.get_session("s") is None


async def test_ping(store: SessionStore) -> None:
    assert await store.ping() is True


async def test_lookup_keys_are_opaque_strings(store: SessionStore) -> None:
    await store.create_session(meta("s"))
    odd_keys = ["", "r:é\n\x00", "resp: with spaces", "x" * 300]
    ids = await store.append_turns(
        "s", [turn(None, seed=i) for i in range(4)], [[k] for k in odd_keys]
    )
    for key, turn_id in zip(odd_keys, ids, strict=True):
        found = await store.lookup("s", ["missing", key, "other"], key)
        assert found.matched_key_index == 1
        assert [r.turn_id for r in found.parent_path] == [turn_id]
        assert found.retry_of is not None and found.retry_of.turn_id == turn_id


async def test_lookup_counts_the_children_of_the_matched_turn(store: SessionStore) -> None:
    await store.create_session(meta("kids"))
    (root,) = await store.append_turns("kids", [turn(None)], [["r:root"]])
    found = await store.lookup("kids", ["r:root"], None)
    assert found.parent_children == 0
    await store.append_turns("kids", [turn(root), turn(root)], [["r:a"], ["r:b"]])
    found = await store.lookup("kids", ["r:root"], None)
    assert found.parent_children == 2
    assert (await store.lookup("kids", ["r:a"], None)).parent_children == 0
    assert (await store.lookup("kids", ["r:none"], None)).parent_children == 0
