"""A TEST DOUBLE of a vLLM 0.32 engine: a real HTTP server speaking vLLM's token wire format.

Why a double and not the real engine: tokenkeep's tests need completions that a real model does
not produce on demand — a chosen, often adversarial or non-canonical token sequence (sub-word
pieces of `<tool_call>`, a turn cut by max_tokens, an end-of-turn token in the middle of a
string), exact logprobs to compare, and failures injected at chosen points (an HTTP 5xx, an
error line mid-stream, a dropped connection). The real CPU engine (`tests/vllm_fixture.py`)
covers the real behaviour; this double is checked against transcripts recorded from it
(`tests/fixtures/vllm/`, `tests/engines/test_double_fidelity.py`) so its wire format stays the
engine's.

Endpoints: `POST /inference/v1/generate` (stream and not), `POST /v1/completions` (token-ID
prompt; for the client's fallback), `GET /health`, `GET /v1/models`, and with `dev_mode`
(vLLM's `VLLM_SERVER_DEV_MODE=1`) `GET /weight_info` and `POST /update_weight_version`
(`{"new_version": ...}`), which set the policy version reported in each choice's
`weight_versions` (vLLM: `vllm/entrypoints/rl/online/api_router.py`). With `tokenize` set,
`POST /tokenize` answers `{"tokens", "count", "max_model_len"}` as vLLM's does
(`vllm/entrypoints/serve/tokenize/`); unset, 404 (an engine with no tokenize endpoint).

MoE routing replay: with `routed_experts = (layers, top_k)` the double answers like vLLM
started with `--enable-return-routed-experts` (vLLM 0.32,
`vllm/entrypoints/scale_out/token_in_token_out/protocol.py`): each finished choice carries
`routed_experts`, base64 of `.npy` bytes of shape (prompt + completion - 1 -
`sampling_params.routed_experts_prompt_start`, layers, top_k) — the positions from that start
to the last token but one (the last sampled token is never forwarded). The double's expert
ids are `double_expert(token at the position, layer, k)`, so a test can check alignment.

A double made with `generate_endpoint=False` answers the generate path with 404 like an engine
started without `--enable-scale-out`.

Scripting: `double.script(ScriptedCompletion([...]))` queues completions; each generated
choice pops one (n > 1 pops n). A callable `(prompt_ids, sampling) -> ScriptedCompletion` may
be queued, or set as `double.default`, to compute a completion from the request. The double
applies `max_tokens` (and vLLM's silent cap at the context left) by truncating to
`finish_reason="length"`, rejects out-of-vocabulary ids and over-long prompts with vLLM's 400
messages (as a `data: {"error": ...}` line after a 200 when streaming, as vLLM does), and
records every request in `double.requests`.

Fault injection: `fail_next(...)` queues HTTP and stream failures; `report_prompt`, when set,
rewrites the prompt the double reports back (`return_token_ids`), as an engine whose
tokenizer or request handling changed the prompt would.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import itertools
import json
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.trajectory_values import EngineSample

GENERATE_PATH = "/inference/v1/generate"
COMPLETIONS_PATH = "/v1/completions"
QWEN3_VOCAB_SIZE = 151936


@dataclass(slots=True)
class ScriptedCompletion:
    """One choice the double will "sample". `logprobs=None` gives deterministic fake values."""

    token_ids: list[int]
    finish_reason: str = "stop"
    stop_reason: int | str | None = None
    logprobs: list[float] | None = None
    weight_versions: list[tuple[str, int, int]] | None = None
    """(version, start, end) spans to report; None: the double's current version throughout."""
    routed_experts: str | None = None
    """The wire value the double computed for this choice (set by the double)."""
    overrun: bool = False
    """A faulty engine: every token is sent, past the request's `max_tokens`."""

    def logprob_values(self) -> list[float]:
        if self.logprobs is not None:
            return list(self.logprobs)
        return [fake_logprob(token_id) for token_id in self.token_ids]


