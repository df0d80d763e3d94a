"""What one engine's wire format is, separate from replica management (engines.py).

`EngineClient` picks replicas, checks health, retries and bounds what is in flight; a `Wire`
builds the request body for a prompt, parses the engine's answer (whole or streamed) into
`Generation` / `GenerationDelta`, probes a replica for the facts it needs, and says how to
abort one request. One module per engine: `vllm`, `sglang`.
"""

from __future__ import annotations

from typing import Literal

from session_server.engine_wire.base import Wire
from session_server.engine_wire.sglang import SglangWire
from session_server.engine_wire.vllm import VllmWire

EngineKind = Literal["vllm", "sglang"]


def wire_for(kind: EngineKind, model: str) -> Wire:
    """The wire of `tokenkeep serve --engine KIND`."""
    return SglangWire(model) if kind == "sglang" else VllmWire(model)


__all__ = ["EngineKind", "SglangWire", "VllmWire", "Wire", "wire_for"]
