"""A live session server (real port, real Qwen3 tokenizer, engine double) holding a session
worth looking at: a tool call and its result, a retry, a harness rewrite, and markup in both
the harness's messages and the sampled text."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import openai
import pytest

from session_server.app import build_service, create_app
from session_server.settings import Settings
from tests.api.stack import qwen3, reply, tool_call
from tests.engine_double import EngineDouble
from tests.live_server import serving
from tests.real_tokenizers import qwen3_dir

HOSTILE_USER = (
    'Weather in Paris? <script>window.__pwned = "user"</script>'
    "<img src=x onerror=\"window.__pwned = 'img'\">"
)
SAMPLED_ANSWER = ("It is ", "sunny", " <script>window.__pwned = 'sampled'</script>")
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@dataclass(frozen=True)
class Live:
    url: str
    double: EngineDouble


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    double = EngineDouble().start()
    config = Settings(engine_urls=[double.url], model=double.model, tokenizer=str(qwen3_dir()))
    app = create_app(config, build_service(config, model=qwen3()))
    try:
        with serving(app) as url:
            yield Live(url, double)
    finally:
        double.stop()


def drive_rich_session(live: Live, session_id: str) -> None:
    """Four turns through the OpenAI SDK: tool call, answer, a retry of the answer, and a
    request whose history the harness rewrote (a new segment)."""
    client = openai.OpenAI(
        base_url=f"{live.url}/sessions/{session_id}/v1", api_key=f"tk-{session_id}", max_retries=0
    )
    live.double.script(
        tool_call("get_weather", '{"city":"Paris"}', think="Look it up."),
        reply(*SAMPLED_ANSWER),
        reply("Sunny", " and mild."),
        reply("Noted", "."),
    )
    messages: list[dict] = [
        {"role": "system", "content": "You are a weather bot."},
        {"role": "user", "content": HOSTILE_USER},
    ]
    first = client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    call = first.choices[0].message.tool_calls[0]
    messages += [
        {
            "role": "assistant",
            "content": first.choices[0].message.content,
            "tool_calls": [call.model_dump()],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "18C <b>sunny</b>"},
    ]
    answer = client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    client.chat.completions.create(model="m", messages=messages, tools=TOOLS)  # a retry
    rewritten = [
        *messages,
        {"role": "assistant", "content": "It was sunny (edited by the harness)."},
        {"role": "user", "content": "Thanks."},
    ]
    assert answer.choices[0].message.content != rewritten[-2]["content"]
    client.chat.completions.create(model="m", messages=rewritten, tools=TOOLS)
