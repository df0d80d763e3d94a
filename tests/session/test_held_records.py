"""The turns a server stores stay in its record cache exactly as the store would give them
back, so the next turn's lookup decodes (and, on Redis, transfers) none of them."""

from __future__ import annotations

import asyncio
import math

from session_server.store.base import SessionStore, TurnRecord
from session_server.store.redis import RedisStore
from tests.engine_double import ScriptedCompletion
from tests.session.conftest import Stack


def _nan_free(values: list[float]) -> list[float | str]:
    return [v if not math.isnan(v) else "nan" for v in values]


def _stored(
    stack: Stack, redis_url: str, session_id: str, turn_ids: list[int]
) -> list[TurnRecord | None]:
    """The records as the store decodes them, read by a store of the test's own (the
    server's Redis client belongs to the server's event loop)."""
    served = stack.service.store
    store: SessionStore = (
        RedisStore(redis_url, key_prefix=served._prefix)
        if isinstance(served, RedisStore)
        else served
    )

    async def read() -> list[TurnRecord | None]:
        try:
            return await store.get_turns(session_id, turn_ids)
        finally:
            if store is not served:
                await store.close()

    return asyncio.run(read())


def test_held_records_equal_the_stored_ones_and_spare_the_next_lookup(
    stack: Stack, redis_server: str, decoded_ids: list[int]
) -> None:
    client = stack.openai("held")
    messages: list[dict[str, object]] = [{"role": "user", "content": "Plan the trip."}]
    sampled = stack.model.encode("Day one: the coast.") + stack.model.stop_token_ids[:1]
    # A logprob the engine did not give (null: stored as NaN) and values float32 cannot
    # hold exactly.
    logprobs = [-0.1, -1 / 3, None, *[-0.2] * (len(sampled) - 3)]
    for turn in range(4):
        stack.double.script(ScriptedCompletion(sampled, logprobs=logprobs))  # type: ignore[arg-type]
        reply = client.chat.completions.create(model="m", messages=messages)  # type: ignore[arg-type]
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content},
            {"role": "user", "content": f"And day {turn + 2}?"},
        ]
        if turn == 1:
            decoded_ids.clear()  # from here on every parent was stored by this server
    assert decoded_ids == []

    held = stack.service.sessions.held("held").records
    assert sorted(held) == [1, 2, 3, 4]
    stored = _stored(stack, redis_server, "held", sorted(held))
    for record, turn_id in zip(stored, sorted(held), strict=True):
        assert record is not None
        mine = held[turn_id]
        assert _nan_free(mine.logprobs) == _nan_free(record.logprobs)
        assert all(
            getattr(mine, name) == getattr(record, name)
            for name in TurnRecord.__slots__
            if name != "logprobs"
        ), turn_id
    assert math.isnan(held[1].logprobs[2]) and held[1].logprobs[1] != -1 / 3  # float32 kept