def fake_logprob(token_id: int) -> float:
    return -round(0.05 + (token_id % 97) / 50, 6)


DOUBLE_EXPERTS = 64


def double_expert(token_id: int, layer: int, k: int) -> int:
    """The expert the double routes `token_id` to in `layer`, choice `k` of top-k."""
    return (token_id * 31 + layer * 7 + k) % DOUBLE_EXPERTS


def _routes_wire(tokens: list[int], start: int, layers: int, top_k: int) -> str:
    positions = tokens[start : len(tokens) - 1]
    experts = np.array(
        [
            [[double_expert(t, layer, k) for k in range(top_k)] for layer in range(layers)]
            for t in positions
        ],
        dtype=np.uint8,
    ).reshape(len(positions), layers, top_k)
    with io.BytesIO() as buffer:
        np.save(buffer, experts, allow_pickle=False)
        return base64.b64encode(buffer.getvalue()).decode("ascii")


Script = ScriptedCompletion | Callable[[list[int], dict[str, Any]], ScriptedCompletion]


@dataclass(slots=True)
class HttpFault:
    """Answer the next request with this HTTP status and vLLM's error body, before streaming."""

    status: int
    message: str = "injected failure"
    type: str = "InternalServerError"


@dataclass(slots=True)
class StreamErrorFault:
    """Stream `after_tokens` token chunks, then a `data: {"error": ...}` line and [DONE]."""

    after_tokens: int = 0
    code: int = 500
    message: str = "Internal server error"
    type: str = "InternalServerError"


@dataclass(slots=True)
class DropFault:
    """Send the 200 and `after_tokens` token chunks, then drop the connection mid-body."""

    after_tokens: int = 0


Fault = HttpFault | StreamErrorFault | DropFault


@dataclass(slots=True)
class RecordedRequest:
    path: str
    body: dict[str, Any]
    headers: dict[str, str]
    client_port: int = 0
    """The client's source port: one per connection (keep-alive reuse shows as one port)."""

    @property
    def prompt_ids(self) -> list[int]:
        if self.path == GENERATE_PATH:
            return list(self.body.get("token_ids", []))
        return list(self.body.get("prompt", []))

    @property
    def sampling(self) -> dict[str, Any]:
        if self.path == GENERATE_PATH:
            return dict(self.body.get("sampling_params", {}))
        reserved = {"model", "prompt", "stream", "return_token_ids", "request_id"}
        return {k: v for k, v in self.body.items() if k not in reserved}


class _DroppedConnection(Exception):
    """Raised inside a streaming body: uvicorn then closes the socket without finishing."""


def _error_body(message: str, type_: str, code: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _request_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(8)}"


