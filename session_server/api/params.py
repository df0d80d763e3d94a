"""Sampling parameters that OpenAI-style request bodies share, under vLLM's names."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

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
