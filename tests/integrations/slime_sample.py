"""slime's `Sample`, as far as the adapter touches it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Sample:
    """A stand-in for slime's `slime.utils.types.Sample` (slime is not on PyPI, so nothing
    real can be imported here): the fields the adapter sets, as slime declares them at commit
    624b824 (bench/adapters_recorded.py checks this against slime's own class)."""

    class Status(enum.Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    tokens: list[int] = field(default_factory=list)
    response_length: int = 0
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    status: Status = Status.PENDING
    session_id: str | None = None