@dataclass
class EngineDouble:
    """See the module docstring. Thread-safe to script from the test while it serves."""

    model: str = "tokenkeep-tiny-qwen3"
    vocab_size: int = QWEN3_VOCAB_SIZE
    max_model_len: int = 4096
    generate_endpoint: bool = True
    default: Callable[[list[int], dict[str, Any]], ScriptedCompletion] | None = None
    healthy: bool = True
    dev_mode: bool = False
    weight_version: str = "default"
    routed_experts: tuple[int, int] | None = None
    """(layers, top_k): answer like an MoE engine with --enable-return-routed-experts."""
    chunk_delay_s: float = 0.0
    """Pause after each streamed chunk (to let a test act while a stream is running)."""
    latency_s: float = 0.0
    """Pause before answering a generate request (time to first token; reliability tests)."""
    streams_ended: int = 0
    """Streams whose body finished or was abandoned by the client (vLLM aborts those)."""
    streams_abandoned: int = 0
    """Streams the client left before their last token (the engine stopped generating)."""
    requests_cancelled: int = 0
    """Requests whose client hung up while they waited for `latency_s` (vLLM aborts them)."""
    prefix_cache: bool = False
    """Report `usage.prompt_tokens_details.cached_tokens` (vLLM with
    --enable-prompt-tokens-details) as a prefix cache of 16-token blocks that never evicts
    would: the longest block-aligned prefix shared with an earlier request's prompt +
    completion. Streams report it when asked for usage (`stream_options.include_usage`)."""
    _computed: list[list[int]] = field(default_factory=list)
    report_prompt: Callable[[list[int]], list[int]] | None = None
    tokenize: Callable[[str], list[int]] | None = None
    """The engine's tokenizer, for `POST /tokenize` (`add_special_tokens` is false)."""
    """Rewrites the prompt reported back to the client (the prompt generated from is not)."""
    requests: list[RecordedRequest] = field(default_factory=list)
    samples: list[EngineSample] = field(default_factory=list)
    """Every choice answered, as sent (`tests/trajectory_values.py` checks exports with it)."""
    port: int = 0
    _scripts: deque[Script] = field(default_factory=deque)
    _faults: deque[Fault] = field(default_factory=deque)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _server: uvicorn.Server | None = None
    _thread: threading.Thread | None = None
    _socket: socket.socket | None = None

    # --- test-facing API ----------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    recorded = RecordedRequest
    """How a request is recorded (a double of another engine reads its own body shape)."""

    def script(self, *scripts: Script) -> None:
        with self._lock:
            self._scripts.extend(scripts)

    def fail_next(self, *faults: Fault) -> None:
        with self._lock:
            self._faults.extend(faults)

    def reset(self) -> None:
        with self._lock:
            self._scripts.clear()
            self._faults.clear()
            self.requests.clear()
            self.samples.clear()
            self.default = None
            self.healthy = True
            self.dev_mode = False
            self.weight_version = "default"
            self.routed_experts = None
            self.chunk_delay_s = 0.0
            self.streams_ended = 0
            self.streams_abandoned = 0
            self.requests_cancelled = 0
            self.generate_endpoint = True
            self.report_prompt = None
            self.tokenize = None
            self.prefix_cache = False
            self._computed.clear()

    def _stream_ended(self, finished: bool) -> None:
        with self._lock:
            self.streams_ended += 1
            self.streams_abandoned += not finished

    def paths(self) -> list[str]:
        with self._lock:
            return [r.path for r in self.requests]

    def start(self) -> EngineDouble:
        # proto=IPPROTO_TCP: asyncio only sets TCP_NODELAY on such sockets; without it every
        # JSON answer waits ~40 ms for a delayed ACK (Nagle).
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))  # port 0 first time; the same port on restart
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self._app(), log_level="critical", access_log=False, lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("engine double did not start")
            time.sleep(0.01)
        self._socket = sock
        return self

    def stop(self) -> None:
        """Stop serving (the port refuses connections) until `start()` again."""
        if self._server is None or self._thread is None:
            return
        self._server.should_exit = True
        self._thread.join(10)
        if self._socket is not None:
            self._socket.close()
            self._socket = None
        self._server = None
        self._thread = None

    # --- HTTP ---------------------------------------------------------------------------

    def _app(self) -> Starlette:
        return Starlette(
            routes=[
                Route(GENERATE_PATH, self._generate, methods=["POST"]),
                Route(COMPLETIONS_PATH, self._completions, methods=["POST"]),
                Route("/health", self._health, methods=["GET"]),
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/weight_info", self._weight_info, methods=["GET"]),
                Route("/update_weight_version", self._update_weight_version, methods=["POST"]),
                Route("/tokenize", self._tokenize, methods=["POST"]),
            ]
        )

    async def _weight_info(self, _request: Request) -> Response:
        if not self.dev_mode:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        return JSONResponse({"weight_version": self.weight_version})

    async def _update_weight_version(self, request: Request) -> Response:
        if not self.dev_mode:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        version = (await request.json())["new_version"]
        with self._lock:
            self.weight_version = str(version)
        return JSONResponse({"success": True, "new_version": version})

    async def _tokenize(self, request: Request) -> Response:
        if self.tokenize is None:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        tokens = self.tokenize((await request.json())["prompt"])
        return JSONResponse(
            {"tokens": tokens, "count": len(tokens), "max_model_len": self.max_model_len}
        )

    async def _health(self, _request: Request) -> Response:
        return Response(status_code=200 if self.healthy else 503)

    async def _models(self, _request: Request) -> Response:
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.model,
                        "object": "model",
                        "created": int(time.time()),
                        "owned_by": "vllm",
                        "root": self.model,
                        "parent": None,
                        "max_model_len": self.max_model_len,
                        "permission": [
                            {
                                "id": _request_id("modelperm-"),
                                "object": "model_permission",
                                "created": int(time.time()),
                                "allow_create_engine": False,
                                "allow_sampling": True,
                                "allow_logprobs": True,
                                "allow_search_indices": False,
                                "allow_view": True,
                                "allow_fine_tuning": False,
                                "organization": "*",
                                "group": None,
                                "is_blocking": False,
                            }
                        ],
                    }
                ],
            }
        )

    async def _read(self, request: Request) -> tuple[dict[str, Any] | None, Response | None]:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            return None, JSONResponse(
                _error_body("1 validation error: JSON decode error", "Bad Request", 400, "body"),
                status_code=400,
            )
        if not isinstance(body, dict):
            return None, JSONResponse(
                _error_body("1 validation error: body must be an object", "Bad Request", 400),
                status_code=400,
            )
        with self._lock:
            port = request.client.port if request.client else 0
            self.requests.append(self.recorded(request.url.path, body, dict(request.headers), port))
            fault = self._faults.popleft() if self._faults else None
        if isinstance(fault, HttpFault):
            return None, JSONResponse(
                _error_body(fault.message, fault.type, fault.status), status_code=fault.status
            )
        request.state.fault = fault
        return body, None

    def _validate(
        self, body: dict[str, Any], prompt: Any, sampling: dict[str, Any]
    ) -> tuple[JSONResponse | None, dict[str, Any] | None]:
        """(a 400 answered before streaming, an error raised in the generator) — vLLM checks
        the body's schema up front and the prompt against the model inside the stream."""
        if body.get("model") not in (None, self.model):
            return JSONResponse(
                _error_body(
                    f"The model `{body['model']}` does not exist. Valid aliases: {self.model}.",
                    "NotFoundError",
                    404,
                    "model",
                ),
                status_code=404,
            ), None
        if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
            return self._schema_error("token_ids must be a list of integers"), None
        if not prompt:
            return self._schema_error("List should have at least 1 item after validation"), None
        if any(t < 0 for t in prompt):
            return self._schema_error("token_ids must not contain negative values"), None
        max_tokens = sampling.get("max_tokens")
        if max_tokens is not None and max_tokens < 1:
            message = (
                f"max_tokens must be at least 1, got {max_tokens}. "
                f"(parameter=max_tokens, value={max_tokens})"
            )
            return JSONResponse(
                _error_body(message, "BadRequestError", 400, "max_tokens"), status_code=400
            ), None
        if (temperature := sampling.get("temperature")) is not None and temperature < 0:
            message = (
                f"temperature must be non-negative, got {float(temperature)}. "
                f"(parameter=temperature, value={float(temperature)})"
            )
            return JSONResponse(
                _error_body(message, "BadRequestError", 400, "temperature"), status_code=400
            ), None
        for token_id in prompt:
            if token_id >= self.vocab_size:
                return None, _error_body(
                    f"Token id {token_id} is out of vocabulary", "BadRequestError", 400
                )
        if len(prompt) > self.max_model_len:
            return None, _error_body(
                f"The decoder prompt (length {len(prompt)}) is longer than the maximum model "
                f"length of {self.max_model_len}. Make sure that `max_model_len` is no smaller "
                "than the number of text tokens.",
                "BadRequestError",
                400,
            )
        if len(prompt) == self.max_model_len:
            return None, _error_body(
                f"The decoder prompt (length {len(prompt)}) plus the number of requested output "
                f"tokens (at least 1) is longer than the maximum model length of "
                f"{self.max_model_len}. Make sure that `max_model_len` is no smaller than the "
                "number of text tokens (prompt + requested output tokens).",
                "BadRequestError",
                400,
            )
        return None, None

    @staticmethod
    def _schema_error(message: str) -> JSONResponse:
        return JSONResponse(
            _error_body(f"1 validation error:\n  {message}", "Bad Request", 400, "body.token_ids"),
            status_code=400,
        )

    def _completions_for(
        self, prompt: list[int], sampling: dict[str, Any]
    ) -> list[ScriptedCompletion]:
        n = int(sampling.get("n") or 1)
        room = self.max_model_len - len(prompt)
        max_tokens = min(sampling.get("max_tokens") or room, room)
        chosen: list[ScriptedCompletion] = []
        for _ in range(n):
            with self._lock:
                script = self._scripts.popleft() if self._scripts else self.default
            if script is None:
                raise LookupError("engine double: no scripted completion left")
            completion = (
                script
                if isinstance(script, ScriptedCompletion)
                else script(list(prompt), dict(sampling))
            )
            if len(completion.token_ids) > max_tokens and not completion.overrun:
                completion = ScriptedCompletion(
                    completion.token_ids[:max_tokens],
                    "length",
                    None,
                    completion.logprob_values()[:max_tokens],
                    completion.weight_versions,
                )
            if completion.weight_versions is None:
                completion = ScriptedCompletion(
                    completion.token_ids,
                    completion.finish_reason,
                    completion.stop_reason,
                    completion.logprobs,
                    [(self.weight_version, 0, len(completion.token_ids))],
                )
            if self.routed_experts is not None:
                start = int(sampling.get("routed_experts_prompt_start") or 0)
                completion.routed_experts = _routes_wire(
                    [*prompt, *completion.token_ids], start, *self.routed_experts
                )
            chosen.append(completion)
            with self._lock:
                self.samples.append(
                    EngineSample(
                        tuple(prompt),
                        tuple(completion.token_ids),
                        tuple(completion.logprob_values()),
                        tuple(_span_tuples(completion)),
                    )
                )
        return chosen

    # --- /inference/v1/generate ---------------------------------------------------------

    async def _generate(self, request: Request) -> Response:
        if not self.generate_endpoint:
            # Recorded, so a test can see the client stop asking once it knows.
            with self._lock:
                self.requests.append(RecordedRequest(request.url.path, {}, dict(request.headers)))
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        body, error = await self._read(request)
        if error is not None or body is None:
            return error or Response(status_code=500)
        sampling = body.get("sampling_params") or {}
        prompt = body.get("token_ids")
        early, late = self._validate(body, prompt, sampling)
        if early is not None:
            return early
        stream = bool(body.get("stream"))
        if late is not None:
            if stream:
                return _sse([_error_line(late)], media_type="text/event-stream")
            return JSONResponse(late, status_code=late["error"]["code"])
        try:
            completions = self._completions_for(prompt, sampling)
        except LookupError as exc:
            return JSONResponse(_error_body(str(exc), "InternalServerError", 500), status_code=500)
        if self.latency_s and await self._client_left_within(request, self.latency_s):
            return Response(status_code=499)  # nobody to answer: vLLM aborted it
        request_id = _request_id("generate-tokens-")
        want_logprobs = sampling.get("logprobs") is not None
        prompt_out = self._reported(prompt) if body.get("return_token_ids") else None
        cached = self._cache(prompt, completions)
        if not stream:
            response = _generate_response(
                request_id, self.model, prompt, prompt_out, completions, want_logprobs
            )
            if cached is not None:
                response["usage"]["prompt_tokens_details"] = {"cached_tokens": cached}
            return JSONResponse(response)
        chunks = _generate_chunks(request_id, prompt_out, completions, want_logprobs)
        if cached is not None and (body.get("stream_options") or {}).get("include_usage"):
            chunks = itertools.chain(
                chunks, [_usage_chunk(request_id, prompt, completions, cached)]
            )
        return _sse(
            _with_fault(chunks, request.state.fault),
            media_type="text/event-stream",
            chunk_delay_s=self.chunk_delay_s,
            on_close=self._stream_ended,
        )

    async def _client_left_within(self, request: Request, seconds: float) -> bool:
        """Wait `seconds` (the time to generate), watching the connection as vLLM's
        `with_cancellation` does: a client that hangs up aborts its request."""
        try:
            async with asyncio.timeout(seconds):
                while (await request.receive())["type"] != "http.disconnect":
                    pass
        except TimeoutError:
            return False
        with self._lock:
            self.requests_cancelled += 1
        return True

    def _cache(self, prompt: list[int], completions: list[ScriptedCompletion]) -> int | None:
        if not self.prefix_cache:
            return None
        with self._lock:
            shared = 0
            for seen in self._computed:
                n = 0
                for a, b in zip(prompt, seen, strict=False):
                    if a != b:
                        break
                    n += 1
                shared = max(shared, n)
            self._computed.extend([*prompt, *c.token_ids] for c in completions)
        return shared // 16 * 16

    def _reported(self, prompt: list[int]) -> list[int]:
        return prompt if self.report_prompt is None else self.report_prompt(list(prompt))

    # --- /v1/completions (token-ID prompt) ----------------------------------------------

    async def _completions(self, request: Request) -> Response:
        body, error = await self._read(request)
        if error is not None or body is None:
            return error or Response(status_code=500)
        prompt = body.get("prompt")
        sampling = RecordedRequest(COMPLETIONS_PATH, body, {}).sampling
        early, late = self._validate(body, prompt, sampling)
        if early is not None:
            return early
        if late is not None:  # the completions endpoint checks the prompt before streaming
            return JSONResponse(late, status_code=late["error"]["code"])
        try:
            completions = self._completions_for(prompt, sampling)
        except LookupError as exc:
            return JSONResponse(_error_body(str(exc), "InternalServerError", 500), status_code=500)
        request_id = _request_id("cmpl-")
        want_logprobs = sampling.get("logprobs") is not None
        return_ids = bool(body.get("return_token_ids"))
        if not body.get("stream"):
            return JSONResponse(
                _completions_response(
                    request_id,
                    self.model,
                    self._reported(prompt),
                    completions,
                    want_logprobs,
                    return_ids,
                )
            )
        chunks = _completions_chunks(
            request_id, self.model, self._reported(prompt), completions, want_logprobs, return_ids
        )
        return _sse(
            _with_fault(chunks, request.state.fault),
            media_type="text/event-stream",
            chunk_delay_s=self.chunk_delay_s,
            on_close=self._stream_ended,
        )


