"""Turn k+1's prompt starts exactly with turn k's prompt + sampled tokens, for every
mismatch class and harness habit, while a naive re-render would have broken it."""

from __future__ import annotations

from typing import Any

import pytest

from tests.engine_double import ScriptedCompletion
from tests.session.adversarial import (
    SCENARIOS,
    TOOLS,
    Scenario,
    naive_prompt,
    reply_as_harness_sends,
)
from tests.session.conftest import Stack
from tests.suffix_reference import assert_suffix
from tests.trajectory_values import assert_trajectory_values

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}


def _next_messages(reply: Any, scenario: Scenario) -> list[dict[str, Any]]:
    if reply.tool_calls:
        return [
            {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21}'}
            for call in reply.tool_calls
        ]
    return [{"role": "user", "content": scenario.next_user}]


def run_two_turns(stack: Stack, scenario: Scenario, session_id: str) -> dict[str, Any]:
    model = stack.model
    client = stack.openai(session_id)
    tools = TOOLS if scenario.tools else None
    history: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "Weather in Paris?"}]
    sampled = scenario.completion(model)
    stack.double.script(ScriptedCompletion(sampled, finish_reason=scenario.finish_reason))
    first = client.chat.completions.create(
        model="m",
        messages=history,
        extra_body={"return_token_ids": True},
        **({"tools": tools} if tools else {}),
    )
    scenario.check(first.choices[0].message)
    assert first.choices[0].token_ids == sampled  # the reply carries the sampled tokens
    echoed = scenario.harness(reply_as_harness_sends(first.choices[0].message))
    history = [*history, echoed, *_next_messages(first.choices[0].message, scenario)]
    stack.double.script(ScriptedCompletion(model.encode("Done.") + model.stop_token_ids[:1]))
    second = client.chat.completions.create(
        model="m",
        messages=history,
        extra_body={"return_token_ids": True},
        **({"tools": tools} if tools else {}),
    )
    prompt1, prompt2 = stack.prompts()[-2:]
    return {
        "prompt1": prompt1,
        "sampled": sampled,
        "prompt2": prompt2,
        "history": history,
        "tools": tools,
        "second": second,
    }


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_next_prompt_extends_sampled_tokens(stack: Stack, scenario: Scenario) -> None:
    run = run_two_turns(stack, scenario, f"contig-{scenario.name}")
    stored = run["prompt1"] + run["sampled"]
    assert_suffix(stack.model, run["prompt2"], stored, run["sampled"], run["history"], run["tools"])
    assert run["second"].model_extra["tokenkeep"]["kind"] == "extend"
    # What a trainer gets: every sampled token with the engine's logprob and version, and
    # nothing else marked for the loss.
    trajectory = stack.trajectory(f"contig-{scenario.name}")
    checked = assert_trajectory_values(trajectory, stack.double.samples, every_sample=True)
    assert checked == len(run["sampled"]) + len(run["second"].choices[0].token_ids)
    if scenario.naive_breaks:
        naive = naive_prompt(stack.model, run["history"], run["tools"])
        assert naive[: len(stored)] != stored, "a full re-render would not have broken this"


def test_break_counts_naive_versus_tokenkeep(memory_stack: Stack) -> None:
    """The README's figures, exactly: over the 14 scenarios tokenkeep breaks none; a full
    re-render continues none of them (13 render to other tokens, 1 cannot be rendered)."""
    tokenkeep_breaks: list[str] = []
    rerender_breaks: list[str] = []
    unrenderable: list[str] = []
    for scenario in SCENARIOS:
        run = run_two_turns(memory_stack, scenario, f"count-{scenario.name}")
        stored = run["prompt1"] + run["sampled"]
        if run["prompt2"][: len(stored)] != stored:
            tokenkeep_breaks.append(scenario.name)
        try:
            naive = naive_prompt(memory_stack.model, run["history"], run["tools"])
        except ValueError:  # arguments the template cannot even parse: no prompt at all
            unrenderable.append(scenario.name)
            continue
        if naive[: len(stored)] != stored:
            rerender_breaks.append(scenario.name)
    print(
        f"\nover {len(SCENARIOS)} scenarios: tokenkeep breaks {len(tokenkeep_breaks)}; a full "
        f"re-render breaks {len(rerender_breaks)} and cannot render {len(unrenderable)}"
    )
    assert len(SCENARIOS) == 14
    assert tokenkeep_breaks == []
    assert len(rerender_breaks) == 13
    assert unrenderable == ["tool_arguments_python_round_trip"]
    assert {s.name for s in SCENARIOS if s.naive_breaks} == set(rerender_breaks)


def test_trajectory_is_one_contiguous_segment_with_loss_mask(stack: Stack) -> None:
    scenario = next(s for s in SCENARIOS if s.name == "truncated_by_max_tokens")
    run = run_two_turns(stack, scenario, "traj-one")
    trajectory = stack.trajectory("traj-one")
    (branch,) = trajectory["branches"]
    (segment,) = branch["segments"]
    assert segment["start_reason"] == "first"
    second_completion = run["second"].choices[0].token_ids
    assert segment["token_ids"] == run["prompt2"] + second_completion
    mask = segment["loss_mask"]
    p1, s1 = len(run["prompt1"]), len(run["sampled"])
    assert mask[:p1] == [0] * p1
    assert mask[p1 : p1 + s1] == [1] * s1
    assert mask[p1 + s1] == 0  # the synthesized close of the truncated turn
    assert sum(mask) == s1 + len(second_completion)
    assert_trajectory_values(trajectory, stack.double.samples, every_sample=True)
    assert [t["finish_reason"] for t in segment["turns"]] == ["length", "stop"]
