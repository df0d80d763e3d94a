"""Generations in flight in this process, and the aborts that cut them: recorded here or,
through the shared store, on any server."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from session_server.metrics import Metrics
from session_server.store.base import (
    SessionStore,
    StoreUnavailable,
)
from session_server.turns.errors import Aborted

ABORT_WAIT_S = 10.0
"""How long `abort` waits for the cut requests to store their turns and answer."""


ABORT_POLL_S = 0.25
"""While this server generates, how often it reads the aborts recorded through other
servers (`SessionStore.aborts_since`): one store command per poll, whatever the load."""


ABORTS_KEPT = 10_000
"""Sessions whose latest abort a server remembers (`TurnService._aborts`)."""


CLOCK_SKEW_S = 5.0
"""Aborts are read back this far before the oldest generation in flight here (servers'
clocks disagree by much less under NTP)."""


logger = logging.getLogger(__name__)
T = TypeVar("T")


class Cut(Exception):
    """Internal: a flight was aborted while it waited for the engine."""


class Flight:
    """One request of a session in flight here, from its planning on, which `abort` can
    cut. (A request waiting for an admission slot, or for the first request with its
    Idempotency-Key, is not known yet: it checks the aborts recorded since it arrived once
    it is.) Cut before its engine call, it is answered at once (`TurnService._unsent`);
    while it waits for the engine, `abort` cancels the task waiting for the engine (which
    closes the engine connection: vLLM then aborts the request) and that task resumes as if
    uncancelled, raising `Cut`. A flight that is not waiting for the engine at that moment
    (handing a chunk to its client) stops before it waits again; cancellation never lands
    outside the engine wait."""

    __slots__ = ("aborted", "done", "started", "task", "waiting")

    def __init__(self, started: float) -> None:
        self.task: asyncio.Task[Any] | None = None
        self.waiting = False
        self.aborted = False
        self.done = asyncio.Event()
        self.started = started
        """Unix time the request arrived: an abort recorded at or after it (through any
        server) cuts it."""

    def abort(self) -> None:
        if self.aborted:  # a second cancel would not be absorbed
            return
        self.aborted = True
        if self.waiting and self.task is not None:
            self.task.cancel()

    def _resumed(self) -> bool:
        """After a CancelledError: whether it was this flight's abort (then absorbed)."""
        return self.aborted and self.task is not None and self.task.uncancel() == 0

    async def run(self, awaitable: Awaitable[T]) -> T:
        if self.aborted:
            raise Cut
        self.task = asyncio.current_task()
        self.waiting = True
        try:
            return await awaitable
        except asyncio.CancelledError:
            if self._resumed():
                raise Cut from None
            raise
        finally:
            self.waiting = False

    async def events(self, events: AsyncIterator[T]) -> AsyncIterator[T]:
        while True:
            if self.aborted:
                raise Cut
            self.task = asyncio.current_task()
            self.waiting = True
            try:
                event = await anext(events)
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                if self._resumed():
                    raise Cut from None
                raise
            finally:
                self.waiting = False
            yield event


class Flights:
    """The generations in flight in this process, by session, and the aborts that cut them."""

    def __init__(self, store: SessionStore, metrics: Metrics) -> None:
        self.store = store
        self.metrics = metrics
        # Session -> its generations in flight in this process (`abort`), and the task that
        # cuts those an abort through another server reaches (runs while any are in flight).
        self._flights: dict[str, set[Flight]] = {}
        self._abort_watch: asyncio.Task[None] | None = None
        # Session -> its latest abort known here (recorded here, or read by `_watch`),
        # for requests that arrived before it but reach this service after it.
        self._aborts: dict[str, float] = {}

    async def abort(self, session_id: str) -> int:
        """Cut every generation of the session in flight: the abort is recorded in the store
        (other servers sharing it cut theirs within ABORT_POLL_S, `_watch_aborts`), then
        those in this process are cut: each stores its cut turn (finish_reason "abort") and
        answers its client with `Aborted`. Returns how many were cut here, once they have
        answered (or after ABORT_WAIT_S)."""
        at = time.time()
        await self.store.record_abort(session_id, at)
        self._known(session_id, at)
        flights = list(self._flights.get(session_id, ()))
        for flight in flights:
            flight.abort()
        if flights:
            await asyncio.wait(
                [asyncio.ensure_future(f.done.wait()) for f in flights], timeout=ABORT_WAIT_S
            )
        return len(flights)

    def take_off(self, session_id: str, arrived: float | None) -> Flight:
        """Register a request as in flight; already aborted when an abort known here was
        recorded at or after it arrived (it waited for an admission slot meanwhile)."""
        flight = Flight(time.time() if arrived is None else arrived)
        flight.aborted = self._aborts.get(session_id, -1.0) >= flight.started
        self._flights.setdefault(session_id, set()).add(flight)
        if self._abort_watch is None or self._abort_watch.done():
            self._abort_watch = asyncio.create_task(self._watch())
        return flight

    async def _watch(self) -> None:
        """While generations are in flight here: cut those that an abort recorded through
        any server reaches (started at or before it). Ends when none is left."""
        while self._flights:
            await asyncio.sleep(ABORT_POLL_S)
            if not self._flights:
                return
            oldest = min(f.started for flights in self._flights.values() for f in flights)
            try:
                aborts = await self.store.aborts_since(oldest - CLOCK_SKEW_S)
            except StoreUnavailable:  # the store logs it; its own retries failed: poll again
                continue
            except Exception:  # a bug: stay loud, but keep watching
                logger.exception("reading the recorded aborts failed")
                continue
            for session_id, at in aborts.items():
                self._known(session_id, at)
                for flight in list(self._flights.get(session_id, ())):
                    if flight.started <= at:
                        flight.abort()

    def _known(self, session_id: str, at: float) -> None:
        if at > self._aborts.get(session_id, -1.0):
            self._aborts[session_id] = at
        if len(self._aborts) > ABORTS_KEPT:  # the oldest are far older than any request
            for old in sorted(self._aborts, key=self._aborts.__getitem__)[: ABORTS_KEPT // 2]:
                del self._aborts[old]

    def unsent(self, session_id: str, flight: Flight) -> None:
        """Before the engine call: a request aborted while it waited for a slot or was being
        planned is answered now, with no engine call and nothing stored (nothing sampled)."""
        if flight.aborted:
            self.metrics.aborted_requests.inc()
            raise Aborted(session_id, sent=False)

    def land(self, session_id: str, flight: Flight) -> None:
        """Past the engine call (or failed before it): an abort no longer cuts it."""
        flights = self._flights.get(session_id)
        if flights is not None:
            flights.discard(flight)
            if not flights:
                del self._flights[session_id]
        flight.done.set()