# --- wire shapes (mirroring tests/fixtures/vllm/*.json) --------------------------------------


def _compact(payload: dict[str, Any]) -> str:
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False)


def _error_line(error: dict[str, Any]) -> str:
    # vLLM writes error events with json.dumps defaults (", " and ": "), unlike its chunks.
    return f"data: {json.dumps(error)}\n\n"


def _sse(
    lines: Iterator[str] | list[str] | AsyncIterator[str],
    media_type: str,
    chunk_delay_s: float = 0.0,
    on_close: Callable[[bool], None] | None = None,
) -> StreamingResponse:
    async def each() -> AsyncIterator[str]:
        if isinstance(lines, AsyncIterator):
            async for line in lines:
                yield line
        else:
            for line in lines:
                yield line

    async def body() -> AsyncIterator[str]:
        finished = False
        try:
            async for line in each():
                yield line
                await asyncio.sleep(chunk_delay_s)
            yield "data: [DONE]\n\n"
            finished = True
        finally:
            if on_close is not None:
                on_close(finished)

    return StreamingResponse(body(), media_type=media_type)


def _with_fault(chunks: Iterator[str], fault: Fault | None) -> Iterator[str]:
    if fault is None:
        yield from chunks
        return
    assert isinstance(fault, StreamErrorFault | DropFault)
    for sent, chunk in enumerate(chunks):
        if sent == fault.after_tokens:
            break
        yield chunk
    if isinstance(fault, DropFault):
        raise _DroppedConnection
    yield _error_line(_error_body(fault.message, fault.type, fault.code))


