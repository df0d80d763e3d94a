"""SGLang's native wire, as SGLang 0.5.x defines it (read from sgl-project/sglang at 0.5.3:
`python/sglang/srt/managers/io_struct.py` `GenerateReqInput`, `AbortReq`;
`python/sglang/srt/sampling/sampling_params.py` `SamplingParams`;
`python/sglang/srt/entrypoints/http_server.py` `/generate`, `/abort_request`, `/server_info`;
`python/sglang/srt/managers/tokenizer_manager.py` for what a reply holds).

`POST /generate` with `{"input_ids": [...], "sampling_params": {...}, "rid": ..., "stream": bool,
"return_logprob": true, "logprob_start_len": -1, "top_logprobs_num": 0}`. A reply is
`{"text", "output_ids", "meta_info"}` (a list of them, one per sample, for `n > 1`); `meta_info`
has `id` (the sample's rid: `rid` itself, or `rid_0`, `rid_1`... for `n > 1`),
`finish_reason` (`null` until the end, then `{"type": "stop", "matched": id or str}`,
`{"type": "length", "length": n}` or `{"type": "abort", ...}`), `prompt_tokens`,
`completion_tokens`, `cached_tokens`, `output_token_logprobs` (`[logprob, token_id, text]`
triples) and `weight_version` (newer servers: `weight_versions` spans). SGLang does not echo
the prompt's token ids, so the proof that the engine saw the stored prompt is not available.

Streaming (`"stream": true`): SSE `data: {...}` chunks, then `data: [DONE]`; a failure after the
200 is a `data: {"error": {"message": ...}}` line. Each chunk is one sample's reply (with
`"index"` for `n > 1`). Nothing in a chunk says whether `output_ids` (and the logprobs) hold
the whole completion so far (the default) or only what is new (`--incremental-streaming-output`):
the server's `/server_info` does, read with each replica's health check.

`sampling_params` take only SamplingParams' own names (any other key is a 400), and
`max_new_tokens` defaults to 128, so it is always sent, clamped to the context the server reports:
SGLang refuses, rather than clamps, a prompt + `max_new_tokens` over its context length.
A request the client leaves is stopped with `POST /abort_request {"rid": ...}` per sample,
never with `abort_all` (that would cut every other session's generations on the engine).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import httpx

from session_server.engine_wire.base import (
    Call,
    ChunkParser,
    EngineChoice,
    EngineError,
    Generation,
    GenerationDelta,
    Replica,
    Wire,
)
from session_server.store.base import WeightSpan

logger = logging.getLogger(__name__)

GENERATE_PATH = "/generate"
ABORT_PATH = "/abort_request"
# `/server_info` since 0.5; older servers only answer `/get_server_info`.
SERVER_INFO_PATHS = ("/server_info", "/get_server_info")
MODELS_PATH = "/v1/models"
# `{"weight_version": ...}` (http_server.py, 0.5.23; `server_args.weight_version`, which
# `/update_weights_from_disk` and `/update_weight_version` set): what fencing compares.
WEIGHT_VERSION_PATH = "/get_weight_version"

# tokenkeep's merged sampling (vLLM's names) -> SGLang's SamplingParams names. Keys missing
# here and in _DROPPED have no SGLang equivalent and are refused.
_RENAMED = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "n": "n",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "seed": "sampling_seed",
    "min_tokens": "min_new_tokens",
}
# Set by the wire itself (logprobs, special tokens, the stop token kept) or meaningless here.
_DROPPED = frozenset(
    {
        "max_tokens",
        "logprobs",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "include_stop_str_in_output",
        "detokenize",
        "structured_outputs",
        "logit_bias",
    }
)


@dataclass(slots=True)
class _ServerFacts:
    context_length: int | None
    incremental: bool


def _bad_param(name: str, message: str) -> EngineError:
    return EngineError(400, message, "BadRequestError", param=name)


def _structured(constraint: dict[str, Any]) -> dict[str, str]:
    """A vLLM structured-output constraint as SGLang's grammar parameters."""
    if "json" in constraint:
        schema = constraint["json"]
        return {"json_schema": schema if isinstance(schema, str) else json.dumps(schema)}
    if constraint.get("json_object"):
        return {"json_schema": json.dumps({"type": "object"})}
    if "regex" in constraint:
        return {"regex": str(constraint["regex"])}
    if "grammar" in constraint:
        return {"ebnf": str(constraint["grammar"])}
    if "structural_tag" in constraint:
        tag = constraint["structural_tag"]
        return {"structural_tag": tag if isinstance(tag, str) else json.dumps(tag)}
    raise _bad_param(
        "structured_outputs",
        f"structured output {sorted(constraint)} has no SGLang equivalent "
        "(json, json_object, regex, grammar, structural_tag)",
    )


