"""A second model family (Llama 3.2, official template) and the generic end-of-turn splice,
on tokenizer directories that name no model (as a user's checkpoint would)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from session_server.splice import GENERIC, ChatModel, detect_family
from session_server.tokenizer import load_tokenizer
from tests.engine_double import EngineDouble, ScriptedCompletion
from tests.real_tokenizers import llama32_dir, qwen3_dir
from tests.session.adversarial import END, SCENARIOS, TOOLS, Scenario, naive_prompt, tokens
from tests.session.conftest import Stack, make_stack
from tests.session.test_contiguity import run_two_turns
from tests.suffix_reference import assert_suffix

TEXT_SCENARIOS = [
    s
    for s in SCENARIOS
    if s.name
    in {
        "bpe_split",
        "partial_utf8_character",
        "truncated_by_max_tokens",
        "merge_across_prompt_completion_boundary",
        "whitespace_stripped_by_harness",
    }
]
TOOL_SCENARIOS = [
    s
    for s in SCENARIOS
    if s.name
    in {
        "tool_json_compact",
        "tool_json_key_order_resorted_by_harness",
        "whitespace_before_tool_call",
    }
]
MODELS = {
    "llama-3.2/auto": (llama32_dir, "auto"),
    "llama-3.2/generic": (llama32_dir, GENERIC),
    "qwen3/generic": (qwen3_dir, GENERIC),
}


@pytest.fixture(scope="module", params=list(MODELS))
def family_model(request: pytest.FixtureRequest) -> ChatModel:
    directory, renderer = MODELS[request.param]
    return ChatModel(load_tokenizer(str(directory())), renderer)


@pytest.fixture
def family_stack(family_model: ChatModel, engine_double: EngineDouble) -> Iterator[Stack]:
    yield from make_stack(family_model, engine_double, "memory", None)


@pytest.fixture
def generic_qwen3_stack(engine_double: EngineDouble) -> Iterator[Stack]:
    """Qwen3 (a tool-calling template) on the generic end-of-turn splice."""
    model = ChatModel(load_tokenizer(str(qwen3_dir())), GENERIC)
    yield from make_stack(model, engine_double, "memory", None)


@pytest.mark.parametrize("scenario", TOOL_SCENARIOS, ids=[s.name for s in TOOL_SCENARIOS])
def test_generic_splice_carries_tool_results(
    generic_qwen3_stack: Stack, scenario: Scenario
) -> None:
    """The tool result and the generation prompt are what the template writes after the
    sampled call."""
    stack = generic_qwen3_stack
    run = run_two_turns(stack, scenario, f"generic-{scenario.name}")
    stored = run["prompt1"] + run["sampled"]
    assert_suffix(stack.model, run["prompt2"], stored, run["sampled"], run["history"], TOOLS)
    assert run["second"].model_extra["tokenkeep"]["kind"] == "extend"


def test_auto_recognises_families_from_the_tokenizer_itself() -> None:
    assert detect_family(load_tokenizer(str(llama32_dir()))) == "llama-3"
    assert detect_family(load_tokenizer(str(qwen3_dir()))) == "qwen3"


def test_end_of_turn_token_comes_from_the_template() -> None:
    llama = ChatModel(load_tokenizer(str(llama32_dir())), GENERIC)
    assert llama.tokenizer.convert_ids_to_tokens(llama.close_token_id) == "<|eot_id|>"
    assert llama.close_token_id in llama.stop_token_ids


@pytest.mark.parametrize("scenario", TEXT_SCENARIOS, ids=[s.name for s in TEXT_SCENARIOS])
def test_contiguous_where_a_rerender_breaks(family_stack: Stack, scenario: Scenario) -> None:
    run = run_two_turns(family_stack, scenario, f"family-{scenario.name}")
    stored = run["prompt1"] + run["sampled"]
    assert_suffix(
        family_stack.model, run["prompt2"], stored, run["sampled"], run["history"], run["tools"]
    )
    assert run["second"].model_extra["tokenkeep"]["kind"] == "extend"
    naive = naive_prompt(family_stack.model, run["history"], run["tools"])
    assert naive[: len(stored)] != stored


def test_three_turns_stay_one_segment(family_stack: Stack) -> None:
    scenario = next(s for s in TEXT_SCENARIOS if s.name == "bpe_split")
    run = run_two_turns(family_stack, scenario, "family-three")
    history = [
        *run["history"],
        {"role": "assistant", "content": run["second"].choices[0].message.content},
        {"role": "user", "content": "One more: summarise."},
    ]
    family_stack.double.script(ScriptedCompletion(tokens(family_stack.model, "Sum", "mary", END)))
    third = family_stack.openai("family-three").chat.completions.create(model="m", messages=history)
    assert third.model_extra["tokenkeep"]["kind"] == "extend"
    trajectory = family_stack.trajectory("family-three")
    (branch,) = trajectory["branches"]
    assert len(branch["segments"]) == 1
    assert [t["kind"] for t in branch["segments"][0]["turns"]] == ["first", "extend", "extend"]