def _generate_logprobs(token_ids: list[int], values: list[float]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token_id": token_id,
                "logprob": value,
                "rank": 1 + token_id % 50,
                "top_logprobs": [
                    {"token_id": token_id, "logprob": value, "rank": 1 + token_id % 50}
                ],
            }
            for token_id, value in zip(token_ids, values, strict=True)
        ]
    }


def _span_tuples(completion: ScriptedCompletion) -> list[tuple[str, int, int]]:
    return [(s["version"], s["start"], s["end"]) for s in _weight_versions(completion)]


def _weight_versions(completion: ScriptedCompletion) -> list[dict[str, Any]]:
    return [
        {"version": version, "start": start, "end": min(end, len(completion.token_ids))}
        for version, start, end in completion.weight_versions or ()
        if start < len(completion.token_ids)
    ]


def _generate_choice(
    index: int,
    completion: ScriptedCompletion,
    token_ids: list[int],
    values: list[float],
    finished: bool,
    want_logprobs: bool,
) -> dict[str, Any]:
    return {
        "index": index,
        "finish_reason": completion.finish_reason if finished else None,
        "stop_reason": completion.stop_reason if finished else None,
        "token_ids": token_ids,
        "routed_experts": completion.routed_experts if finished else None,
        "sampling_mask": None,
        "weight_versions": _weight_versions(completion) if finished else None,
        "logprobs": _generate_logprobs(token_ids, values) if want_logprobs else None,
    }


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


