"""The sampling parameters sent to the engine, every one explicit.

vLLM's token-in `/generate` does not merge the model's `generation_config.json` defaults the
way its chat endpoint does, so tokenkeep merges them itself, lowest priority first: the
model's generation config, what the harness sent, server-wide overrides, the session's
overrides (e.g. the trainer's temperature). `max_tokens` is clamped to the context left.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from session_server.conversation import Conversation, ConversationError
from session_server.tool_choice import tool_choice_constraint

if TYPE_CHECKING:
    from session_server.service_config import ServiceConfig
    from session_server.splice import ChatModel

GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_defaults(model_dir: str | Path) -> dict[str, Any]:
    """The sampling defaults of a model's generation_config.json (empty if none)."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    config = json.loads(path.read_text())
    return {k: config[k] for k in GENERATION_CONFIG_KEYS if config.get(k) is not None}


def build_sampling(
    conversation: Conversation,
    session_overrides: dict[str, Any],
    config: ServiceConfig,
    model: ChatModel,
    *,
    prompt_length: int,
) -> dict[str, Any]:
    params: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0}
    params.update(config.generation_defaults)
    params.update(conversation.sampling)
    params.update(config.sampling_overrides)
    params.update(session_overrides)

    room = config.context_length - prompt_length
    if room <= 0:
        raise ConversationError(
            f"the prompt is {prompt_length} tokens and the model's context is "
            f"{config.context_length}: no room to generate",
            param="messages",
        )
    requested = params.get("max_tokens")
    params["max_tokens"] = room if requested is None else max(1, min(int(requested), room))
    params["n"] = conversation.n
    params["stop_token_ids"] = sorted(
        set(params.get("stop_token_ids") or []) | set(model.stop_token_ids)
    )
    if conversation.response_format:
        params["structured_outputs"] = conversation.response_format
    forced = tool_choice_constraint(model, conversation.tools, conversation.tool_choice)
    if forced is not None:
        if conversation.response_format:
            raise ConversationError(
                "tool_choice required or a named tool cannot be combined with a "
                "structured-output format",
                param="tool_choice",
            )
        params["structured_outputs"] = forced
    return params
