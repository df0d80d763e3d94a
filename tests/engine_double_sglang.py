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

Policy publishing (`policy/control.py::SglangControl`), read in SGLang 0.5.23's
`entrypoints/http_server.py`, `managers/io_struct.py`'s request classes and what
`tokenizer_manager.py` / `scheduler.py` do with them:
- `POST /pause_generation {"mode": "abort" | "retract" | "in_place"}` (`PauseGenerationReqInput`,
  a required JSON body, `mode` defaulting to "abort"; 422 without a body or with another
  mode) and `POST /continue_generation {}` (likewise a required body), both answering
  `{"message": "Generation paused|continued successfully.", "status": "ok"}`. `/generate`
  requests that arrive while paused wait. "abort" aborts every request (recorded in
  `aborted` as "*"; the streams in flight are not cut here). "retract" freezes the streams
  in flight between two tokens (SGLang moves them back to its waiting queue and frees their
  KV) until continued: the tokens after it are sampled by whatever weights are loaded then,
  and each finished reply's `meta_info.weight_versions` lists the spans
  `[{"version", "start", "end"}]` (0.5.23's `compute_weight_version_spans`: one span per
  version, `weight_version` the last one's). "in_place" freezes the same way here; its
  kept KV (and SGLang's refusal to flush it) is not modelled: tokenkeep never sends it;
- `POST /update_weights_from_disk` (`UpdateWeightFromDiskReqInput`: `model_path`,
  `load_format`, `abort_all_requests`, `weight_version`): 200 `{"success": true, "message":
  "Succeeded to update model weights.[ Weight version updated to v.]",
  "num_paused_requests": 0}`, the radix cache flushed and `weight_version` set; a folder the
  engine cannot read (missing, or listed in `unreadable`: a replica whose mount lacks it)
  is 400 `{"success": false, "message": "Failed to get weights iterator: ...",
  "num_paused_requests": 0}` and the old weights and version stay;
- `GET|POST /flush_cache`: 200 "Cache flushed.\n..." (400 while `busy`: "When there are
  running or waiting requests, the operation will not be performed");
- `POST /update_weight_version` (`UpdateWeightVersionReqInput`: `new_version`,
  `abort_all_requests` defaulting to true, which aborts every request: "*" in `aborted`):
  `{"success": true, "message": "Weight version updated to v", "new_version": v}`;
- `GET /get_weight_version` -> `{"weight_version"}` ("default" at start, as
  `server_args.weight_version`).
- `POST /init_weights_update_group` (`InitWeightsUpdateGroupReqInput`: `master_address`,
  `master_port`, `rank_offset`, `world_size`, `group_name`, `backend`): each tensor-parallel
  worker joins at rank `rank_offset + tp_rank` (`model_runner_components/weight_updater.py`)
  and the call answers once the whole group has met (`tests/engine_double_transfer.py`'s
  `NcclGroup` is the rendezvous, the test's trainer rank 0): 200 `{"success": true,
  "message"}`, or 400 `{"success": false, "message"}`;
- `POST /update_weights_from_distributed` (`UpdateWeightsFromDistributedReqInput`: `names`,
  `dtypes`, `shapes`, `group_name`, `flush_cache`, `abort_all_requests`, `weight_version`):
  blocks until rank 0's broadcast of those tensors arrives, loads them (the broadcast's
  label becomes `loaded`), flushes the cache when asked; 400 `success: false` without a
  group or when the broadcast's names differ;
- `POST /destroy_weights_update_group {"group_name"}`: the group is gone;
- `/server_info` reports `tp_size`, `pp_size`, `dp_size` (the ranks a replica takes).
`fail` maps one of these three paths to a status it answers once (an injected failure).
`pause_mode` is the mode of the pause in force (None: not paused). `loaded` is the folder last
loaded (None: the base weights), `flushes` counts cache flushes,
`control` records each control call's path and body. `restart()` is a restart at the same
address: base weights, version "default", not paused.

It reuses `EngineDouble`'s scripting (`script`, `default`), its recorded requests and samples,
`latency_s`, `chunk_delay_s` and its stream accounting; `aborted` lists every rid
`/abort_request` was asked to stop (and `abort_all` requests, as "*").
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
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
from tests.engine_double_transfer import NcclGroup

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


def _failed(message: str, status: int = 400) -> JSONResponse:
    """A weight-update call that failed, as SGLang's HTTP server answers it."""
    return JSONResponse({"success": False, "message": message}, status_code=status)


def _unprocessable(field_name: str, message: str) -> JSONResponse:
    """FastAPI's answer to a body its request class refuses."""
    detail = [{"type": "value_error", "loc": ["body", field_name], "msg": message}]
    return JSONResponse({"detail": detail}, status_code=422)


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
    paused: bool = False
    pause_mode: str | None = None
    busy: bool = False
    """Answer `/flush_cache` as an engine with running or waiting requests does."""
    loaded: str | None = None
    flushes: int = 0
    unreadable: set[str] = field(default_factory=set)
    control: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    tp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1
    group: NcclGroup | None = None
    rank_offset: int = 0
    received_round: int = 0
    fail: dict[str, int] = field(default_factory=dict)
    recorded = SglangRequest

    def reset(self) -> None:
        super().reset()
        with self._lock:
            self.incremental = False
            self.aborted.clear()
            self.busy = False
            self.flushes = 0
            self.unreadable.clear()
            self.control.clear()
            self.fail.clear()
        self.restart()

    def restart(self) -> None:
        """What a restarted SGLang server at the same address serves: its base weights."""
        with self._lock:
            self.paused = False
            self.pause_mode = None
            self.loaded = None
            self.group = None
            self.received_round = 0
            self.weight_version = "default"

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
                Route("/get_weight_version", self._get_weight_version, methods=["GET"]),
                Route("/pause_generation", self._pause_generation, methods=["POST"]),
                Route("/continue_generation", self._continue_generation, methods=["POST"]),
                Route("/update_weights_from_disk", self._update_from_disk, methods=["POST"]),
                Route("/update_weight_version", self._sglang_weight_version, methods=["POST"]),
                Route("/flush_cache", self._flush_cache, methods=["GET", "POST"]),
                Route("/init_weights_update_group", self._init_group, methods=["POST"]),
                Route(
                    "/update_weights_from_distributed", self._update_distributed, methods=["POST"]
                ),
                Route("/destroy_weights_update_group", self._destroy_group, methods=["POST"]),
            ]
        )

    async def _control_body(self, request: Request) -> dict[str, Any]:
        raw = await request.body()
        body = json.loads(raw) if raw.strip() else {}
        with self._lock:
            self.control.append((request.url.path, body))
        return body if isinstance(body, dict) else {}

    async def _get_weight_version(self, _request: Request) -> Response:
        return JSONResponse({"weight_version": self.weight_version})

    async def _required_body(self, request: Request) -> dict[str, Any] | None:
        """The control body as FastAPI's `Body()` takes it: a JSON object, or None (a 422)."""
        if not (await request.body()).strip():
            return None
        body = await self._control_body(request)
        return body if isinstance(body, dict) else None

    async def _pause_generation(self, request: Request) -> Response:
        body = await self._required_body(request)
        mode = None if body is None else body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            return _unprocessable("mode", "Input should be 'abort', 'retract' or 'in_place'")
        with self._lock:
            self.paused = True
            self.pause_mode = mode
            if mode == "abort":
                self.aborted.append("*")  # abort_request(abort_all=True)
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    async def _continue_generation(self, request: Request) -> Response:
        if await self._required_body(request) is None:
            return _unprocessable("body", "Field required")
        with self._lock:
            self.paused = False
            self.pause_mode = None
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    async def _update_from_disk(self, request: Request) -> Response:
        body = await self._control_body(request)
        if not isinstance(body.get("model_path"), str):
            return _error("1 validation error: model_path: field required")
        path = body["model_path"]
        if body.get("abort_all_requests"):
            with self._lock:
                self.aborted.append("*")
        if path in self.unreadable or not Path(path).is_dir():
            message = (
                f"Failed to get weights iterator: {path} (repository not found or not a "
                "local folder)."
            )
            return JSONResponse(
                {"success": False, "message": message, "num_paused_requests": 0},
                status_code=400,
            )
        message = "Succeeded to update model weights."
        with self._lock:
            self.loaded = path
            self.flushes += 1  # the scheduler flushes the radix cache after a reload
            if body.get("weight_version") is not None:
                self.weight_version = str(body["weight_version"])
                message += f" Weight version updated to {self.weight_version}."
        return JSONResponse({"success": True, "message": message, "num_paused_requests": 0})

    def _injected(self, path: str) -> JSONResponse | None:
        status = self.fail.pop(path, None)
        if status is None:
            return None
        return _failed(f"injected failure of {path}", status)

    async def _init_group(self, request: Request) -> Response:
        body = await self._control_body(request)
        failed = self._injected(request.url.path)
        if failed is not None:
            return failed
        group = NcclGroup.groups.get((body.get("master_address"), body.get("master_port")))
        if group is None or body.get("world_size") != group.world_size:
            return _failed("Failed to init process group: no such rendezvous")
        ranks = [body["rank_offset"] + tp_rank for tp_rank in range(self.tp_size)]
        try:
            await asyncio.to_thread(group.join, ranks)
        except (RuntimeError, TimeoutError) as error:
            return _failed(f"Failed to init process group: {error}")
        self.group, self.rank_offset, self.received_round = group, body["rank_offset"], 0
        return JSONResponse({"success": True, "message": "Succeeded to init process group."})

    async def _update_distributed(self, request: Request) -> Response:
        body = await self._control_body(request)
        failed = self._injected(request.url.path)
        if failed is not None:
            return failed
        if self.group is None:
            return _failed("Failed to update parameter online: the group is not initialized")
        ranks = [self.rank_offset + tp_rank for tp_rank in range(self.tp_size)]
        try:
            self.received_round, payload = await asyncio.to_thread(
                self.group.receive, ranks, self.received_round
            )
        except TimeoutError as error:
            return _failed(f"Failed to update parameter online: {error}")
        if body.get("names") != payload["names"]:
            return _failed("Failed to update parameter online: the broadcast's names differ")
        with self._lock:
            self.loaded = payload["weights"]
            if body.get("flush_cache", True):
                self.flushes += 1
            if body.get("weight_version") is not None:
                self.weight_version = str(body["weight_version"])
        return JSONResponse({"success": True, "message": "Succeeded to update parameter online."})

    async def _destroy_group(self, request: Request) -> Response:
        await self._control_body(request)
        self.group = None
        return JSONResponse({"success": True, "message": "Succeeded to destroy the group."})

    async def _sglang_weight_version(self, request: Request) -> Response:
        body = await self._control_body(request)
        if body.get("new_version") is None:
            return _error("1 validation error: new_version: field required")
        with self._lock:
            if body.get("abort_all_requests", True):
                self.aborted.append("*")
            self.weight_version = str(body["new_version"])
        version = self.weight_version
        return JSONResponse(
            {
                "success": True,
                "message": f"Weight version updated to {version}",
                "new_version": version,
            }
        )

    async def _flush_cache(self, request: Request) -> Response:
        await self._control_body(request)
        text = (
            "Cache flushed.\nPlease check backend logs for more details. (When there are "
            "running or waiting requests, the operation will not be performed.)\n"
        )
        with self._lock:
            if not self.busy:
                self.flushes += 1
        return Response(text, status_code=400 if self.busy else 200)

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
                "tp_size": self.tp_size,
                "pp_size": self.pp_size,
                "dp_size": self.dp_size,
                "version": "0.5.23",
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
        while self.paused:  # the tokenizer manager holds requests while paused
            await asyncio.sleep(0.01)
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
            versions=[[self.weight_version] * len(c.token_ids) for c in completions],
            cached=self._cache(prompt, completions) if self.prefix_cache else 0,
        )
        if not stream:
            outs = [reply.out(i, len(c.token_ids), True) for i, c in enumerate(completions)]
            return JSONResponse(outs if n > 1 else outs[0])
        return _sse(
            reply.chunks(self, incremental=self.incremental, indexed=n > 1),
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
    """The version when the request came (a reply with no tokens reports it)."""
    versions: list[list[str]]
    """Each sample's tokens' weight versions (a stream sets each as it samples the token)."""
    cached: int

    def out(self, index: int, upto: int, finished: bool, start: int = 0) -> dict[str, Any]:
        """Sample `index`'s reply covering its tokens [start, upto)."""
        completion = self.completions[index]
        ids = completion.token_ids[start:upto]
        values = completion.logprob_values()[start:upto]
        reason = _finish_reason(completion) if finished else None
        if reason is not None and self.trim_stop and isinstance(reason.get("matched"), int) and ids:
            ids = ids[:-1]  # detokenizer_manager.trim_matched_stop: ids, not the logprobs
        versions = self.versions[index][:upto]
        meta: dict[str, Any] = {
            "id": self.rids[index],
            "finish_reason": reason,
            "prompt_tokens": len(self.prompt),
            "weight_version": versions[-1] if versions else self.weight_version,
            "completion_tokens": upto,
            "cached_tokens": self.cached,
            "e2e_latency": 0.01,
        }
        if finished:
            meta["weight_versions"] = _spans(versions)
        if self.logprobs:
            meta["input_token_logprobs"] = [[None, self.prompt[-1], None]]
            meta["output_token_logprobs"] = [
                [value, token, None]
                for value, token in zip(values, completion.token_ids[start:upto], strict=True)
            ]
        return {"text": "".join(f"token_id:{t}" for t in ids), "output_ids": ids, "meta_info": meta}

    async def chunks(
        self, double: SglangDouble, *, incremental: bool, indexed: bool
    ) -> AsyncIterator[str]:
        for index, position in _interleaved(self.completions):
            while double.paused and double.pause_mode != "abort":
                await asyncio.sleep(0.01)  # frozen by a retract pause until continued
            if position < len(self.versions[index]):
                self.versions[index][position] = double.weight_version  # the weights sampling it
            total = len(self.completions[index].token_ids)
            upto = min(position + 1, total)
            out = self.out(index, upto, position >= total - 1, position if incremental else 0)
            if indexed:
                out["index"] = index
            yield f"data: {json.dumps(out, separators=(',', ':'))}\n\n"


def _spans(versions: list[str]) -> list[dict[str, Any]]:
    """Per-token versions as SGLang's `weight_versions`: one span per run of one version."""
    spans: list[dict[str, Any]] = []
    for position, version in enumerate(versions):
        if spans and spans[-1]["version"] == version:
            spans[-1]["end"] = position + 1
        else:
            spans.append({"version": version, "start": position, "end": position + 1})
    return spans


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