def _generate_response(
    request_id: str,
    model: str,
    prompt: list[int],
    prompt_out: list[int] | None,
    completions: list[ScriptedCompletion],
    want_logprobs: bool,
) -> dict[str, Any]:
    generated = sum(len(c.token_ids) for c in completions)
    return {
        "request_id": request_id,
        "model": model,
        "created": int(time.time()),
        "usage": _usage(len(prompt), generated),
        "prompt_logprobs": None,
        "prompt_token_id_logprobs": None,
        "prompt_token_ids": prompt_out,
        "mm_placeholders": None,
        "metrics": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "output_mode": "tokens",
        "choices": [
            _generate_choice(i, c, c.token_ids, c.logprob_values(), True, want_logprobs)
            for i, c in enumerate(completions)
        ],
    }


def _usage_chunk(
    request_id: str, prompt: list[int], completions: list[ScriptedCompletion], cached: int
) -> str:
    usage = _usage(len(prompt), sum(len(c.token_ids) for c in completions))
    usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return f"data: {_compact({'request_id': request_id, 'choices': [], 'usage': usage})}\n\n"


def _interleaved(completions: list[ScriptedCompletion]) -> Iterator[tuple[int, int]]:
    """(choice index, position) in engine-step order: every live choice advances each step."""
    longest = max((len(c.token_ids) for c in completions), default=0)
    for position in range(max(longest, 1)):
        for index, completion in enumerate(completions):
            if position < len(completion.token_ids) or (position == 0 and not completion.token_ids):
                yield index, position


