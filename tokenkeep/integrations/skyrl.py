"""SkyRL's generator (`skyrl.train.generators.base.GeneratorInterface`, read from skyrl 0.4.0;
skyrl-train 0.3.1 has the same fields): rollouts run through session URLs, returned from
`generate()` as SkyRL's `GeneratorOutput`.

`GeneratorOutput` is a TypedDict of per-trajectory lists in the input batch's order:
`prompt_token_ids`, `response_ids`, `rewards`, `loss_masks`, `rollout_logprobs` (one per
response token), and optional fields (None here). It imports nothing from SkyRL.

    class TokenkeepGenerator(GeneratorInterface):
        async def generate(self, input_batch):
            ids = ...  # a session per prompt: run the agent at its URL, finish it with a reward
            rows = [r async for r in tk.export(session_ids=ids)]
            return generator_output(rows, trajectory_ids=input_batch["trajectory_ids"])
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tokenkeep.integrations._rows import reward, split
from tokenkeep.types import Row

OPTIONAL = (
    "stop_reasons",
    "rollout_metrics",
    "trajectory_generation_times",
    "trajectory_time_splits",
    "rollout_expert_indices",
    "rollout_sample_support",
    "is_last_step",
    "env_metrics",
    "pixel_values",
    "image_grid_thw",
)
"""The `GeneratorOutput` fields tokenkeep has nothing for."""


def generator_output(rows: Iterable[Row], *, trajectory_ids: Any = None) -> dict[str, Any]:
    """One trajectory per exported row (a segment of a finished session), in the rows' order:
    the engine's first prompt as `prompt_token_ids`, the rest as `response_ids`, the loss mask
    over the response as `loss_masks`, the rollout logprobs (0.0 on context) and the finish
    reward (ValueError when finished without one). `trajectory_ids` (SkyRL's, from the input
    batch) is passed through: give one row per trajectory, in the input batch's order, so
    they line up."""
    output: dict[str, Any] = {
        "prompt_token_ids": [],
        "response_ids": [],
        "rewards": [],
        "loss_masks": [],
        "rollout_logprobs": [],
    }
    for row in rows:
        part = split(row)
        output["prompt_token_ids"].append(part.prompt_ids)
        output["response_ids"].append(part.response_ids)
        output["rewards"].append(reward(row))
        output["loss_masks"].append(part.response_mask)
        output["rollout_logprobs"].append(part.response_logprobs)
    return output | dict.fromkeys(OPTIONAL) | {"trajectory_ids": trajectory_ids}
