"""Debounced, coalescing, per-key work with retry backoff, on Kopf's event loop.

Every watch event of a custom resource or of a child it owns asks for its owner to be
reconciled. Events arriving close together (a rollout moves a Deployment, its ReplicaSets and
pods many times a second) become one run after a short quiet `debounce`; one key never runs
twice at once, and an event arriving during a run makes exactly one more run afterwards. A
run that fails is retried with exponential backoff, unless a new event asks for it sooner.

Reconciling is idempotent and writes nothing when the cluster already matches (see
`apply.py` and `Reconciler._write_status`), so the operator's own writes, which come back as
events, settle after one extra read-only pass instead of looping.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from tokenkeep_operator.kube import error_message

logger = logging.getLogger(__name__)


@dataclass
class _Slot:
    due: float
    timer: asyncio.TimerHandle | None = None
    running: bool = False
    again: bool = False
    failures: int = 0
    tasks: set[asyncio.Task[None]] = field(default_factory=set)


class WorkQueue:
    def __init__(
        self,
        work: Callable[[Hashable], float | None],
        *,
        debounce: float = 1.0,
        backoff: float = 5.0,
        max_backoff: float = 300.0,
    ) -> None:
        """`work(key)` runs in a worker thread (it makes blocking API calls); an exception
        from it means "try again later", a number "run again that many seconds from now"
        (state no watch event announces, e.g. a SessionServer's published policy)."""
        self._work = work
        self.debounce = debounce
        self.backoff = backoff
        self.max_backoff = max_backoff
        self._slots: dict[Hashable, _Slot] = {}

    def add(self, key: Hashable, delay: float | None = None) -> None:
        """Ask for `key` to be worked on `delay` seconds from now (default: the debounce),
        or sooner if it is already due sooner."""
        loop = asyncio.get_running_loop()
        due = loop.time() + (self.debounce if delay is None else delay)
        slot = self._slots.get(key)
        if slot is None:
            slot = self._slots[key] = _Slot(due=due)
        elif slot.running:
            slot.again = True
            return
        elif slot.timer is not None and slot.due <= due:
            return
        if slot.timer is not None:
            slot.timer.cancel()
        slot.due = due
        slot.timer = loop.call_at(due, self._start, key)

    def _start(self, key: Hashable) -> None:
        slot = self._slots[key]
        slot.timer = None
        slot.running = True
        task = asyncio.get_running_loop().create_task(self._run(key, slot))
        slot.tasks.add(task)  # keep a reference until it finishes
        task.add_done_callback(slot.tasks.discard)

    async def _run(self, key: Hashable, slot: _Slot) -> None:
        retry: float | None = None
        poll: float | None = None
        try:
            poll = await asyncio.get_running_loop().run_in_executor(None, self._work, key)
            slot.failures = 0
        except Exception as error:
            slot.failures += 1
            retry = min(self.backoff * 2 ** (slot.failures - 1), self.max_backoff)
            logger.warning("%s: %s; retrying in %.0f s", key, error_message(error), retry)
        finally:
            slot.running = False
        if slot.again:
            slot.again = False
            self.add(key)
        elif retry is not None:
            self.add(key, retry)
        elif poll is not None:
            self.add(key, poll)
        else:
            del self._slots[key]
