"""AReaL's rollout workflow (`areal.api.workflow_api.RolloutWorkflow`, checked against areal
1.0.4): a rollout run through a session URL, returned from `arun_episode` as AReaL's tensor
trajectory.

`arun_episode` returns, per trajectory, tensors of shape [1, T]: `input_ids` (int32),
`loss_mask` (int32, 1 on sampled tokens), `logprobs` (float32, 0.0 on prompt tokens),
`versions` (int32, the policy version that sampled each token, -1 on prompt tokens),
`attention_mask` (bool) and `rewards` (float32, [1]); AReaL pads and concatenates them
(`concat_padded_tensors`). torch is imported only when `trajectory` is called.

    class TokenkeepWorkflow(RolloutWorkflow):
        async def arun_episode(self, engine, data):
            ...  # a session per rollout: run the agent at its URL, finish it with a reward
            [row] = [r async for r in tk.export(session_ids=[session.id])]
            return trajectory(row)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenkeep.integrations._rows import reward, split
from tokenkeep.types import Row

if TYPE_CHECKING:
    import torch


def token_versions(row: Row) -> list[int]:
    """The policy version of each token of the row: the version that sampled it, -1 on
    context tokens and on sampled tokens whose engine reported no version. ValueError for a
    version that is not an integer (AReaL counts versions in integers)."""
    versions = [-1] * len(row.token_ids)
    for span in row.weight_versions:
        try:
            version = int(span.version)
        except ValueError:
            raise ValueError(
                f"session {row.session_id}: policy version {span.version!r} is not an integer"
            ) from None
        versions[span.start : span.end] = [version] * (span.end - span.start)
    return versions


def trajectory(row: Row) -> dict[str, torch.Tensor]:
    """One exported row (a segment of a finished session) as AReaL's trajectory: the whole
    segment as `input_ids`, its loss mask, the rollout logprobs (0.0 on context), the version
    of each token and the finish reward (ValueError when finished without one)."""
    import torch

    part = split(row)
    fields = {
        "input_ids": torch.tensor(row.token_ids, dtype=torch.int32),
        "logprobs": torch.tensor([0.0] * part.start + part.response_logprobs, dtype=torch.float32),
        "loss_mask": torch.tensor(row.loss_mask, dtype=torch.int32),
        "versions": torch.tensor(token_versions(row), dtype=torch.int32),
        "rewards": torch.tensor(reward(row), dtype=torch.float32),
        "attention_mask": torch.ones(len(row.token_ids), dtype=torch.bool),
    }
    return {key: value.unsqueeze(0) for key, value in fields.items()}
