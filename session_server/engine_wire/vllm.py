"""vLLM's token wire (vLLM 0.32, `--enable-scale-out`).

`POST /inference/v1/generate` with `{"token_ids": [...], "sampling_params": {...},
"return_token_ids": true, "stream": bool, "model": ..., "request_id": ...}`. The answer carries
per choice `token_ids`, `finish_reason`, `stop_reason` and, with `sampling_params.logprobs =
0`, the sampled token's logprob at `choices[i].logprobs.content[j].logprob`;
`prompt_token_ids` at the top (streaming: in the first chunk only); per choice
`weight_versions: [{"version", "start", "end"}]`, the policy version that sampled each span of
the completion (streaming: in the choice's last chunk); with `--enable-return-routed-experts`,
per finished choice `routed_experts`: base64 of `.npy` bytes, (positions, layers, top_k), from
`sampling_params.routed_experts_prompt_start` to the last token but one.
Streaming sends one SSE `data:` chunk per engine step and choice, ends with `data: [DONE]`, and
reports a failure after the 200 as a `data: {"error": {...}}` line. Engines without the
endpoint get the same request as `/v1/completions` on a token-ID prompt. Closing a stream's
connection aborts its request.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import io
import logging
from typing import Any

import httpx
import numpy as np
import orjson

from session_server.engine_wire.base import (
    Call,
    ChunkParser,
    EngineChoice,
    EngineError,
    Generation,
    GenerationDelta,
    Protocol,
    Replica,
    Wire,
)
from session_server.images import content_parts
from session_server.store.base import WeightSpan

logger = logging.getLogger(__name__)

GENERATE_PATH = "/inference/v1/generate"
COMPLETIONS_PATH = "/v1/completions"
# vLLM answers it in dev mode (VLLM_SERVER_DEV_MODE=1): {"weight_version": "..."}.
WEIGHT_INFO_PATH = "/weight_info"


def _is_missing_route(error: EngineError) -> bool:
    # A 404 for the path itself (endpoint not enabled) says "Not Found"; a 404 for an unknown
    # model names the model, and must not switch the replica to the fallback.
    return error.status == 404 and error.message.strip() == "Not Found"


class VllmWire(Wire):
    kind = "vllm"

    def request(self, replica: Replica, call: Call, request_id: str) -> tuple[str, dict[str, Any]]:
        params = dict(call.sampling)
        if params.get("logprobs") is None:
            params["logprobs"] = 0  # the sampled token's logprob, no alternatives
        prompt: Any = orjson.Fragment(call.prompt_json) if call.prompt_json else call.prompt_ids
        if replica.protocol is Protocol.GENERATE:
            body = {
                "request_id": request_id,
                "model": self.model,
                "token_ids": prompt,
                "sampling_params": params,
                "return_token_ids": True,
                "stream": call.stream,
            }
            if call.stream:  # the last chunk then reports the prefix-cache hits
                body["stream_options"] = {"include_usage": True}
            if call.reasoning_ended is not None:
                body["reasoning_ended"] = call.reasoning_ended
            if call.images:
                body["content_parts"] = content_parts(list(call.images))
            return GENERATE_PATH, body
        if call.images:
            # /v1/completions takes a token prompt but drops images without a word.
            raise EngineError(
                502,
                f"engine {replica.url} has no token-in endpoint (/inference/v1/generate), "
                "and its /v1/completions ignores images; start vLLM with --enable-scale-out",
                "EngineProtocolError",
            )
        return COMPLETIONS_PATH, {
            **params,
            "request_id": request_id,
            "model": self.model,
            "prompt": prompt,
            "return_token_ids": True,
            "stream": call.stream,
        }

    def fallback(self, replica: Replica, error: EngineError) -> bool:
        if _is_missing_route(error) and replica.protocol is Protocol.GENERATE:
            logger.warning(
                "engine %s has no %s; using %s", replica.url, GENERATE_PATH, COMPLETIONS_PATH
            )
            replica.protocol = Protocol.COMPLETIONS
            return True
        return False

    def echo_check(self, replica: Replica, call: Call) -> Call | None:
        # /generate echoes the prompt at the top level; the completions fallback per choice.
        return call if replica.protocol is Protocol.GENERATE and call.prompt_json else None

    def parse(self, payload: Any, replica: Replica) -> Generation:
        if replica.protocol is Protocol.GENERATE:
            return _parse_generate(payload, replica.url)
        return _parse_completions(payload, replica.url)

    def stream_parser(self, replica: Replica, call: Call) -> ChunkParser:
        if replica.protocol is Protocol.GENERATE:
            return _deltas_from_generate_chunk
        return _deltas_from_completions_chunk

    async def probe(
        self, http: httpx.AsyncClient, replica: Replica, timeout: httpx.Timeout
    ) -> None:
        if not replica.weight_info:
            return
        try:
            response = await http.get(replica.url + WEIGHT_INFO_PATH, timeout=timeout)
        except httpx.HTTPError:
            return
        version = None
        if response.status_code == 200:
            with contextlib.suppress(ValueError, AttributeError):
                version = response.json().get("weight_version")
        if version is None:
            replica.weight_info = False
            return
        replica.weight_version = str(version)


def _generate_logprobs(choice: dict[str, Any]) -> list[float]:
    logprobs = choice.get("logprobs") or {}
    return [entry["logprob"] for entry in logprobs.get("content") or ()]


def _completions_logprobs(choice: dict[str, Any]) -> list[float]:
    logprobs = choice.get("logprobs") or {}
    return [lp if lp is not None else float("nan") for lp in logprobs.get("token_logprobs") or ()]


def _weight_spans(choice: dict[str, Any]) -> list[WeightSpan] | None:
    spans = choice.get("weight_versions")
    if not spans:
        return None
    return [WeightSpan(str(s["version"]), int(s["start"]), int(s["end"])) for s in spans]


def _routes(choice: dict[str, Any]) -> np.ndarray | None:
    encoded = choice.get("routed_experts")
    if not encoded:
        return None
    try:
        experts = np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False)
    except (ValueError, binascii.Error, OSError):
        logger.warning("engine sent routed_experts that are not base64 .npy; ignored")
        return None
    return experts if experts.ndim == 3 else None


def _parse_generate(payload: dict[str, Any], url: str) -> Generation:
    choices = [
        EngineChoice(
            index=c["index"],
            token_ids=c.get("token_ids") or [],
            logprobs=_generate_logprobs(c),
            finish_reason=c.get("finish_reason") or "stop",
            stop_reason=c.get("stop_reason"),
            weight_versions=_weight_spans(c) or [],
            routed_experts=_routes(c),
        )
        for c in payload.get("choices", ())
    ]
    choices.sort(key=lambda c: c.index)
    return Generation(payload.get("prompt_token_ids"), choices, url, 0.0, _cached_tokens(payload))


def _cached_tokens(payload: dict[str, Any]) -> int | None:
    details = (payload.get("usage") or {}).get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    return cached if isinstance(cached, int) else None


def _parse_completions(payload: dict[str, Any], url: str) -> Generation:
    raw = payload.get("choices", ())
    choices = [
        EngineChoice(
            index=c["index"],
            token_ids=c.get("token_ids") or [],
            logprobs=_completions_logprobs(c),
            finish_reason=c.get("finish_reason") or "stop",
            stop_reason=c.get("stop_reason"),
        )
        for c in raw
    ]
    choices.sort(key=lambda c: c.index)
    prompt_ids = next((c["prompt_token_ids"] for c in raw if c.get("prompt_token_ids")), None)
    return Generation(prompt_ids, choices, url, 0.0, _cached_tokens(payload))


def _deltas_from_generate_chunk(
    chunk: dict[str, Any],
) -> tuple[list[int] | None, list[GenerationDelta]]:
    cached = _cached_tokens(chunk)
    if cached is not None:  # the usage chunk (no choices)
        return chunk.get("prompt_token_ids"), [
            GenerationDelta(0, [], [], None, None, cached_tokens=cached)
        ]
    return chunk.get("prompt_token_ids"), [
        GenerationDelta(
            index=c["index"],
            token_ids=c.get("token_ids") or [],
            logprobs=_generate_logprobs(c),
            finish_reason=c.get("finish_reason"),
            stop_reason=c.get("stop_reason"),
            weight_versions=_weight_spans(c),
            routed_experts=_routes(c),
        )
        for c in chunk.get("choices", ())
    ]


def _deltas_from_completions_chunk(
    chunk: dict[str, Any],
) -> tuple[list[int] | None, list[GenerationDelta]]:
    raw = chunk.get("choices", ())
    prompt_ids = next((c["prompt_token_ids"] for c in raw if c.get("prompt_token_ids")), None)
    return prompt_ids, [
        GenerationDelta(
            index=c["index"],
            token_ids=c.get("token_ids") or [],
            logprobs=_completions_logprobs(c),
            finish_reason=c.get("finish_reason"),
            stop_reason=c.get("stop_reason"),
        )
        for c in raw
    ]


__all__ = ["COMPLETIONS_PATH", "GENERATE_PATH", "WEIGHT_INFO_PATH", "VllmWire"]