def _generate_chunks(
    request_id: str,
    prompt_out: list[int] | None,
    completions: list[ScriptedCompletion],
    want_logprobs: bool,
) -> Iterator[str]:
    values = [c.logprob_values() for c in completions]
    first = True
    for index, position in _interleaved(completions):
        completion = completions[index]
        total = len(completion.token_ids)
        token_ids = completion.token_ids[position : position + 1]
        chunk: dict[str, Any] = {"request_id": request_id, "usage": None}
        if first and prompt_out is not None:
            chunk["prompt_token_ids"] = prompt_out
        first = False
        chunk["output_mode"] = "tokens"
        chunk["choices"] = [
            _generate_choice(
                index,
                completion,
                token_ids,
                values[index][position : position + 1],
                position >= total - 1,
                want_logprobs,
            )
        ]
        yield f"data: {_compact(chunk)}\n\n"


def _completions_logprobs(token_ids: list[int], values: list[float], offset: int) -> dict[str, Any]:
    tokens = [f"token_id:{t}" for t in token_ids]
    return {
        "text_offset": [offset + sum(len(t) for t in tokens[:i]) for i in range(len(tokens))],
        "token_logprobs": values,
        "tokens": tokens,
        "top_logprobs": [{t: v} for t, v in zip(tokens, values, strict=True)],
    }


