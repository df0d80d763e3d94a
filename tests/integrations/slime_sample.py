"""slime's `Sample`, as far as the adapter touches it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


@dataclass
class Sample:
    """A stand-in for slime's `slime.utils.types.Sample` (slime is not on PyPI, so nothing
    real can be imported here): the fields the adapter sets, as slime declares them."""

    class Status(enum.Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    tokens: list[int] = field(default_factory=list)
    response_length: int = 0
    reward: float | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    status: Status = Status.PENDING
    session_id: str | None = None
