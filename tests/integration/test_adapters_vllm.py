"""The trainer adapters on a rollout sampled by the real vLLM CPU engine (dev mode, a policy
version published between the two turns): what the pure adapters (SkyRL, slime, NeMo Gym's
per-call fields, AReaL's per-token versions) hand a trainer is the prompt vLLM itself reported,
the tokens and logprobs it sampled, and the versions it stamped them with. The adapters are
tested against the frameworks' packages in tests/integrations (engine double)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from tests.integration.conftest import RealStack
from tests.integration.test_weight_versions_vllm import publish
from tests.integrations.slime_sample import Sample
from tokenkeep import Client
from tokenkeep.integrations.areal import token_versions
from tokenkeep.integrations.nemo_gym import training_fields
from tokenkeep.integrations.skyrl import generator_output
from tokenkeep.integrations.slime import fill_sample

pytestmark = pytest.mark.vllm


def test_adapters_hold_what_vllm_sampled(real_stack: RealStack) -> None:
    old = uuid.uuid4().int % 10**6
    group = f"adapters-{old}"
    seen = len(real_stack.relay.exchanges)
    with real_stack.http() as http:
        session = http.post(
            "/sessions", json={"sampling": {"seed": 5}, "group": group, "group_size": 1}
        ).json()
        chat = real_stack.openai(session)
        history: list[Any] = [{"role": "user", "content": "Say something."}]
        publish(real_stack.engine.url, str(old))
        first = chat.chat.completions.create(model="m", messages=history, max_tokens=6)
        history += [
            {"role": "assistant", "content": first.choices[0].message.content or ""},
            {"role": "user", "content": "More."},
        ]
        publish(real_stack.engine.url, str(old + 1))
        chat.chat.completions.create(model="m", messages=history, max_tokens=6)
    call1, call2 = real_stack.relay.exchanges[seen:]
    prompt1, prompt2 = call1.reported_prompt, call2.reported_prompt
    assert prompt1 is not None and prompt2 is not None
    (sampled1, lp1), (sampled2, lp2) = ((c.sampled[0], c.logprobs[0]) for c in (call1, call2))
    between = prompt2[len(prompt1) + len(sampled1) :]  # the assistant's end and the new user turn
    assert prompt2[: len(prompt1) + len(sampled1)] == prompt1 + sampled1

    with Client(real_stack.url) as tk:
        tk.finish(session["id"], reward=0.5)
        [row] = tk.export(group=group)
        [segment] = tk.trajectory(session["id"]).branches[0].segments

    output = generator_output([row])
    assert output["prompt_token_ids"] == [prompt1]
    assert output["response_ids"] == [sampled1 + between + sampled2]
    assert output["loss_masks"] == [[1] * len(sampled1) + [0] * len(between) + [1] * len(sampled2)]
    assert output["rollout_logprobs"][0] == pytest.approx(
        lp1 + [0.0] * len(between) + lp2, abs=1e-5
    )
    assert output["rewards"] == [0.5]

    sample = fill_sample(Sample(), row)
    assert sample.tokens == prompt2 + sampled2
    assert sample.response_length == len(sampled1 + between + sampled2)
    assert sample.weight_versions == [str(old), str(old + 1)]

    fields = training_fields(segment)
    assert [f["prompt_token_ids"] for f in fields] == [prompt1, prompt2]
    assert [f["generation_token_ids"] for f in fields] == [sampled1, sampled2]
    assert fields[1]["generation_log_probs"] == pytest.approx(lp2, abs=1e-5)

    assert token_versions(row) == (
        [-1] * len(prompt1)
        + [old] * len(sampled1)
        + [-1] * len(between)
        + [old + 1] * len(sampled2)
    )
