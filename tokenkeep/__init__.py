"""Python client for the tokenkeep session server: sessions for rollouts, finished rollouts
with rewards, and their token-exact trajectories as objects or NumPy arrays."""

from tokenkeep.client import AsyncClient, Client, PolicyTransfer, TokenkeepError
from tokenkeep.types import (
    Aborted,
    Batch,
    Branch,
    Finish,
    FinishedSession,
    Policy,
    ReplicaPolicy,
    Row,
    Segment,
    SegmentArrays,
    SessionInfo,
    Trajectory,
    WeightSpan,
)

__all__ = [
    "Aborted",
    "AsyncClient",
    "Batch",
    "Branch",
    "Client",
    "Finish",
    "FinishedSession",
    "Policy",
    "PolicyTransfer",
    "ReplicaPolicy",
    "Row",
    "Segment",
    "SegmentArrays",
    "SessionInfo",
    "TokenkeepError",
    "Trajectory",
    "WeightSpan",
]
