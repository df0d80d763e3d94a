"""What a `TurnService` is configured with: the model's limits and the server's defaults.

Built from `Settings` by `app.build_service`; read by `turns` and `sampling` (its own
module so neither imports the other for it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class ServiceConfig:
    model_name: str
    context_length: int
    max_text_chars: int | None = None
    """Message text longer than this cannot fit the context (refused before tokenizing)."""
    create_on_first_use: bool = True
    default_ttl_seconds: int | None = 86400
    routed_experts: bool = False
    """Sessions store MoE routes unless created saying otherwise."""
    max_policy_lag: int | None = None
    """A new turn is refused once the engine's version exceeds the version that sampled the
    rollout's first turn by more than this (None: no bound)."""
    sampling_overrides: dict[str, Any] = field(default_factory=dict)
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    max_sessions_cached: int = 4096
    idempotency_wait_s: float = 60.0
    """How long a resend waits for the request holding its Idempotency-Key (then 409)."""
    idempotency_stale_s: float = 900.0
    """A claim older than this is abandoned (its server died): a resend takes it over."""