def _completions_response(
    request_id: str,
    model: str,
    prompt: list[int],
    completions: list[ScriptedCompletion],
    want_logprobs: bool,
    return_ids: bool,
) -> dict[str, Any]:
    generated = sum(len(c.token_ids) for c in completions)
    return {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": i,
                "text": "".join(f"token_id:{t}" for t in c.token_ids),
                "logprobs": (
                    _completions_logprobs(c.token_ids, c.logprob_values(), 0)
                    if want_logprobs
                    else None
                ),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                "token_ids": c.token_ids if return_ids else None,
                "prompt_logprobs": None,
                "prompt_token_ids": prompt if return_ids else None,
                "routed_experts": None,
            }
            for i, c in enumerate(completions)
        ],
        "service_tier": None,
        "system_fingerprint": "vllm-0.32.0-double",
        "usage": _usage(len(prompt), generated),
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


def _completions_chunks(
    request_id: str,
    model: str,
    prompt: list[int],
    completions: list[ScriptedCompletion],
    want_logprobs: bool,
    return_ids: bool,
) -> Iterator[str]:
    values = [c.logprob_values() for c in completions]
    started: set[int] = set()
    for index, position in _interleaved(completions):
        completion = completions[index]
        token_ids = completion.token_ids[position : position + 1]
        finished = position >= len(completion.token_ids) - 1
        choice = {
            "index": index,
            "text": "".join(f"token_id:{t}" for t in token_ids),
            "logprobs": (
                _completions_logprobs(token_ids, values[index][position : position + 1], 0)
                if want_logprobs
                else None
            ),
            "finish_reason": completion.finish_reason if finished else None,
            "stop_reason": completion.stop_reason if finished else None,
            "prompt_token_ids": prompt if return_ids and index not in started else None,
            "token_ids": token_ids if return_ids else None,
        }
        chunk: dict[str, Any] = {
            "id": request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": [choice],
        }
        if index in started:
            chunk["system_fingerprint"] = "vllm-0.32.0-double"
        started.add(index)
        yield f"data: {_compact(chunk)}\n\n"


# --- pytest fixtures -------------------------------------------------------------------------


@contextlib.contextmanager
def running_doubles(count: int, **options: Any) -> Iterator[list[EngineDouble]]:
    doubles = [EngineDouble(**options).start() for _ in range(count)]
    try:
        yield doubles
    finally:
        for double in doubles:
            double.stop()


@pytest.fixture(scope="session")
def _engine_double_pool() -> Iterator[list[EngineDouble]]:
    with running_doubles(3) as doubles:
        yield doubles


@pytest.fixture
def engine_doubles(_engine_double_pool: list[EngineDouble]) -> Iterator[list[EngineDouble]]:
    """Three running doubles (replicas), reset for each test."""
    for double in _engine_double_pool:
        if double._server is None:
            double.start()
        double.reset()
    yield _engine_double_pool
    for double in _engine_double_pool:
        if double._server is None:
            double.start()


@pytest.fixture
def engine_double(engine_doubles: list[EngineDouble]) -> EngineDouble:
    """One running double, reset for this test."""
    return engine_doubles[0]
