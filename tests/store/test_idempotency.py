"""The store's part in retries that never split a rollout: the conditional append
(`unless_key`) and Idempotency-Key claims, on the embedded store, Redis and Redis Cluster."""

from __future__ import annotations

import asyncio

import pytest

from session_server.store.base import (
    IDEMPOTENCY_DONE,
    IdempotencyClaim,
    KeyTaken,
    SessionNotFound,
    SessionStore,
)
from tests.store.turns import meta, turn


async def test_unless_key_lets_one_of_two_identical_appends_through(store: SessionStore) -> None:
    await store.create_session(meta("s"))
    first, second = turn(None, seed=1), turn(None, seed=2)
    (winner,) = await store.append_turns("s", [first], [["r1", "in"]], unless_key="in")
    with pytest.raises(KeyTaken) as taken:
        await store.append_turns("s", [second], [["r2", "in"]], unless_key="in")
    assert taken.value.turn_id == winner
    assert len(await store.all_turns("s")) == 1  # nothing stored by the loser
    # Racing appends: exactly one wins, the others are told which turn did.
    await store.create_session(meta("race"))
    results = await asyncio.gather(
        *(
            store.append_turns("race", [turn(None, seed=i)], [[f"r{i}", "x"]], unless_key="x")
            for i in range(8)
        ),
        return_exceptions=True,
    )
    won = [r for r in results if isinstance(r, list)]
    lost = [r for r in results if isinstance(r, KeyTaken)]
    assert len(won) == 1 and len(lost) == 7
    assert {e.turn_id for e in lost} == {won[0][0]}


async def test_idempotency_claims(store: SessionStore) -> None:
    await store.create_session(meta("s"))
    claim = store.claim_idempotency
    assert await claim("s", "k", "fp", owner="a", stale_after_s=60) == IdempotencyClaim("owned")
    assert await claim("s", "k", "fp", owner="a", stale_after_s=60) == IdempotencyClaim("owned")
    assert await claim("s", "k", "fp2", owner="b", stale_after_s=60) == IdempotencyClaim(
        "pending", fingerprint="fp"
    )
    # A claim older than stale_after_s is abandoned: another owner takes it over.
    assert await claim("s", "k", "fp2", owner="b", stale_after_s=0) == IdempotencyClaim("owned")
    await store.release_idempotency("s", "k", "a")  # not a's any more: stays b's
    assert (await claim("s", "k", "fp", owner="c", stale_after_s=60)).state == "pending"
    await store.release_idempotency("s", "k", "b")
    assert await claim("s", "k", "fp", owner="c", stale_after_s=60) == IdempotencyClaim("owned")
    # The append of the reply replaces the claim: every later claim finds the reply.
    (turn_id,) = await store.append_turns("s", [turn(None, seed=1)], [[IDEMPOTENCY_DONE + "k"]])
    for owner in ("c", "d"):
        found = await claim("s", "k", "fp", owner=owner, stale_after_s=60)
        assert found == IdempotencyClaim("done", turn_id=turn_id)
    await store.delete_session("s")
    with pytest.raises(SessionNotFound):
        await claim("s", "k", "fp", owner="a", stale_after_s=60)
    await store.release_idempotency("s", "k", "a")  # no error once the session is gone
