"""The harnesses: one per API, each echoing replies the way its SDK users do."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import httpx

from session_server.check.scenarios import CHECK_MODEL, TOOL


@dataclass(slots=True)
class Echo:
    """A reply as the harness keeps it: its API's own shape and the chat-message form."""

    chat: dict[str, Any]
    call_ids: list[str]


class Harness:
    api = ""
    path = ""

    def __init__(self, tools: bool, strip: bool) -> None:
        self.tools = tools
        self.strip = strip
        self.history: list[Any] = []

    def add_user(self, text: str) -> None:
        self.history.append({"role": "user", "content": text})

    def add_tool_result(self, call_id: str, text: str) -> None:
        raise NotImplementedError

    def body(self, stream: bool) -> dict[str, Any]:
        raise NotImplementedError

    def reply(self, response: httpx.Response, stream: bool) -> Echo:
        raise NotImplementedError

    def _content(self, text: str | None) -> str:
        text = text or ""
        return text.strip() if self.strip else text


class ChatHarness(Harness):
    """OpenAI SDK habit: content and tool calls echoed; reasoning dropped (no field for it)."""

    api = "chat"
    path = "/v1/chat/completions"

    def add_tool_result(self, call_id: str, text: str) -> None:
        self.history.append({"role": "tool", "tool_call_id": call_id, "content": text})

    def body(self, stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"model": CHECK_MODEL, "messages": self.history, "stream": stream}
        if self.tools:
            body["tools"] = [{"type": "function", "function": TOOL}]
        return body

    def reply(self, response: httpx.Response, stream: bool) -> Echo:
        if stream:
            content, calls = "", {}
            for event in _sse(response.text):
                delta = (event.get("choices") or [{}])[0].get("delta") or {}
                content += delta.get("content") or ""
                for call in delta.get("tool_calls") or []:
                    entry = calls.setdefault(call["index"], {"id": "", "name": "", "arguments": ""})
                    entry["id"] = call.get("id") or entry["id"]
                    function = call.get("function") or {}
                    entry["name"] += function.get("name") or ""
                    entry["arguments"] += function.get("arguments") or ""
            tool_calls = [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {"name": c["name"], "arguments": c["arguments"]},
                }
                for _, c in sorted(calls.items())
            ]
        else:
            message = response.json()["choices"][0]["message"]
            content = message.get("content") or ""
            tool_calls = [
                {"id": c["id"], "type": "function", "function": dict(c["function"])}
                for c in message.get("tool_calls") or []
            ]
        echo: dict[str, Any] = {"role": "assistant", "content": self._content(content)}
        if tool_calls:
            echo["tool_calls"] = tool_calls
        self.history.append(echo)
        return Echo(echo, [c["id"] for c in tool_calls])


class ResponsesHarness(Harness):
    """Responses SDK habit: the output items (reasoning included) go back as input."""

    api = "responses"
    path = "/v1/responses"

    def add_tool_result(self, call_id: str, text: str) -> None:
        self.history.append({"type": "function_call_output", "call_id": call_id, "output": text})

    def body(self, stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"model": CHECK_MODEL, "input": self.history, "stream": stream}
        if self.tools:
            body["tools"] = [{"type": "function", **TOOL}]
        return body

    def reply(self, response: httpx.Response, stream: bool) -> Echo:
        if stream:
            output = next(
                e["response"]["output"]
                for e in _sse(response.text)
                if e.get("type") in _RESPONSE_DONE
            )
        else:
            output = response.json()["output"]
        chat: dict[str, Any] = {"role": "assistant", "content": ""}
        calls: list[dict[str, Any]] = []
        for item in output:
            if item["type"] == "reasoning":
                chat["reasoning_content"] = "".join(p["text"] for p in item.get("content") or [])
            elif item["type"] == "message":
                for part in item["content"]:
                    part["text"] = self._content(part.get("text"))
                chat["content"] = "".join(p["text"] for p in item["content"])
            elif item["type"] == "function_call":
                calls.append(
                    {
                        "id": item["call_id"],
                        "type": "function",
                        "function": {"name": item["name"], "arguments": item["arguments"]},
                    }
                )
            self.history.append(item)
        if calls:
            chat["tool_calls"] = calls
        return Echo(chat, [c["id"] for c in calls])


class MessagesHarness(Harness):
    """Anthropic SDK habit: the content blocks (thinking with its signature) go back."""

    api = "messages"
    path = "/v1/messages"

    def add_tool_result(self, call_id: str, text: str) -> None:
        block = {"type": "tool_result", "tool_use_id": call_id, "content": text}
        self.history.append({"role": "user", "content": [block]})

    def body(self, stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": CHECK_MODEL,
            "max_tokens": 1024,
            "messages": self.history,
            "stream": stream,
        }
        if self.tools:
            body["tools"] = [
                {
                    "name": TOOL["name"],
                    "description": TOOL["description"],
                    "input_schema": TOOL["parameters"],
                }
            ]
        return body

    def reply(self, response: httpx.Response, stream: bool) -> Echo:
        blocks = _message_blocks(response.text) if stream else response.json()["content"]
        chat: dict[str, Any] = {"role": "assistant", "content": ""}
        calls: list[dict[str, Any]] = []
        for block in blocks:
            if block["type"] == "thinking":
                chat["reasoning_content"] = block["thinking"]
            elif block["type"] == "text":
                block["text"] = self._content(block["text"])
                chat["content"] += block["text"]
            elif block["type"] == "tool_use":
                arguments = json.dumps(block["input"], ensure_ascii=False)
                calls.append(
                    {
                        "id": block["id"],
                        "type": "function",
                        "function": {"name": block["name"], "arguments": arguments},
                    }
                )
        self.history.append({"role": "assistant", "content": blocks})
        if calls:
            chat["tool_calls"] = calls
        return Echo(chat, [c["id"] for c in calls])


_RESPONSE_DONE = ("response.completed", "response.incomplete")
HARNESSES: dict[str, type[Harness]] = {
    h.api: h for h in (ChatHarness, ResponsesHarness, MessagesHarness)
}


def _sse(text: str) -> Iterable[dict[str, Any]]:
    for line in text.splitlines():
        if line.startswith("data:"):
            data = line[5:].strip()
            if data and data != "[DONE]":
                yield json.loads(data)


def _message_blocks(text: str) -> list[dict[str, Any]]:
    blocks: dict[int, dict[str, Any]] = {}
    partial: dict[int, str] = {}
    for event in _sse(text):
        kind = event.get("type")
        if kind == "content_block_start":
            blocks[event["index"]] = dict(event["content_block"])
        elif kind == "content_block_delta":
            block, delta = blocks[event["index"]], event["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "signature_delta":
                block["signature"] = delta["signature"]
            elif delta["type"] == "input_json_delta":
                partial[event["index"]] = partial.get(event["index"], "") + delta["partial_json"]
    for index, raw in partial.items():
        blocks[index]["input"] = json.loads(raw) if raw else {}
    return [blocks[i] for i in sorted(blocks)]
