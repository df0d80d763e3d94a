"""The types every engine wire shares, and the `Wire` interface (see the package docstring)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np

from session_server.store.base import WeightSpan

if TYPE_CHECKING:
    from session_server.engine_http import Endpoint
    from session_server.images import ImageInput


@dataclass(slots=True)
class EngineChoice:
    index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    stop_reason: int | str | None
    weight_versions: list[WeightSpan] = field(default_factory=list)
    routed_experts: np.ndarray | None = None


@dataclass(slots=True)
class Generation:
    prompt_ids: list[int] | None  # as the engine reported them (None: it does not)
    choices: list[EngineChoice]
    engine_url: str
    latency_s: float
    cached_tokens: int | None = None
    """Prompt tokens the engine's prefix cache served (vLLM with
    --enable-prompt-tokens-details, SGLang always; None: not reported)."""


@dataclass(slots=True)
class StreamStart:
    """First event of a stream: the engine accepted the request and sent its first chunk.
    From here on the request is no longer retried elsewhere."""

    engine_url: str
    prompt_ids: list[int] | None  # as the engine reported them (None: it does not)


@dataclass(slots=True)
class GenerationDelta:
    index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    stop_reason: int | str | None
    weight_versions: list[WeightSpan] | None = None
    """The whole completion's spans (sent with the choice's last chunk)."""
    routed_experts: np.ndarray | None = None
    """(positions, layers, top_k), in the choice's last chunk (MoE routing replay)."""
    cached_tokens: int | None = None
    """Prompt tokens served by the prefix cache (vLLM: from the stream's usage chunk)."""


StreamEvent = StreamStart | GenerationDelta


class EngineError(Exception):
    """A generation failed. `status` is the HTTP status to give the client: the engine's own
    4xx passes through; an unreachable or failing engine is 502/503, a timeout 504."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str,
        *,
        param: str | None = None,
        retry_after_s: int | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.retry_after_s = retry_after_s
        """Seconds after which to retry (503 only; None: the default, 1 s)."""

    def __repr__(self) -> str:
        return f"EngineError({self.status}, {self.message!r}, {self.type!r})"


class Retryable(Exception):
    """Failed before the first token on one replica: try the next one."""

    def __init__(self, error: EngineError, *, mark_down: bool):
        super().__init__(error.message)
        self.error = error
        self.mark_down = mark_down


@dataclass(slots=True, frozen=True)
class Call:
    session_id: str
    prompt_ids: list[int]
    sampling: dict[str, Any]
    reasoning_ended: bool | None
    stream: bool
    prompt_json: bytes = b""
    """The prompt as a JSON array, encoded once: sent as is, and compared byte for byte
    with the prompt the engine echoes (empty: encode with the body, compare decoded)."""
    images: tuple[ImageInput, ...] = ()
    """Every image of the prompt in order; `prompt_ids` then has one pad per image and the
    engine echoes the expanded prompt."""


class Protocol(Enum):
    """vLLM's two token-in endpoints (the SGLang wire has one)."""

    GENERATE = "generate"
    COMPLETIONS = "completions"


@dataclass(slots=True)
class Replica:
    url: str
    healthy: bool = True  # optimistic until a check or a request says otherwise
    protocol: Protocol = Protocol.GENERATE
    failures: int = 0
    """Requests in a row that could not reach it (reset by any answer)."""
    inflight: int = 0
    weight_version: str | None = None
    """The policy version the replica serves: from `GET /weight_info` where the engine
    answers it, else the version that sampled the last tokens it returned."""
    weight_info: bool = True
    """False once the replica answered `GET /weight_info` with an error (not in dev mode)."""
    fenced: str | None = None
    """Why it gets no turns (behind the published policy, its update failed); None: serves."""
    tokenizer_differs: str | None = None
    """Why its tokenizer keeps it from serving (`mismatch: ...`, or `unchecked` until its
    probe answered; session_server/tokenizer_match.py); None: the same as this server's, or
    not compared. Apart from `fenced`, which the policy sets and clears by itself."""

    @property
    def refused(self) -> str | None:
        """Why it gets no turns now, whoever decided (None: it may serve)."""
        return self.fenced or (self.tokenizer_differs and f"tokenizer {self.tokenizer_differs}")

    endpoints: dict[str, Endpoint | None] = field(default_factory=dict, repr=False)
    """Per request path, the lean client's prepared endpoint (None: through httpx)."""


ChunkParser = Callable[[dict[str, Any]], tuple[list[int] | None, list[GenerationDelta]]]
"""One streamed chunk -> (the prompt the engine reported in it, if any; its deltas)."""


class Wire(ABC):
    """One engine's wire format. `EngineClient` owns the replicas and the HTTP clients and
    calls these for what differs between engines."""

    kind: str
    health_path = "/health"
    lacks: tuple[str, ...] = ()
    """What this engine does not give that vLLM's token endpoint does (`GET /sessions/{id}`
    lists it beside the session's counters, so a trainer sees it where it reads them)."""

    def __init__(self, model: str):
        self.model = model

    @abstractmethod
    def request(self, replica: Replica, call: Call, request_id: str) -> tuple[str, dict[str, Any]]:
        """(path, JSON body) of one generation request."""

    def fallback(self, replica: Replica, error: EngineError) -> bool:
        """The replica refused the request in a way another endpoint of this engine would
        not: switch `replica` to it and say True (the request is then sent again)."""
        return False

    def echo_check(self, replica: Replica, call: Call) -> Call | None:
        """The call whose JSON prompt the answer echoes at the top level (then compared as
        bytes instead of decoded), or None."""
        return None

    @abstractmethod
    def parse(self, payload: Any, replica: Replica) -> Generation:
        """A whole (non-streamed) answer."""

    @abstractmethod
    def stream_parser(self, replica: Replica, call: Call) -> ChunkParser:
        """A parser for one stream's chunks (it may keep state across them)."""

    @abstractmethod
    async def probe(
        self, http: httpx.AsyncClient, replica: Replica, timeout: httpx.Timeout
    ) -> None:
        """After a passing health check: read what the wire needs to know of the replica."""

    def aborts(self, request_id: str, call: Call) -> list[tuple[str, dict[str, Any]]]:
        """(path, body) of the requests that stop `request_id` on the engine when the client
        leaves it early; empty where closing the connection is enough."""
        return []


__all__ = [
    "Call",
    "ChunkParser",
    "EngineChoice",
    "EngineError",
    "Generation",
    "GenerationDelta",
    "Protocol",
    "Replica",
    "Retryable",
    "StreamEvent",
    "StreamStart",
    "Wire",
]
