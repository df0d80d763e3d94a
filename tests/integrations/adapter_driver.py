"""Run in a trainer framework's own virtualenv: export a finished rollout group from a live
tokenkeep with `tokenkeep.Client`, hand it to the framework's own types through
`tokenkeep.integrations.<framework>`, and print one JSON line of what those types hold (what
the framework trains on).

    adapter_driver.py verl|areal|nemo_gym|skyrl|slime SERVER_URL GROUP

skyrl and slime are not run by the test suite (SkyRL needs a multi-GB CUDA torch build on
Python 3.12, slime is not on PyPI): `bench/adapters_recorded.py` runs them in venvs built by
hand and records the result in bench/results/adapters.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import types
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tokenkeep, from this checkout

from tokenkeep import Client
from tokenkeep.types import Row


def verl(client: Client, rows: list[Row]) -> dict[str, Any]:
    """verl's own conversion of an `AgentLoopOutput` to the tensors of its training batch."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopOutput

    from tokenkeep.integrations.verl import agent_loop_output

    outputs = [agent_loop_output(row, num_turns=2) for row in rows]
    assert all(isinstance(o, AgentLoopOutput) for o in outputs)
    tensors = [o.as_dict() for o in outputs]
    return {
        key: [t[key].tolist() for t in tensors]
        for key in ("prompts", "responses", "response_mask", "rollout_log_probs", "rm_scores")
    } | {"extra_fields": [t["extra_fields"] for t in tensors]}


def areal(client: Client, rows: list[Row]) -> dict[str, Any]:
    """AReaL's grouped workflow (G episodes of a workflow, padded and concatenated by AReaL)
    over a workflow whose episodes are the group's exported rows."""
    from areal.api.workflow_api import RolloutWorkflow
    from areal.infra.remote_inf_engine import GroupedRolloutWorkflow

    from tokenkeep.integrations.areal import trajectory

    pending = list(rows)

    class Exported(RolloutWorkflow):
        async def arun_episode(self, engine: Any, data: dict[str, Any]) -> dict[str, Any]:
            return trajectory(pending.pop(0))

    grouped = GroupedRolloutWorkflow(Exported(), len(rows), logging.getLogger("areal"))
    batch = asyncio.run(grouped.arun_episode(None, {}))
    return {key: value.tolist() for key, value in batch.items()}


def nemo_gym(client: Client, rows: list[Row]) -> dict[str, Any]:
    """NeMo Gym's training output items, built from the per-turn fields."""
    from nemo_gym.openai_utils import (
        NeMoGymResponseOutputMessageForTraining,
        NeMoGymResponseOutputText,
    )

    from tokenkeep.integrations.nemo_gym import training_fields

    items = []
    for trajectory in client.trajectories([row.session_id for row in rows]):
        [branch] = trajectory.branches
        [segment] = branch.segments
        for n, fields in enumerate(training_fields(segment)):
            text = NeMoGymResponseOutputText(type="output_text", text="", annotations=[])
            item = NeMoGymResponseOutputMessageForTraining(
                id=f"msg_{n}", role="assistant", content=[text], status="completed",
                type="message", **fields,
            )  # fmt: skip
            items.append(
                {"session_id": trajectory.session_id}
                | item.model_dump(
                    include={"prompt_token_ids", "generation_token_ids", "generation_log_probs"}
                )
            )
    return {"items": items}


def skyrl(client: Client, rows: list[Row]) -> dict[str, Any]:
    """SkyRL's `GeneratorOutput` filled by the adapter, checked against the TypedDict's own
    keys, then turned into training tensors by SkyRL's own
    `convert_prompts_responses_to_batch_tensors` (what its trainer does with it)."""
    import typing

    from skyrl.train.dataset.preprocess import convert_prompts_responses_to_batch_tensors
    from skyrl.train.generators.base import GeneratorOutput, TrajectoryID

    from tokenkeep.integrations.skyrl import generator_output

    ids = [TrajectoryID(instance_id=row.group or "", repetition_id=n) for n, row in enumerate(rows)]
    output: GeneratorOutput = generator_output(rows, trajectory_ids=ids)  # type: ignore[assignment]
    declared = set(typing.get_type_hints(GeneratorOutput))
    assert set(output) == declared, (sorted(set(output) - declared), sorted(declared - set(output)))
    # SkyRL's trainer puts a trajectory's reward on its last response token before batching.
    rewards = [
        [0.0] * (len(r) - 1) + [w]
        for r, w in zip(output["response_ids"], output["rewards"], strict=True)
    ]
    sequences, attention, response_mask, token_rewards, loss_masks, logprobs, *_ = (
        convert_prompts_responses_to_batch_tensors(
            0, output["prompt_token_ids"], output["response_ids"], rewards, output["loss_masks"],
            output["rollout_logprobs"],
        )
    )  # fmt: skip
    tensors = {
        "sequences": sequences, "attention_mask": attention, "response_mask": response_mask,
        "rewards": token_rewards, "loss_masks": loss_masks, "rollout_logprobs": logprobs,
    }  # fmt: skip
    return {
        "output": {k: output[k] for k in ("prompt_token_ids", "response_ids", "loss_masks",
                                          "rollout_logprobs", "rewards")},
        "trajectory_ids": [t.to_string() for t in output["trajectory_ids"] or []],
        "tensors": {key: value.tolist() for key, value in tensors.items()},
    }  # fmt: skip


def slime(client: Client, rows: list[Row]) -> dict[str, Any]:
    """slime's own `Sample` filled by the adapter, checked by slime's own length validation
    and round-tripped through its `to_dict`/`from_dict` (how slime ships samples)."""
    import dataclasses

    from slime.utils.types import Sample

    from tokenkeep.integrations.slime import fill_sample

    samples = []
    for row in rows:
        sample = fill_sample(Sample(), row)
        sample._validate_response_metadata_lengths()
        again = Sample.from_dict(sample.to_dict())
        assert again == sample
        samples.append({
            "tokens": again.tokens, "response_length": again.response_length,
            "loss_mask": again.loss_mask, "rollout_log_probs": again.rollout_log_probs,
            "weight_versions": again.weight_versions, "reward": again.reward,
            "status": again.status.name, "session_id": again.session_id,
            "effective_response_length": again.effective_response_length,
        })  # fmt: skip
    fields = {f.name: type_name(f.type) for f in dataclasses.fields(Sample)}
    return {
        "samples": samples,
        "fields": fields,
        "status_members": [m.name for m in Sample.Status],
    }


DRIVERS = {"verl": verl, "areal": areal, "nemo_gym": nemo_gym, "skyrl": skyrl, "slime": slime}


def type_name(declared: Any) -> str:
    """A dataclass field's type as its source spells it (`int`, `list[int] | None`), whether
    the module postponed its annotations or not."""
    plain = isinstance(declared, type) and not isinstance(declared, types.GenericAlias)
    return (declared.__name__ if plain else str(declared)).replace("typing.", "")


def main() -> None:
    framework, url, group = sys.argv[1:]
    with Client(url) as client:
        rows = list(client.export(group=group))
        result = DRIVERS[framework](client, rows)
    print(json.dumps(result | {"session_ids": [row.session_id for row in rows]}))


if __name__ == "__main__":
    main()
