"""verl's agent loop (`verl.experimental.agent_loop`, checked against verl 0.9.1): a rollout run
through a session URL, returned to verl as its `AgentLoopOutput`.

An agent loop's `run()` returns `AgentLoopOutput(prompt_ids, response_ids, response_mask,
response_logprobs, reward_score, num_turns, metrics, ...)`: `response_ids` hold the sampled
tokens and the tool responses after them, `response_mask` is 1 on sampled tokens, 0 on tool
tokens. verl is imported only when `agent_loop_output` is called.

    @register("tokenkeep")
    class TokenkeepAgentLoop(AgentLoopBase):
        async def run(self, sampling_params, **kwargs):
            ...  # a session per rollout: run the agent at its URL, finish it with a reward
            [row] = [r async for r in tk.export(session_ids=[session.id])]
            return agent_loop_output(row)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tokenkeep.integrations._rows import split
from tokenkeep.types import Row

if TYPE_CHECKING:
    from verl.experimental.agent_loop.agent_loop import AgentLoopOutput


def agent_loop_output(row: Row, *, num_turns: int = 0, **extra_fields: Any) -> AgentLoopOutput:
    """One exported row (a segment of a finished session) as verl's `AgentLoopOutput`: the
    engine's first prompt as `prompt_ids`, the rest as `response_ids`, the row's loss mask over
    the response as `response_mask`, the rollout logprobs as `response_logprobs` (0.0 on tool
    tokens, as verl's tool agent loop fills them), the finish reward as `reward_score` (verl
    puts it on the last response token) and MoE routes, when stored, as `routed_experts`.
    `session_id` and any `extra_fields` given go to verl's `extra_fields`."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

    part = split(row)
    return AgentLoopOutput(
        prompt_ids=part.prompt_ids,
        response_ids=part.response_ids,
        response_mask=part.response_mask,
        response_logprobs=part.response_logprobs,
        routed_experts=None if row.routed_experts is None else row.routed_experts.tolist(),
        reward_score=row.reward,
        num_turns=num_turns,
        metrics=AgentLoopMetrics(),
        extra_fields={"session_id": row.session_id, **extra_fields},
    )
