"""`ScriptedEngine`: the engine-client interface, in-process, for the check."""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

from session_server.check.scenarios import Completion
from session_server.engines import EngineChoice, Generation, GenerationDelta, StreamStart
from session_server.images import ImageInput


class _InProcess:
    kind = "in-process"  # nothing to publish a policy to


class ScriptedEngine:
    """The engine-client interface of `session_server.engines.EngineClient`, in-process:
    each generation "samples" the next queued completion. Not a vLLM double: nothing here
    speaks HTTP; the check needs the serving path above the engine, not the wire."""

    url = "in-process"
    replicas: tuple[Any, ...] = ()  # no replica to report in a session's engine versions
    wire = _InProcess()

    def __init__(self) -> None:
        self.prompts: list[list[int]] = []
        self._queue: deque[Completion] = deque()
        self.on_replica_unverified: list[Callable[[Any], None]] = []
        self.published_version: str | None = None
        self.accepts_version: Callable[[str], bool] | None = None

    def script(self, *completions: Completion) -> None:
        self._queue.extend(completions)

    def reset(self) -> None:
        self.prompts.clear()
        self._queue.clear()

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def ready(self) -> bool:
        return True

    def _next(self, prompt_ids: list[int]) -> Completion:
        self.prompts.append(list(prompt_ids))
        return self._queue.popleft()

    async def generate(
        self,
        session_id: str,
        prompt_ids: list[int],
        sampling: dict[str, Any],
        *,
        reasoning_ended: bool | None = None,
        images: tuple[ImageInput, ...] = (),
        prompt_json: bytes | None = None,
    ) -> Generation:
        # `images`: the check's scenarios carry none (the engine would expand them).
        c = self._next(prompt_ids)
        choice = EngineChoice(
            0, list(c.token_ids), [-0.1] * len(c.token_ids), c.finish_reason, None
        )
        return Generation(list(prompt_ids), [choice], self.url, 0.0)

    async def stream(
        self,
        session_id: str,
        prompt_ids: list[int],
        sampling: dict[str, Any],
        *,
        reasoning_ended: bool | None = None,
        images: tuple[ImageInput, ...] = (),
        prompt_json: bytes | None = None,
    ) -> AsyncIterator[StreamStart | GenerationDelta]:
        c = self._next(prompt_ids)
        yield StreamStart(self.url, list(prompt_ids))
        last = len(c.token_ids) - 1
        for i, token in enumerate(c.token_ids):
            yield GenerationDelta(0, [token], [-0.1], c.finish_reason if i == last else None, None)
