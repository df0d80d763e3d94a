"""A TEST DOUBLE of an SGLang 0.5.x server's native API, built from SGLang's own source (no SGLang
CPU build is available here: its `sgl-kernel` CPU wheel is not on PyPI), at sgl-project/sglang
0.5.3. Read there: `sampling_params.py`, `io_struct.py` (rid handling) and `tokenizer_manager.py`
(streaming modes, logprob fields); the HTTP routes below were checked against `http_server.py`
at commit 0025436 (where `/health` is `/health_generate` and `/server_info` is not served):
- `python/sglang/srt/entrypoints/http_server.py`: `POST /generate` (a JSON reply, or SSE
  `data: {...}` chunks then `data: [DONE]`, a failure inside the stream as a
  `data: {"error": {"message": ...}}` line), `POST /abort_request` (`AbortReq`: `rid`,
  `abort_all`), `GET /health`, `/health_generate`, `/get_model_info`, `/server_info` (and its
  older name `/get_server_info`: the server arguments, `context_length` and
  `incremental_streaming_output` among them), `GET /v1/models` (`max_model_len`);
- `python/sglang/srt/managers/io_struct.py` `GenerateReqInput`: `input_ids`, `sampling_params`,
  `rid` (for `n > 1`, a string rid becomes `rid_0`, `rid_1`, ... one per sample: each is that
  sample's `meta_info.id`), `stream`, `return_logprob`, `logprob_start_len`,
  `top_logprobs_num`;
- `python/sglang/srt/sampling/sampling_params.py` `SamplingParams`: the only accepted
  `sampling_params` keys (any other key is a 400 here), `max_new_tokens` defaulting to 128,
  `no_stop_trim` (False: the matched stop token is trimmed from `output_ids`, not from the
  logprobs);
- `python/sglang/srt/managers/tokenizer_manager.py`: a reply is `{"text", "output_ids",
  "meta_info"}`, a list of them for `n > 1` (streamed: one chunk per sample with `"index"`);
  `meta_info` holds `id`, `finish_reason` (`null`, `{"type": "stop", "matched": ...}`,
  `{"type": "length", "length": n}`, `{"type": "abort", "message": ...}`), `prompt_tokens`,
  `completion_tokens`, `cached_tokens`, `output_token_logprobs` (`[logprob, token_id, text]`,
  text null unless `return_text_in_logprobs`) and `weight_version`; streamed `output_ids` and
  logprobs hold the whole completion so far, or with `--incremental-streaming-output`
  (`incremental=True` here) only what is new; a prompt whose length plus `max_new_tokens`
  exceeds the context is refused with a 400 (the server does not clamp).
The prompt's token ids are never echoed.

It reuses `EngineDouble`'s scripting (`script`, `default`), its recorded requests and samples,
`latency_s`, `chunk_delay_s` and its stream accounting; `aborted` lists every rid
`/abort_request` was asked to stop (and `abort_all` requests, as "*").
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tests.engine_double import (
    EngineDouble,
    RecordedRequest,
    ScriptedCompletion,
    _interleaved,
    _sse,
)

GENERATE_PATH = "/generate"
ABORT_PATH = "/abort_request"
DEFAULT_MAX_NEW_TOKENS = 128
SAMPLING_PARAMS = frozenset(
    {
        "max_new_tokens",
        "stop",
        "stop_token_ids",
        "stop_regex",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "min_new_tokens",
        "n",
        "json_schema",
        "regex",
        "ebnf",
        "structural_tag",
        "ignore_eos",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "no_stop_trim",
        "custom_params",
        "stream_interval",
        "logit_bias",
        "sampling_seed",
    }
)


class SglangRequest(RecordedRequest):
    @property
    def prompt_ids(self) -> list[int]:
        return list(self.body.get("input_ids", []))

    @property
    def sampling(self) -> dict[str, Any]:
        return dict(self.body.get("sampling_params") or {})


def _error(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


def _finish_reason(completion: ScriptedCompletion) -> dict[str, Any]:
    if completion.finish_reason == "length":
        return {"type": "length", "length": len(completion.token_ids)}
    if completion.finish_reason == "abort":
        return {"type": "abort", "message": "Abort before prefill"}
    matched = completion.stop_reason
    if matched is None and completion.token_ids:
        matched = completion.token_ids[-1]  # an EOS / stop-token match reports the token
    return {"type": "stop", "matched": matched}


@dataclass
class SglangDouble(EngineDouble):
    """See the module docstring."""

    model: str = "tokenkeep-tiny-qwen3"
    incremental: bool = False
    """Answer like a server started with --incremental-streaming-output."""
    aborted: list[str] = field(default_factory=list)
    recorded = SglangRequest

    def reset(self) -> None:
        super().reset()
        with self._lock:
            self.incremental = False
            self.aborted.clear()

    def _app(self) -> Starlette:
        return Starlette(
            routes=[
                Route(GENERATE_PATH, self._sglang_generate, methods=["POST", "PUT"]),
                Route(ABORT_PATH, self._abort_request, methods=["POST", "PUT"]),
                Route("/health", self._health, methods=["GET"]),
                Route("/health_generate", self._health, methods=["GET"]),
                Route("/get_model_info", self._model_info, methods=["GET"]),
                Route("/server_info", self._server_info, methods=["GET"]),
                Route("/get_server_info", self._server_info, methods=["GET"]),
                Route("/v1/models", self._sglang_models, methods=["GET"]),
            ]
        )

    async def _model_info(self, _request: Request) -> Response:
        return JSONResponse(
            {
                "model_path": self.model,
                "tokenizer_path": self.model,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.weight_version,
            }
        )

    async def _server_info(self, _request: Request) -> Response:
        return JSONResponse(
            {
                "model_path": self.model,
                "served_model_name": self.model,
                "context_length": self.max_model_len,
                "incremental_streaming_output": self.incremental,
                "skip_tokenizer_init": False,
                "weight_version": self.weight_version,
                "version": "0.5.3",
            }
        )

    async def _sglang_models(self, _request: Request) -> Response:
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.model,
                        "object": "model",
                        "created": 0,
                        "owned_by": "sglang",
                        "root": self.model,
                        "max_model_len": self.max_model_len,
                    }
                ],
            }
        )

    async def _abort_request(self, request: Request) -> Response:
        body = json.loads(await request.body() or b"{}")
        with self._lock:
            self.aborted.append("*" if body.get("abort_all") else str(body.get("rid", "")))
        return Response(status_code=200)

    def _refusal(self, prompt: Any, sampling: dict[str, Any]) -> str | None:
        """SGLang's validation, in its order: the request's shape, SamplingParams, the
        context length."""
        if (
            not isinstance(prompt, list)
            or not prompt
            or not all(isinstance(t, int) for t in prompt)
        ):
            return "input_ids must be a non-empty list of token ids"
        unknown = sorted(set(sampling) - SAMPLING_PARAMS)
        if unknown:
            return f"SamplingParams.__init__() got an unexpected keyword argument '{unknown[0]}'"
        for token_id in prompt:
            if not 0 <= token_id < self.vocab_size:
                return f"The input_ids {token_id} is out of vocabulary"
        if len(prompt) >= self.max_model_len:
            return (
                f"The input ({len(prompt)} tokens) is longer than the model's context length "
                f"({self.max_model_len} tokens)."
            )
        max_new = sampling.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
        if len(prompt) + max_new > self.max_model_len:
            return (
                "Requested token count exceeds the model's maximum context length of "
                f"{self.max_model_len} tokens. You requested a total of {len(prompt) + max_new} "
                f"tokens: {len(prompt)} tokens from the input messages and {max_new} tokens "
                "for the completion. Please reduce the number of tokens in the input messages "
                "or the completion to fit within the limit."
            )
        return None

    async def _sglang_generate(self, request: Request) -> Response:
        body, error = await self._read(request)
        if error is not None or body is None:
            return error or Response(status_code=500)
        prompt = body.get("input_ids")
        sampling = dict(body.get("sampling_params") or {})
        stream = bool(body.get("stream"))
        refusal = self._refusal(prompt, sampling)
        if refusal is not None:
            if stream:
                line = json.dumps({"error": {"message": refusal}})
                return _sse([f"data: {line}\n\n"], media_type="text/event-stream")
            return _error(refusal)
        max_new = sampling.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
        try:
            completions = self._completions_for(prompt, {**sampling, "max_tokens": max_new})
        except LookupError as exc:
            return _error(str(exc), 500)
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        n = int(sampling.get("n") or 1)
        rid = str(body.get("rid") or "double")
        rids = [rid] if n == 1 else [f"{rid}_{i}" for i in range(n)]
        reply = _Reply(
            prompt=prompt,
            completions=completions,
            rids=rids,
            logprobs=bool(body.get("return_logprob")),
            trim_stop=not sampling.get("no_stop_trim", False),
            weight_version=self.weight_version,
            cached=self._cache(prompt, completions) if self.prefix_cache else 0,
        )
        if not stream:
            outs = [reply.out(i, len(c.token_ids), True) for i, c in enumerate(completions)]
            return JSONResponse(outs if n > 1 else outs[0])
        return _sse(
            reply.chunks(incremental=self.incremental, indexed=n > 1),
            media_type="text/event-stream",
            chunk_delay_s=self.chunk_delay_s,
            on_close=self._stream_ended,
        )


@dataclass
class _Reply:
    prompt: list[int]
    completions: list[ScriptedCompletion]
    rids: list[str]
    logprobs: bool
    trim_stop: bool
    weight_version: str
    cached: int

    def out(self, index: int, upto: int, finished: bool, start: int = 0) -> dict[str, Any]:
        """Sample `index`'s reply covering its tokens [start, upto)."""
        completion = self.completions[index]
        ids = completion.token_ids[start:upto]
        values = completion.logprob_values()[start:upto]
        reason = _finish_reason(completion) if finished else None
        if reason is not None and self.trim_stop and isinstance(reason.get("matched"), int) and ids:
            ids = ids[:-1]  # detokenizer_manager.trim_matched_stop: ids, not the logprobs
        meta: dict[str, Any] = {
            "id": self.rids[index],
            "finish_reason": reason,
            "prompt_tokens": len(self.prompt),
            "weight_version": self.weight_version,
            "completion_tokens": upto,
            "cached_tokens": self.cached,
            "e2e_latency": 0.01,
        }
        if self.logprobs:
            meta["input_token_logprobs"] = [[None, self.prompt[-1], None]]
            meta["output_token_logprobs"] = [
                [value, token, None]
                for value, token in zip(values, completion.token_ids[start:upto], strict=True)
            ]
        return {"text": "".join(f"token_id:{t}" for t in ids), "output_ids": ids, "meta_info": meta}

    def chunks(self, *, incremental: bool, indexed: bool) -> Iterator[str]:
        for index, position in _interleaved(self.completions):
            total = len(self.completions[index].token_ids)
            upto = min(position + 1, total)
            out = self.out(index, upto, position >= total - 1, position if incremental else 0)
            if indexed:
                out["index"] = index
            yield f"data: {json.dumps(out, separators=(',', ':'))}\n\n"


@pytest.fixture(scope="session")
def _sglang_double() -> Iterator[SglangDouble]:
    double = SglangDouble().start()
    try:
        yield double
    finally:
        double.stop()


@pytest.fixture
def sglang_double(_sglang_double: SglangDouble) -> SglangDouble:
    """One running SGLang double, reset for this test."""
    if _sglang_double._server is None:
        _sglang_double.start()
    _sglang_double.reset()
    return _sglang_double


__all__ = ["SglangDouble", "sglang_double"]
