"""Responses tool types <-> the function tools a chat template renders.

A model's template carries one kind of tool: a named function with a JSON-schema argument.
Codex (and other Responses clients) send more kinds; each is offered under a name the template
can carry and its calls are returned as the item type the client expects:

- `function` -> offered as is; returned as `function_call`.
- `namespace` {name, tools} -> each inner tool offered as `<namespace>__<name>`; a call is
  returned as `function_call` (or `custom_tool_call`) with `name` and `namespace` apart, as the
  Responses API returns namespaced calls.
- `custom` (freeform text, e.g. Codex's `apply_patch`) -> a function with one string argument
  `input`; returned as `custom_tool_call` with `input`.
- `local_shell` -> a function `local_shell` taking `command` (argv), `workdir`, `timeout_ms`;
  returned as `local_shell_call` with an `exec` action.
- hosted tools the server cannot run (`web_search`, `file_search`, `code_interpreter`, ...)
  are accepted and not offered to the model; their call items in `input` are skipped.

Items sent back are mapped to the same offered name and arguments, so the assistant message
a client resends matches the sampled one.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from dataclasses import dataclass
from typing import Any

from session_server.conversation import ConversationError, Tool, ToolCall, parse_arguments

NAMESPACE_SEPARATOR = "__"
LOCAL_SHELL = "local_shell"
_CUSTOM_PARAMETERS = {
    "type": "object",
    "properties": {"input": {"type": "string"}},
    "required": ["input"],
}
_LOCAL_SHELL_PARAMETERS = {
    "type": "object",
    "properties": {
        "command": {"type": "array", "items": {"type": "string"}},
        "workdir": {"type": "string"},
        "timeout_ms": {"type": "integer"},
    },
    "required": ["command"],
}
_LOCAL_SHELL_DESCRIPTION = "Run a command (argv list) in the local shell."


@dataclass(frozen=True, slots=True)
class Offered:
    """What an offered function stands for in the client's tool list."""

    kind: str  # function | custom | local_shell
    name: str
    namespace: str | None = None


def offered_name(name: str, namespace: str | None) -> str:
    return f"{namespace}{NAMESPACE_SEPARATOR}{name}" if namespace else name


class ToolMap:
    """The request's tools: what is offered to the model and how calls map back."""

    def __init__(self, specs: list[dict[str, Any]]) -> None:
        self.tools: list[Tool] = []
        self.offered: dict[str, Offered] = {}
        self.hosted: list[str] = []
        for i, spec in enumerate(specs):
            self._add(spec, f"tools.{i}", None)

    def _add(self, spec: dict[str, Any], param: str, namespace: str | None) -> None:
        kind = spec.get("type")
        name = spec.get("name") or ""
        if kind == "namespace" and namespace is None:
            if not name:
                raise ConversationError("namespace tools need a name", param=f"{param}.name")
            for j, inner in enumerate(spec.get("tools") or []):
                self._add(inner, f"{param}.tools.{j}", name)
            return
        if kind == LOCAL_SHELL and namespace is None:
            self._offer(Offered(LOCAL_SHELL, LOCAL_SHELL), _LOCAL_SHELL_DESCRIPTION,
                        _LOCAL_SHELL_PARAMETERS, param)  # fmt: skip
            return
        if kind not in ("function", "custom"):
            if namespace is not None:
                raise ConversationError(
                    f"tool type {kind!r} cannot be inside a namespace", param=f"{param}.type"
                )
            self.hosted.append(str(kind))  # run by OpenAI's servers, not by a model here
            return
        if not name:
            raise ConversationError(f"{kind} tools need a name", param=f"{param}.name")
        description = spec.get("description") or ""
        if kind == "custom":
            self._offer(Offered("custom", name, namespace), description, _CUSTOM_PARAMETERS, param)
        else:
            parameters = spec.get("parameters") or {}
            self._offer(Offered("function", name, namespace), description, parameters, param)

    def _offer(
        self, target: Offered, description: str, parameters: dict[str, Any], param: str
    ) -> None:
        name = offered_name(target.name, target.namespace)
        if name in self.offered:
            raise ConversationError(f"two tools are offered as {name!r}", param=param)
        self.offered[name] = target
        self.tools.append(Tool(name=name, description=description, parameters=parameters))

    def choice(self, kind: str, name: str, namespace: str | None) -> str:
        """The offered name a `tool_choice` names."""
        offered = offered_name(name, namespace)
        target = self.offered.get(offered)
        if target is None or (target.kind == "custom") != (kind == "custom"):
            raise ConversationError(f"tool_choice names no {kind} tool {name!r}",
                                    param="tool_choice")  # fmt: skip
        return offered

    # --- model's call -> output item ----------------------------------------------------

    def output_item(self, call: ToolCall, status: str = "completed") -> dict[str, Any]:
        target = self.offered.get(call.name, Offered("function", call.name))
        done = status == "completed"
        if target.kind == "custom":
            item: dict[str, Any] = {
                "type": "custom_tool_call", "id": "ctc_" + call.id, "call_id": call.id,
                "name": target.name, "input": _custom_input(call.arguments) if done else "",
                "status": status,
            }  # fmt: skip
        elif target.kind == LOCAL_SHELL:
            return {
                "type": "local_shell_call", "id": "lsc_" + call.id, "call_id": call.id,
                "status": status, "action": _shell_action(call.arguments),
            }  # fmt: skip
        else:
            item = {
                "type": "function_call", "id": "fc_" + call.id, "call_id": call.id,
                "name": target.name, "arguments": call.arguments if done else "",
                "status": status,
            }  # fmt: skip
        if target.namespace:
            item["namespace"] = target.namespace
        return item


