"""Sampling parameters that OpenAI-style request bodies share, under vLLM's names."""

from __future__ import annotations

from typing import Annotated, Any

import orjson
from pydantic import AfterValidator, BaseModel

from session_server.conversation import too_deep
from session_server.sampling import check_sampling

SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


def explicit_sampling(
    body: BaseModel, max_tokens: int | None, *, max_tokens_name: str = "max_tokens"
) -> dict[str, Any]:
    """The sampling parameters the client set (unset ones are left to the core's merge),
    checked against the engine's bounds."""
    sampling = {key: getattr(body, key) for key in SAMPLING_FIELDS}
    sampling = {key: value for key, value in sampling.items() if value is not None}
    if max_tokens is not None:
        sampling["max_tokens"] = max_tokens
    stop = getattr(body, "stop", None)
    if stop:
        sampling["stop"] = [stop] if isinstance(stop, str) else list(stop)
    return check_sampling(sampling, names={"max_tokens": max_tokens_name})


MAX_TEMPLATE_KWARGS_BYTES = 8192
"""Largest `chat_template_kwargs` (as JSON) accepted: flags like `enable_thinking` are a
few bytes; the bound keeps a session default small in every stored session record."""
RENDER_ARGUMENTS = frozenset(
    {
        "chat_template",
        "tokenize",
        "conversation",
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "return_dict",
        "return_tensors",
        "return_assistant_tokens_mask",
        "padding",
        "truncation",
        "max_length",
        "tokenizer_kwargs",
    }
)
"""`apply_chat_template`'s own arguments: tokenkeep sets them to render the exact prompt it
stores and proves, so a request cannot (vLLM refuses `chat_template` and `tokenize` too)."""


def _template_kwargs(value: dict[str, Any]) -> dict[str, Any]:
    taken = sorted(RENDER_ARGUMENTS & value.keys())
    if taken:
        raise ValueError(f"sets what tokenkeep renders with: {', '.join(taken)}")
    if too_deep(value):
        raise ValueError("nests too deep")
    if len(orjson.dumps(value)) > MAX_TEMPLATE_KWARGS_BYTES:
        raise ValueError(f"is larger than {MAX_TEMPLATE_KWARGS_BYTES} bytes of JSON")
    return value


TemplateKwargs = Annotated[dict[str, Any], AfterValidator(_template_kwargs)]
"""vLLM's `chat_template_kwargs`: variables the chat template reads (`enable_thinking`),
JSON values only, bounded in size."""