def _finish(reason: Any) -> tuple[str, int | str | None]:
    """SGLang's finish_reason object as (finish_reason, stop_reason) the way vLLM reports them."""
    if not isinstance(reason, dict):
        return "stop", None
    kind = str(reason.get("type") or "stop")
    return kind, reason.get("matched") if kind == "stop" else None


def _logprob_values(entries: list[Any]) -> list[float]:
    return [float(entry[0]) if entry[0] is not None else float("nan") for entry in entries]


def _spans(meta: dict[str, Any], length: int) -> list[WeightSpan]:
    spans = meta.get("weight_versions")
    if isinstance(spans, list) and spans and all(isinstance(s, dict) for s in spans):
        return [WeightSpan(str(s["version"]), int(s["start"]), int(s["end"])) for s in spans]
    version = meta.get("weight_version")
    return [WeightSpan(str(version), 0, length)] if version is not None and length else []


class SglangWire(Wire):
    kind = "sglang"
    # No echo of the prompt (so no proof that the engine got the spliced tokens), no routes
    # (SGLang sends them as raw bytes without a shape), no images, no reasoning_ended.
    lacks = ("prompt_echo", "routed_experts", "images", "reasoning_ended")

    def __init__(self, model: str):
        super().__init__(model)
        self._facts: dict[str, _ServerFacts] = {}

    def request(self, replica: Replica, call: Call, request_id: str) -> tuple[str, dict[str, Any]]:
        if call.images:
            raise EngineError(
                400,
                "images are not supported with --engine sglang (SGLang expands images itself)",
                "BadRequestError",
                param="messages",
            )
        params: dict[str, Any] = {}
        for key, value in call.sampling.items():
            if key in _RENAMED:
                params[_RENAMED[key]] = value
            elif key not in _DROPPED:
                raise _bad_param(key, f"sampling parameter {key!r} has no SGLang equivalent")
        if (constraint := call.sampling.get("structured_outputs")) is not None:
            params.update(_structured(constraint))
        if logit_bias := call.sampling.get("logit_bias"):
            params["logit_bias"] = {str(k): v for k, v in logit_bias.items()}
        params["max_new_tokens"] = self._max_new_tokens(replica, call)
        # Token ids are what is stored: the text SGLang decodes must not hide special tokens,
        # and the matched stop token must stay in output_ids (SGLang trims it by default).
        params["skip_special_tokens"] = False
        params["no_stop_trim"] = True
        return GENERATE_PATH, {
            "input_ids": call.prompt_ids,
            "sampling_params": params,
            "rid": request_id,
            "stream": call.stream,
            "return_logprob": True,
            "logprob_start_len": -1,
            "top_logprobs_num": 0,
        }

    def _max_new_tokens(self, replica: Replica, call: Call) -> int:
        requested = call.sampling.get("max_tokens")
        facts = self._facts.get(replica.url)
        context = facts.context_length if facts is not None else None
        if context is None:
            if requested is None:  # SGLang would stop at 128
                raise _bad_param("max_tokens", "max_tokens is required with --engine sglang")
            return int(requested)
        room = context - len(call.prompt_ids)
        if room <= 0:
            raise _bad_param(
                "messages",
                f"the prompt is {len(call.prompt_ids)} tokens and the engine's context is "
                f"{context}: no room to generate",
            )
        return room if requested is None else max(1, min(int(requested), room))

    def parse(self, payload: Any, replica: Replica) -> Generation:
        samples = payload if isinstance(payload, list) else [payload]
        choices = []
        cached = None
        for index, sample in enumerate(samples):
            meta = sample.get("meta_info") or {}
            tokens = list(sample.get("output_ids") or [])
            reason, stop_reason = _finish(meta.get("finish_reason"))
            choices.append(
                EngineChoice(
                    index=index,
                    token_ids=tokens,
                    logprobs=_logprob_values(meta.get("output_token_logprobs") or []),
                    finish_reason=reason,
                    stop_reason=stop_reason,
                    weight_versions=_spans(meta, len(tokens)),
                )
            )
            if isinstance(meta.get("cached_tokens"), int):
                cached = meta["cached_tokens"]
        return Generation(None, choices, replica.url, 0.0, cached)

    def stream_parser(self, replica: Replica, call: Call) -> ChunkParser:
        facts = self._facts.get(replica.url)
        return _StreamParser(incremental=facts is not None and facts.incremental).feed

    async def probe(
        self, http: httpx.AsyncClient, replica: Replica, timeout: httpx.Timeout
    ) -> None:
        # Every health round, not once: a replica restarted with other flags (streaming mode,
        # context length) must not be read with the old ones. A failed read keeps the last.
        info: dict[str, Any] | None = None
        for path in SERVER_INFO_PATHS:
            info = await _get_json(http, replica.url + path, timeout)
            if info is not None:
                break
        if info is None:
            logger.warning("engine %s answers no %s", replica.url, " or ".join(SERVER_INFO_PATHS))
            return
        models = await _get_json(http, replica.url + MODELS_PATH, timeout) or {}
        served = [m for m in models.get("data") or () if isinstance(m, dict)]
        context = next((m["max_model_len"] for m in served if m.get("max_model_len")), None)
        context = context or info.get("context_length")
        self._facts[replica.url] = _ServerFacts(
            int(context) if context else None, bool(info.get("incremental_streaming_output"))
        )
        # The served policy version, read every round so that a replica restarted on its
        # base weights (SGLang starts at "default") is fenced and caught up
        # (policy/fleet.py `_follow_one`). `/get_server_info` holds the server arguments,
        # `weight_version` among them; `/get_weight_version` where it does not.
        version = info.get("weight_version")
        if version is None:
            answer = await _get_json(http, replica.url + WEIGHT_VERSION_PATH, timeout) or {}
            version = answer.get("weight_version")
        if version is not None:
            replica.weight_version = str(version)

    def aborts(self, request_id: str, call: Call) -> list[tuple[str, dict[str, Any]]]:
        n = int(call.sampling.get("n") or 1)
        rids = [request_id] if n == 1 else [f"{request_id}_{i}" for i in range(n)]
        return [(ABORT_PATH, {"rid": rid}) for rid in rids]