def call_from_item(item: Any) -> ToolCall:
    """A resent call item as the tool call the model sampled (offered name, arguments)."""
    namespace = getattr(item, "namespace", None)
    if item.type == "custom_tool_call":
        arguments = json.dumps({"input": item.input}, ensure_ascii=False)
        return ToolCall(id=item.call_id, name=offered_name(item.name, namespace),
                        arguments=arguments)  # fmt: skip
    if item.type == "local_shell_call":
        action = item.action or {}
        arguments_value: dict[str, Any] = {"command": action.get("command") or []}
        if action.get("working_directory") is not None:
            arguments_value["workdir"] = action["working_directory"]
        if action.get("timeout_ms") is not None:
            arguments_value["timeout_ms"] = action["timeout_ms"]
        call_id = item.call_id or item.id or ""
        return ToolCall(id=call_id, name=LOCAL_SHELL, arguments=json.dumps(arguments_value))
    return ToolCall(id=item.call_id, name=offered_name(item.name, namespace),
                    arguments=item.arguments)  # fmt: skip


def _custom_input(arguments: str) -> str:
    value = parse_arguments(arguments)
    if isinstance(value, dict) and isinstance(value.get("input"), str):
        return value["input"]
    return arguments  # not the offered shape: hand the raw text over rather than nothing


def _shell_action(arguments: str) -> dict[str, Any]:
    value = parse_arguments(arguments)
    value = value if isinstance(value, dict) else {}
    command = value.get("command")
    if isinstance(command, str):
        command = [command]
    timeout, workdir = value.get("timeout_ms"), value.get("workdir")
    return {
        "type": "exec",
        "command": [str(part) for part in command] if isinstance(command, list) else [],
        "timeout_ms": timeout if isinstance(timeout, int) else None,
        "working_directory": workdir if isinstance(workdir, str) else None,
        "env": None,
        "user": None,
    }


# --- reasoning items for clients that store nothing ---------------------------------------

_SEAL_VERSION = "tk1"


def seal_reasoning(key: bytes, session_id: str, response_id: str, reasoning: str) -> str:
    """`encrypted_content` for a reasoning item: which stored turn it came from and its text,
    signed (HMAC-SHA256) so that only values this server issued are ever read back."""
    payload = json.dumps({"s": session_id, "r": response_id, "t": reasoning},
                         ensure_ascii=False, separators=(",", ":")).encode()  # fmt: skip
    body = base64.urlsafe_b64encode(payload).decode().rstrip("=")
    return f"{_SEAL_VERSION}.{body}.{_sign(key, body)}"


def open_reasoning(key: bytes, session_id: str, value: str | None) -> str | None:
    """The reasoning text of a value this server sealed for this session; None for anything
    else (tampered, foreign, another session's): the item's own text is used instead."""
    if not value:
        return None
    version, _, rest = value.partition(".")
    body, _, signature = rest.partition(".")
    if version != _SEAL_VERSION or not hmac.compare_digest(signature, _sign(key, body)):
        return None
    try:
        payload = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    except ValueError:
        return None
    if not isinstance(payload, dict) or payload.get("s") != session_id:
        return None
    text = payload.get("t")
    return text if isinstance(text, str) else None


def _sign(key: bytes, body: str) -> str:
    digest = hmac.new(key, body.encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")
