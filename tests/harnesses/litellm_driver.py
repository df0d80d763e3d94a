"""A LiteLLM tool loop against a session URL, run inside LiteLLM's own virtualenv (LiteLLM
pins `openai<3`, the test environment has `openai>=3`): the model calls `get_weather`, the
result goes back, the model answers. Prints the final answer as JSON.

    python litellm_driver.py BASE_URL chat|chat-stream|responses|responses-stream
"""

from __future__ import annotations

import json
import sys
from typing import Any

import litellm

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
MODEL = "openai/tiny"


def chat(base: str, stream: bool) -> str:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
    for _ in range(2):
        kwargs = {"model": MODEL, "api_base": base, "api_key": "tk", "tools": [TOOL]}
        if stream:
            chunks = list(litellm.completion(messages=messages, stream=True, **kwargs))
            message = litellm.stream_chunk_builder(chunks, messages=messages).choices[0].message
        else:
            message = litellm.completion(messages=messages, **kwargs).choices[0].message
        if not message.tool_calls:
            return message.content
        messages.append(
            {
                "role": "assistant",
                "content": message.content,
                "tool_calls": [
                    {"id": c.id, "type": "function",
                     "function": {"name": c.function.name, "arguments": c.function.arguments}}
                    for c in message.tool_calls
                ],
            }
        )  # fmt: skip
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "18C, sunny"})
    raise SystemExit("no final answer")


def responses(base: str, stream: bool) -> str:
    tool = {"type": "function", **TOOL["function"]}
    items: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    previous = None
    for _ in range(2):
        kwargs = {"model": MODEL, "api_base": base, "api_key": "tk", "tools": [tool]}
        if previous:
            kwargs["previous_response_id"] = previous
        if stream:
            response = None
            for event in litellm.responses(input=items, stream=True, **kwargs):
                if getattr(event, "type", "") == "response.completed":
                    response = event.response
            assert response is not None
        else:
            response = litellm.responses(input=items, **kwargs)
        calls = [o for o in response.output if getattr(o, "type", "") == "function_call"]
        if not calls:
            return "".join(
                part.text
                for o in response.output if getattr(o, "type", "") == "message"
                for part in o.content
            )  # fmt: skip
        previous = response.id
        items = [{"type": "function_call_output", "call_id": c.call_id, "output": "18C, sunny"}
                 for c in calls]  # fmt: skip
    raise SystemExit("no final answer")


if __name__ == "__main__":
    base_url, mode = sys.argv[1], sys.argv[2]
    run = chat if mode.startswith("chat") else responses
    print(json.dumps({"answer": run(base_url, mode.endswith("-stream"))}))
