"""A Redis Cluster primary killed under load, with replicas and `--redis-wait-replicas 1`.

Real processes on loopback: 3 primaries + 3 replicas (`redis-cli --cluster create
--cluster-replicas 1`), two `tokenkeep serve` replicas, an engine double. The primary serving
the slot of live sessions is killed with SIGKILL mid-load; its replica takes over the slots, and
the killed node comes back 5 s later as the new primary's replica.
Every turn the servers acknowledged was on a replica first (WAIT on the slot primary's
connection), so none is lost, an Idempotency-Key acknowledged before the kill still
returns the stored reply, and an abort acknowledged before the kill is still recorded (the
keyed session is picked so that its slot and the aborts' share the killed primary)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from session_server.store.redis import RedisStore
from tests.redis_topologies import cluster
from tests.reliability.harness import MODEL, Engine, Server, check_store, drive, record
from tests.reliability.test_faults import _after, _assert_clean, _running

pytestmark = pytest.mark.reliability


async def test_cluster_primary_killed_under_load(tmp_path: Path) -> None:
    with cluster(tmp_path / "cluster", masters=3, replicas=1) as nodes:
        aborts_primary = nodes.primary_of("tk:aborts")
        keyed = next(
            name
            for name in (f"failover-keyed-{i}" for i in range(1000))
            if nodes.primary_of(f"tk:{{{name}}}:meta") == aborts_primary
        )
        engine = Engine(latency_ms=50)
        flags = ("--redis-wait-replicas", "1", "--redis-retry-s", "10")
        servers = [Server(tmp_path, nodes.url, [engine.url], *flags) for _ in range(2)]
        with _running(engine, *servers):
            urls = [s.url for s in servers]
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "Remember this."}],
                "max_tokens": 16,
                "return_token_ids": True,
            }
            headers = {"Idempotency-Key": "before-the-kill"}
            path = f"/sessions/{keyed}/v1/chat/completions"
            async with httpx.AsyncClient(timeout=60) as client:
                first = await client.post(urls[0] + path, json=body, headers=headers)
                aborted_at = time.time()
                abort = await client.post(f"{urls[0]}/sessions/{keyed}/abort")
            assert first.status_code == 200 and abort.status_code == 200
            victim = nodes.primary_of(f"tk:{{{keyed}}}:meta")
            assert victim == aborts_primary
            killed_at: list[float] = []

            def kill() -> None:
                killed_at.append(time.monotonic())
                nodes.kill(victim)
                # Its replica took over with no replica of its own: WAIT 1 refuses writes to
                # those slots (503) until the old primary is back as a replica.
                time.sleep(5)
                nodes.restart(victim)

            load = drive(urls, sessions=30, turns=4, prefix="failover", stream_every=4)
            tally, _ = await asyncio.gather(load, _after(1.0, kill))
            promoted = nodes.primary_of(f"tk:{{{keyed}}}:meta")
            lost, corrupted = await check_store(nodes.url, tally)
            # Resent to the other server, after the failover: the stored reply, not a new turn.
            async with httpx.AsyncClient(timeout=60) as client:
                again = await client.post(urls[1] + path, json=body, headers=headers)
            unavailable = [t for _, t, s in tally.failures if t >= killed_at[0]]
            record(
                "Redis Cluster primary kill -9 (3 primaries + 3 replicas, wait-replicas 1)",
                tally,
                lost,
                corrupted,
                f"2 servers; {len(unavailable)} answers not 200 after the kill; an "
                "Idempotency-Key and an abort acked before the kill survive it",
            )
            _assert_clean(tally, lost, corrupted, alive=urls)
            assert promoted != victim
            assert again.status_code == 200
            stored, replayed = first.json(), again.json()
            assert replayed["tokenkeep"]["turn_ids"] == stored["tokenkeep"]["turn_ids"]
            assert replayed["choices"][0]["token_ids"] == stored["choices"][0]["token_ids"]
            assert (
                replayed["choices"][0]["message"]["content"]
                == stored["choices"][0]["message"]["content"]
            )
            store = RedisStore(nodes.url)
            try:  # the resend stored nothing new; the abort is still recorded
                assert len(await store.all_turns(keyed)) == 1
                assert (await store.aborts_since(aborted_at - 5))[keyed] >= aborted_at - 5
            finally:
                await store.close()
            for server in servers:  # no request failed with a 500 on either server
                assert '"status":500' not in server.log()
