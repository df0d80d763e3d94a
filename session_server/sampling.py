"""The sampling parameters sent to the engine, every one explicit.

vLLM's token-in `/generate` does not merge the model's `generation_config.json` defaults the
way its chat endpoint does, so tokenkeep merges them itself, lowest priority first: the
model's generation config, what the harness sent, server-wide overrides, the session's
overrides (e.g. the trainer's temperature). `max_tokens` is clamped to the context left.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from session_server.conversation import Conversation, ConversationError
from session_server.tool_choice import tool_choice_constraint

if TYPE_CHECKING:
    from session_server.service_config import ServiceConfig
    from session_server.splice import ChatModel

GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")

# vLLM keeps its integer sampling parameters in 64-bit tensors and validates `seed` against
# torch.long, and the engine request is serialised by orjson, which refuses wider integers:
# a value outside this range would fail on every turn that sends it.
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]


class SamplingParams(BaseModel):
    """The sampling parameters tokenkeep passes to the engine (vLLM's names), with vLLM's
    bounds. Every way in goes through `check_sampling`: each API's request, the session's
    overrides at creation, `/inference/v1/generate`'s `sampling_params`. Non-finite floats
    (Python's JSON reads `Infinity`, `NaN` and `1e400`) are refused: serialised for the
    engine they become `null`, a different request from the one made."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1, le=INT64_MAX)
    min_p: float | None = Field(default=None, ge=0, le=1)
    seed: Int64 | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0)
    max_tokens: int | None = Field(default=None, ge=1, le=INT64_MAX)
    min_tokens: int | None = Field(default=None, ge=0, le=INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool | None = None


def check_sampling(
    values: Mapping[str, Any], *, prefix: str = "", names: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """`values` validated as `SamplingParams` (as given, coerced the way the APIs' own
    fields are); a bad one is a `ConversationError` naming it as the caller's API does
    (`prefix` + its name there, `names` mapping vLLM's names to the API's)."""
    try:
        checked = SamplingParams.model_validate(values)
    except ValidationError as exc:
        error = exc.errors()[0]
        key, *rest = [str(part) for part in error["loc"]]
        param = prefix + ".".join([(names or {}).get(key, key), *rest])
        if error["type"] == "extra_forbidden":
            message = f"{param} is not a supported sampling parameter"
        else:
            message = f"{param}: {error['msg']}"
        raise ConversationError(message, param=param) from None
    return checked.model_dump(exclude_none=True)


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
