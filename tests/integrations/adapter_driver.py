"""Run in a trainer framework's own virtualenv: export a finished rollout group from a live
tokenkeep with `tokenkeep.Client`, hand it to the framework's own types through
`tokenkeep.integrations.<framework>`, and print one JSON line of what those types hold (what
the framework trains on).

    adapter_driver.py verl|areal|nemo_gym SERVER_URL GROUP
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
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


def main() -> None:
    framework, url, group = sys.argv[1:]
    with Client(url) as client:
        rows = list(client.export(group=group))
        result = {"verl": verl, "areal": areal, "nemo_gym": nemo_gym}[framework](client, rows)
    print(json.dumps(result | {"session_ids": [row.session_id for row in rows]}))


if __name__ == "__main__":
    main()
