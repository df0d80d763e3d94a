"""`tool_choice` "required" and a named tool are enforced in token space: the engine request
carries a structured-output constraint in the family's own tool-call syntax (a structural
tag for Qwen3/Hermes `<tool_call>` blocks and Gemma 4's `<|tool_call>call:..` blocks, a JSON
schema for Llama 3's bare JSON calls), on
Chat Completions, Responses and Messages; where the syntax is unknown the request is a 400
with the reason and nothing is stored. Syntaxes learned from the template are enforced too
(tests/session/test_toolsyntax.py). The real engine applying it is in
`tests/integration/test_tool_choice_vllm.py`."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest

from session_server.check import load_model
from session_server.splice import ChatModel
from tests.engine_double import EngineDouble, ScriptedCompletion
from tests.real_tokenizers import gemma4_dir, unlearnable_dir
from tests.session.adversarial import TOOLS
from tests.session.reply_corpus import CORPUS
from tests.session.test_stream_equivalence import (
    ANTHROPIC_TOOLS,
    BASE,
    RESPONSES_TOOLS,
    family,
    serving,
)

REPLY = {r.name: r for r in CORPUS}


@pytest.fixture(scope="module")
def double() -> Iterator[EngineDouble]:
    engine = EngineDouble().start()
    yield engine
    engine.stop()


# Each API's spelling of "required" and "this tool".
CHOICES = {
    "chat": ("required", {"type": "function", "function": {"name": "calc"}}),
    "responses": ("required", {"type": "function", "name": "calc"}),
    "messages": ({"type": "any"}, {"type": "tool", "name": "calc"}),
}


async def ask(http: Any, api: str, sid: str, choice: Any) -> Any:
    question = [{"role": "user", "content": "Weather in Paris?"}]
    if api == "messages":
        client = anthropic.AsyncAnthropic(api_key="x", base_url=f"{BASE}/sessions/{sid}",
                                          http_client=http, max_retries=0)  # fmt: skip
        return await client.messages.create(model="m", max_tokens=256, messages=question,
                                            tools=ANTHROPIC_TOOLS, tool_choice=choice)  # fmt: skip
    client = openai.AsyncOpenAI(api_key="x", base_url=f"{BASE}/sessions/{sid}/v1",
                                http_client=http, max_retries=0)  # fmt: skip
    if api == "chat":
        return await client.chat.completions.create(model="m", messages=question, tools=TOOLS,
                                                    tool_choice=choice)  # fmt: skip
    return await client.responses.create(model="m", input=question, tools=RESPONSES_TOOLS,
                                         tool_choice=choice)  # fmt: skip


def called(api: str, answer: Any) -> list[str]:
    if api == "chat":
        return [c.function.name for c in answer.choices[0].message.tool_calls or []]
    if api == "responses":
        return [i.name for i in answer.output if i.type == "function_call"]
    return [b.name for b in answer.content if b.type == "tool_use"]


@pytest.mark.parametrize("api", list(CHOICES))
@pytest.mark.parametrize(
    ("name", "reply"), [("qwen3", "tool_json_compact"), ("llama3.2", "llama_tool_call")]
)
async def test_required_and_named_reach_the_engine_as_constraints(
    double: EngineDouble, api: str, name: str, reply: str
) -> None:
    model = family(name)
    required, named = CHOICES[api]
    async with serving(model, double) as http:
        for choice, tools in ((required, ["get_weather", "calc"]), (named, ["calc"])):
            double.script(ScriptedCompletion(REPLY[reply].completion(model)))
            answer = await ask(http, api, f"tc-{uuid.uuid4().hex[:8]}", choice)
            assert called(api, answer) == ["get_weather"]  # what the double sampled, parsed
            constraint = double.requests[-1].sampling["structured_outputs"]
            if name == "qwen3":
                tag = json.loads(constraint["structural_tag"])["format"]
                assert tag["type"] == "tags_with_separator" and tag["at_least_one"]
                assert tag["stop_after_first"] == (tools == ["calc"])
                vocab = model.tokenizer.get_vocab()
                for t, tool in zip(tag["tags"], tools, strict=True):
                    # the model's own marker tokens, not their spelling in sub-words
                    assert t["begin"] == {"type": "token", "token": vocab["<tool_call>"]}
                    assert t["end"] == {"type": "token", "token": vocab["</tool_call>"]}
                    head, args, tail = t["content"]["elements"]
                    assert head["value"] == f'\n{{"name": "{tool}", "arguments": '
                    assert args["json_schema"]["type"] == "object"
                    assert tail["value"] == "}\n"
            else:
                schema = constraint["json"]
                options = schema.get("anyOf", [schema])
                assert [o["properties"]["name"]["const"] for o in options] == tools
                assert all(set(o["required"]) == {"name", "parameters"} for o in options)


@pytest.mark.parametrize("api", list(CHOICES))
async def test_auto_carries_no_constraint(double: EngineDouble, api: str) -> None:
    model = family("qwen3")
    auto = {"type": "auto"} if api == "messages" else "auto"
    async with serving(model, double) as http:
        double.script(ScriptedCompletion(REPLY["bpe_split"].completion(model)))
        await ask(http, api, f"auto-{uuid.uuid4().hex[:8]}", auto)
        assert "structured_outputs" not in double.requests[-1].sampling


@pytest.mark.parametrize("api", list(CHOICES))
async def test_unenforceable_choice_is_a_400_and_stores_nothing(
    double: EngineDouble, api: str
) -> None:
    """A template whose call syntax could not be learned (`name(key=value)`, no markers):
    the request is refused naming the family, never sent unconstrained."""
    model = load_model(str(unlearnable_dir()))
    required, _ = CHOICES[api]
    error = anthropic.BadRequestError if api == "messages" else openai.BadRequestError
    async with serving(model, double) as http:
        sid = f"bad-{uuid.uuid4().hex[:8]}"
        before = len(double.requests)
        with pytest.raises(error) as info:
            await ask(http, api, sid, required)
        assert "cannot be enforced" in str(info.value)
        assert len(double.requests) == before
        trajectory = await http.get(f"{BASE}/sessions/{sid}/trajectory")
        assert trajectory.status_code == 404 or not trajectory.json()["branches"]


async def test_named_tool_must_exist(double: EngineDouble) -> None:
    async with serving(family("qwen3"), double) as http:
        with pytest.raises(openai.BadRequestError, match="not among the tools"):
            await ask(http, "chat", "missing", {"type": "function", "function": {"name": "nope"}})


@pytest.fixture(scope="module")
def gemma4() -> ChatModel:
    return load_model(str(gemma4_dir()))


@pytest.fixture(scope="module")
def gemma4_double(gemma4: ChatModel) -> Iterator[EngineDouble]:
    engine = EngineDouble(vocab_size=len(gemma4.tokenizer.get_vocab())).start()
    yield engine
    engine.stop()


@pytest.mark.parametrize("api", list(CHOICES))
async def test_gemma4_required_and_named_are_its_own_call_syntax(
    gemma4_double: EngineDouble, gemma4: ChatModel, api: str
) -> None:
    """Gemma 4 on `auto` (the `gemma4` family): the constraint is a structural tag of its
    `<|tool_call>call:NAME{...}<tool_call|>` blocks (markers as its tokens), and the call it
    forces reaches each API as a call. That vLLM's own xgrammar accepts the template's calls
    under it, and refuses others: tests/integration/test_tool_choice_vllm.py."""
    required, named = CHOICES[api]
    vocab = gemma4.tokenizer.get_vocab()
    call = '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|><|tool_response>'
    async with serving(gemma4, gemma4_double) as http:
        for choice, tools in ((required, ["get_weather", "calc"]), (named, ["calc"])):
            gemma4_double.script(ScriptedCompletion(gemma4.encode(call)))
            answer = await ask(http, api, f"g4-{uuid.uuid4().hex[:8]}", choice)
            assert called(api, answer) == ["get_weather"]
            constraint = gemma4_double.requests[-1].sampling["structured_outputs"]
            tag = json.loads(constraint["structural_tag"])["format"]
            assert tag["type"] == "tags_with_separator" and tag["at_least_one"]
            assert tag["stop_after_first"] == (tools == ["calc"])
            for t, tool in zip(tag["tags"], tools, strict=True):
                assert t["begin"] == {"type": "token", "token": vocab["<|tool_call>"]}
                assert t["end"] == {"type": "token", "token": vocab["<tool_call|>"]}
                head, arguments = t["content"]["elements"]
                assert head == {"type": "const_string", "value": f"call:{tool}"}
                assert arguments["elements"][0] == {"type": "const_string", "value": "{"}


async def test_session_reasoning_ended_reaches_every_turn_unless_the_request_says(
    double: EngineDouble,
) -> None:
    """`POST /sessions {"reasoning_ended": true}`: a harness that cannot add `extra_body` gets
    its constraint applied from the first token; a request's own value still wins."""
    model = family("qwen3")
    async with serving(model, double) as http:
        sid = f"re-{uuid.uuid4().hex[:8]}"
        created = await http.post(f"{BASE}/sessions", json={"id": sid, "reasoning_ended": True})
        assert created.status_code == 201 and created.json()["reasoning_ended"] is True
        for extra, sent in (({}, True), ({"reasoning_ended": False}, False)):
            double.script(ScriptedCompletion(REPLY["tool_json_compact"].completion(model)))
            client = openai.AsyncOpenAI(api_key="x", base_url=f"{BASE}/sessions/{sid}/v1",
                                        http_client=http, max_retries=0)  # fmt: skip
            await client.chat.completions.create(model="m", tools=TOOLS, tool_choice="required",
                messages=[{"role": "user", "content": "Weather in Paris?"}],
                extra_body=extra)  # fmt: skip
            assert double.requests[-1].body.get("reasoning_ended") is sent
        double.script(ScriptedCompletion(REPLY["bpe_split"].completion(model)))
        plain = f"plain-{uuid.uuid4().hex[:8]}"
        await ask(http, "chat", plain, "auto")
        assert "reasoning_ended" not in double.requests[-1].body
