"""The work queue's contract: bursts coalesce, one key never runs twice at once, an event
during a run makes exactly one more run, failures are retried."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Hashable

from tokenkeep_operator.workqueue import WorkQueue


async def until(check: Callable[[], bool], limit: float = 10.0) -> None:
    for _ in range(int(limit / 0.01)):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


def test_a_burst_of_events_is_one_run() -> None:
    runs: list[Hashable] = []

    async def scenario() -> None:
        queue = WorkQueue(runs.append, debounce=0.05)
        for _ in range(50):
            queue.add("a")
        queue.add("b")
        await until(lambda: len(runs) >= 2 and not queue._slots)

    asyncio.run(scenario())
    assert sorted(runs) == ["a", "b"]


def test_an_event_during_a_run_makes_exactly_one_more_run() -> None:
    started, release = threading.Event(), threading.Event()
    runs: list[Hashable] = []
    running = []

    def work(key: Hashable) -> None:
        running.append(key)
        assert running.count(key) == 1, "ran twice at once"
        started.set()
        release.wait(10)
        runs.append(key)
        running.remove(key)

    async def scenario() -> None:
        queue = WorkQueue(work, debounce=0.01)
        queue.add("a")
        await until(started.is_set)
        for _ in range(5):
            queue.add("a")
        release.set()
        await until(lambda: len(runs) == 2 and not queue._slots)

    asyncio.run(scenario())
    assert runs == ["a", "a"]


def test_failures_are_retried_until_they_succeed() -> None:
    attempts: list[Hashable] = []

    def work(key: Hashable) -> None:
        attempts.append(key)
        if len(attempts) < 3:
            raise RuntimeError("refused")

    async def scenario() -> None:
        queue = WorkQueue(work, debounce=0.01, backoff=0.01)
        queue.add("a")
        await until(lambda: len(attempts) == 3 and not queue._slots)

    asyncio.run(scenario())
    assert attempts == ["a", "a", "a"]


def test_work_that_asks_to_be_polled_runs_again_after_that_long() -> None:
    """A SessionServer's published policy changes no Kubernetes object: its reconcile asks
    to run again (a number of seconds) and the queue does, until it stops asking."""
    runs: list[Hashable] = []

    def work(key: Hashable) -> float | None:
        runs.append(key)
        return 0.05 if len(runs) < 3 else None

    async def scenario() -> None:
        queue = WorkQueue(work, debounce=0.01)
        queue.add("a")
        await until(lambda: len(runs) == 3 and not queue._slots)

    asyncio.run(scenario())
    assert runs == ["a", "a", "a"]