async def _get_json(http: httpx.AsyncClient, url: str, timeout: httpx.Timeout) -> Any:
    try:
        response = await http.get(url, timeout=timeout)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    try:
        payload = response.json()
    except ValueError:
        return None
    return payload if isinstance(payload, dict) else None


class _StreamParser:
    """One stream's chunks as deltas. Cumulative chunks repeat every token so far: only those
    past what was already passed on are new. The logprobs are taken by the same rule from their
    own length, which tells the two modes apart on their own."""

    def __init__(self, *, incremental: bool):
        self.incremental = incremental
        self.seen: dict[int, int] = {}

    def feed(self, chunk: dict[str, Any]) -> tuple[list[int] | None, list[GenerationDelta]]:
        index = int(chunk.get("index") or 0)
        meta = chunk.get("meta_info") or {}
        seen = self.seen.get(index, 0)
        ids = list(chunk.get("output_ids") or [])
        new = ids if self.incremental else ids[seen:]
        entries = meta.get("output_token_logprobs") or []
        logprobs = _logprob_values(entries[seen:] if len(entries) > len(new) else entries)
        total = self.seen[index] = seen + len(new)
        reason = meta.get("finish_reason")
        finished = reason is not None
        finish_reason, stop_reason = _finish(reason) if finished else (None, None)
        cached = meta.get("cached_tokens") if finished else None
        return None, [
            GenerationDelta(
                index=index,
                token_ids=new,
                logprobs=logprobs,
                finish_reason=finish_reason,
                stop_reason=stop_reason,
                weight_versions=_spans(meta, total) or None if finished else None,
                cached_tokens=cached if isinstance(cached, int) else None,
            )
        ]


__all__ = ["ABORT_PATH", "GENERATE_PATH", "SglangWire"]
