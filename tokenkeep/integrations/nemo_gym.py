"""NeMo Gym's training token fields (`nemo_gym.openai_utils.TokenIDLogProbMixin`, checked
against nemo-gym 0.4.0): per model call of a rollout, the prompt the engine was sent and the
tokens and logprobs it sampled, from tokenkeep's record of the session.

NeMo Gym's `vllm_model` server, with `return_token_id_information: true`, puts
`prompt_token_ids`, `generation_token_ids` and `generation_log_probs` on the last output item
of each model call (the `...ForTraining` output items NeMo RL trains on); it gets the prompt by
re-tokenizing the messages through the engine's `/tokenize`, not from what was sampled.
`training_fields` gives the same three fields per turn from tokenkeep's stored tokens. It
imports nothing from NeMo Gym.

    segment = tk.trajectory(session_id).branches[-1].segments[0]
    for item, fields in zip(last_item_of_each_model_call, training_fields(segment)):
        NeMoGymResponseOutputMessageForTraining(**item.model_dump(), **fields)
"""

from __future__ import annotations

from typing import TypedDict

from tokenkeep.types import Segment


class TrainingFields(TypedDict):
    prompt_token_ids: list[int]
    generation_token_ids: list[int]
    generation_log_probs: list[float]


def training_fields(segment: Segment) -> list[TrainingFields]:
    """One entry per turn of the segment (a model call), in order: the segment's tokens before
    the turn's completion (the exact prompt the engine was sent), the sampled tokens and their
    logprobs. A rollout whose contiguity broke has more than one segment: each starts anew."""
    fields: list[TrainingFields] = []
    for turn in segment.turns:
        start, end = turn["completion_span"]
        logprobs = segment.logprobs[start:end]
        if any(lp is None for lp in logprobs):
            raise ValueError(f"turn {turn['turn_id']} has sampled tokens without a logprob")
        fields.append(
            TrainingFields(
                prompt_token_ids=segment.token_ids[:start],
                generation_token_ids=segment.token_ids[start:end],
                generation_log_probs=[float(lp) for lp in logprobs if lp is not None],
            )
        )
    return fields
