"""TRL `GRPOTrainer`'s custom rollout hook (`rollout_func`) fed from tokenkeep's export.

`rollout_func(prompts, trainer)` must return a dict with `prompt_ids`, `completion_ids` and
`logprobs` (one list per completion, `logprobs` one float per completion token); any other key
is forwarded to the reward functions, except `env_mask`, which TRL reads as its tool mask
(1 = the model sampled the token and it is trained on, 0 = environment tokens). This module
imports nothing from TRL: it only reshapes exported rows (checked against trl 1.16.0).

    def rollout_func(prompts, trainer):
        ...  # run the rollouts through session URLs, finish each with a reward
        return rollout_output(tk.export(session_ids=ids))

    GRPOTrainer(..., reward_funcs=tokenkeep_reward, rollout_func=rollout_func)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tokenkeep.integrations._rows import split
from tokenkeep.types import Row


def rollout_output(rows: Iterable[Row]) -> dict[str, list[Any]]:
    """One completion per exported row (a segment of a finished session): `prompt_ids` are the
    row's tokens before its first sampled token, `completion_ids` the rest (later prompts and
    tool results included), `env_mask` the row's loss mask over the completion, and `logprobs`
    the rollout's logprob of each sampled token, 0.0 under `env_mask` 0 (as TRL's own tool loop
    fills tool tokens). `reward` (None where finished without one) and `session_id` go to the
    reward functions."""
    output: dict[str, list[Any]] = {
        key: []
        for key in ("prompt_ids", "completion_ids", "logprobs", "env_mask", "reward", "session_id")
    }
    for row in rows:
        part = split(row)
        output["prompt_ids"].append(part.prompt_ids)
        output["completion_ids"].append(part.response_ids)
        output["logprobs"].append(part.response_logprobs)
        output["env_mask"].append(part.response_mask)
        output["reward"].append(row.reward)
        output["session_id"].append(row.session_id)
    return output


def tokenkeep_reward(
    completions: list[Any], reward: list[float | None], **_: Any
) -> list[float | None]:
    """A TRL reward function returning the reward each session was finished with."""
    return reward
