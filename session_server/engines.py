"""Token-in/token-out client for engine replicas: affinity, health, retries, fallback.

What is said to an engine, and how its answers read, is its wire (`session_server/engine_wire/`:
vLLM's token endpoint, SGLang's `/generate`); everything here is the same for both.

Which replica serves a session is the replica set's answer (`engine_replicas.py`: discovery,
health, fencing, rendezvous order). A request that fails before its first token is retried on
the next replica in the session's order, and once more round the list; the same prompt, so the
turn is stored once, by whichever answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import orjson

from session_server.engine_http import Endpoint, EngineReply, LeanClient
from session_server.engine_replicas import ReplicaSet
from session_server.engine_wire.base import (
    Call,
    EngineChoice,
    EngineError,
    Generation,
    GenerationDelta,
    Protocol,
    Replica,
    Retryable,
    StreamEvent,
    StreamStart,
    Wire,
)
from session_server.engine_wire.vllm import VllmWire
from session_server.images import ImageInput
from session_server.tokenizer_match import TokenizerProbe

logger = logging.getLogger(__name__)

# vLLM reads this header for session-aware scheduling; it costs nothing to send.
SESSION_HEADER = "X-Session-ID"
_SESSION_LINE = SESSION_HEADER.lower().encode() + b": %s\r\n"
# The headers every engine request sends besides the session's (the lean client adds the
# length); the lean client asks for an uncompressed reply, as it decodes none.
_REQUEST_HEADERS = {"content-type": "application/json"}
_LEAN_HEADERS = {**_REQUEST_HEADERS, "user-agent": "tokenkeep", "accept-encoding": "identity"}


# vLLM (uvicorn) closes an idle keep-alive connection after 5 s. A pooled connection reused
# just as the engine closes it fails with a reset and no response; expiring idle connections
# well before the engine does removes that race.
KEEPALIVE_EXPIRY_S = 2.0


def encode_body(body: dict[str, Any]) -> bytes:
    """The request body as JSON bytes: the prompt's token IDs dominate it, and orjson
    serialises 32k of them in a fraction of a millisecond (json.dumps: several)."""
    return orjson.dumps(body)


def _engine_error(status: int, body: bytes) -> EngineError:
    """vLLM's error body is `{"error": {"message", "type", "param", "code"}}`; anything else
    (a proxy's HTML page, FastAPI's `{"detail": ...}`) is kept as text."""
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError:
        payload = None
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
        error = payload["error"]
        return EngineError(
            status,
            str(error.get("message", "")),
            str(error.get("type", "EngineError")),
            param=error.get("param"),
        )
    if isinstance(payload, dict) and "detail" in payload:
        return EngineError(status, str(payload["detail"]), "EngineError")
    return EngineError(status, body.decode(errors="replace")[:500], "EngineError")


def _client_status(engine_status: int) -> int:
    """4xx is the request's fault and goes back as is; a failing engine is a bad gateway."""
    if 400 <= engine_status < 500:
        return engine_status
    return 503 if engine_status == 503 else 502


def _timeout(url: str, exc: Exception) -> EngineError:
    return EngineError(504, f"engine {url} timed out: {exc!r}", "EngineTimeout")


class EngineClient:
    def __init__(
        self,
        urls: list[str],
        *,
        model: str,
        timeout_s: float = 600,
        connect_timeout_s: float = 30.0,
        health_interval_s: float = 5.0,
        max_connections: int = 1024,
        transport: httpx.AsyncBaseTransport | None = None,
        discover: bool = False,
        max_inflight_per_replica: int = 256,
        wire: Wire | None = None,
        engine_key: str | None = None,
        tokenizer_probe: TokenizerProbe | None = None,
    ):
        if not urls:
            raise ValueError("at least one engine URL is required")
        self.model = model
        self.wire = wire or VllmWire(model)
        # Sent on every request, health checks included: an engine started for publishing
        # asks for it on every path but /health (session_server/vllm_extension.py).
        auth = {"authorization": f"Bearer {engine_key}"} if engine_key else {}
        self._lean_headers = {**_LEAN_HEADERS, **auth}
        # Waiting for a free connection is queueing behind a burst, not a failure: the pool
        # wait gets the whole request timeout. The connect timeout is generous too: it runs
        # on this process's event loop, and while a burst of requests keeps the loop busy
        # for seconds it expires although the connection was made (a dead engine is found
        # by its health check, not by this timeout).
        # Requests to a plain http:// engine go through the lean client (engine_http.py);
        # an https:// one, and every request when a test or the in-process check passes its
        # own transport, through httpx, with the same limits (a transport given explicitly:
        # like the lean client, it ignores proxy variables in the environment).
        timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s, pool=timeout_s)
        self._lean = (
            None
            if transport is not None
            else LeanClient(
                timeout=timeout,
                max_connections=max_connections,
                keepalive_expiry=KEEPALIVE_EXPIRY_S,
            )
        )
        limits = httpx.Limits(
            max_connections=max_connections,
            max_keepalive_connections=max_connections,
            keepalive_expiry=KEEPALIVE_EXPIRY_S,
        )
        self._http = httpx.AsyncClient(
            timeout=timeout,
            transport=transport or httpx.AsyncHTTPTransport(limits=limits),
            headers=auth,
        )
        # Health checks get their own small pool, so a burst that fills the request pool
        # cannot starve them into declaring a busy engine dead.
        self._health_timeout = httpx.Timeout(min(2.0, health_interval_s))
        self._health_http = httpx.AsyncClient(
            timeout=self._health_timeout,
            limits=httpx.Limits(max_connections=8, keepalive_expiry=KEEPALIVE_EXPIRY_S),
            transport=transport,
            headers=auth,
        )
        self.fleet = ReplicaSet(
            [url.rstrip("/") for url in urls],
            wire=self.wire,
            http=self._http,
            health_http=self._health_http,
            health_timeout=self._health_timeout,
            health_interval_s=health_interval_s,
            max_inflight_per_replica=max_inflight_per_replica,
            discover=discover,
            tokenizer_probe=tokenizer_probe,
        )
        self._aborting: set[asyncio.Task[None]] = set()

    @property
    def replicas(self) -> list[Replica]:
        return self.fleet.replicas

    async def start(self) -> None:
        """Check every replica once, then keep checking in the background."""
        await self.fleet.start()

    async def close(self) -> None:
        await self.fleet.close()
        if self._aborting:
            await asyncio.gather(*self._aborting, return_exceptions=True)
        if self._lean is not None:
            await self._lean.aclose()
        await self._http.aclose()
        await self._health_http.aclose()

    async def __aenter__(self) -> EngineClient:
        await self.start()
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.close()

    async def ready(self) -> bool:
        """At least one replica answers its health check."""
        return await self.fleet.ready()

    async def check_health(self) -> None:
        await self.fleet.check_health()

    def order_for(self, session_id: str) -> list[Replica]:
        return self.fleet.order_for(session_id)

    @property
    def control_http(self) -> httpx.AsyncClient:
        """The HTTP client (engine key included) for requests other than generations."""
        return self._http

    @property
    def on_replica_unverified(self) -> list[Callable[[Replica], None]]:
        """The replica set's hooks for a replica whose weights may have changed."""
        return self.fleet.on_unverified

    @property
    def published_version(self) -> str | None:
        return self.fleet.published_version

    @published_version.setter
    def published_version(self, version: str | None) -> None:
        self.fleet.published_version = version

    @property
    def accepts_version(self) -> Callable[[str], bool] | None:
        return self.fleet.accepts_version

    @accepts_version.setter
    def accepts_version(self, accepts: Callable[[str], bool] | None) -> None:
        self.fleet.accepts_version = accepts

    # --- requests -------------------------------------------------------------------------

    async def generate(
        self,
        session_id: str,
        prompt_ids: list[int],
        sampling: dict[str, Any],
        *,
        reasoning_ended: bool | None = None,
        prompt_json: bytes | None = None,
        images: tuple[ImageInput, ...] = (),
    ) -> Generation:
        """One whole generation. `sampling` is vLLM's SamplingParams as a dict, sent as is
        (plus `logprobs: 0` unless set): the caller sends every parameter it means, since
        /generate applies none of the model's generation_config defaults. `reasoning_ended`
        (token endpoint only) makes structured outputs apply from the first token under a
        reasoning parser. `prompt_json`: `prompt_ids` as a JSON array, when the caller
        already has it (sent as is and compared with the engine's echo)."""
        call = Call(
            session_id,
            prompt_ids,
            sampling,
            reasoning_ended,
            False,
            prompt_json or orjson.dumps(prompt_ids),
            images,
        )
        started = time.perf_counter()
        accepts = self.fleet.accepts_version
        last_error: EngineError | None = None
        await self.fleet.need_ready()
        for replica in self.fleet.attempts(session_id):
            replica.inflight += 1
            try:
                generation = await self._generate_on(replica, call)
                for choice in generation.choices:
                    self.fleet.observe_version(replica, choice.weight_versions, accepts)
            except Retryable as failure:
                last_error = await self._note_failure(replica, failure)
                continue
            finally:
                replica.inflight -= 1
            replica.failures = 0
            generation.latency_s = time.perf_counter() - started
            return generation
        assert last_error is not None
        raise last_error

    async def stream(
        self,
        session_id: str,
        prompt_ids: list[int],
        sampling: dict[str, Any],
        *,
        reasoning_ended: bool | None = None,
        prompt_json: bytes | None = None,
        images: tuple[ImageInput, ...] = (),
    ) -> AsyncIterator[StreamEvent]:
        """Yields one `StreamStart`, then `GenerationDelta`s as the engine samples. Failures
        before the first chunk move to the next replica; after it they raise `EngineError`.
        Closing the iterator early (`async with contextlib.aclosing(client.stream(...))`)
        closes the connection, which makes vLLM abort the request (engines that need more are
        sent their wire's abort requests)."""
        call = Call(
            session_id,
            prompt_ids,
            sampling,
            reasoning_ended,
            True,
            prompt_json or orjson.dumps(prompt_ids),
            images,
        )
        last_error: EngineError | None = None
        accepts = self.fleet.accepts_version
        await self.fleet.need_ready()
        for replica in self.fleet.attempts(session_id):
            replica.inflight += 1
            try:
                async with contextlib.aclosing(self._stream_on(replica, call, accepts)) as events:
                    async for event in events:
                        yield event
                return
            except Retryable as failure:
                last_error = await self._note_failure(replica, failure)
            finally:
                replica.inflight -= 1
        assert last_error is not None
        raise last_error

    async def _stream_on(
        self, replica: Replica, call: Call, accepts: Callable[[str], bool] | None
    ) -> AsyncIterator[StreamEvent]:
        """One replica's stream; `Retryable` only while nothing has been yielded."""
        request_id = _request_id(call)
        response = await self._post(replica, call, request_id)
        replica.failures = 0
        parse = self.wire.stream_parser(replica, call)
        started = False
        try:
            async for chunk in _sse_payloads(
                response, replica.url, self.wire.echo_check(replica, call)
            ):
                prompt_ids_seen, deltas = parse(chunk)
                if not started:
                    started = True
                    yield StreamStart(replica.url, prompt_ids_seen)
                for delta in deltas:
                    self.fleet.observe_version(replica, delta.weight_versions, accepts)
                    yield delta
        except Retryable as failure:
            if started:
                raise failure.error from failure
            raise
        except (GeneratorExit, asyncio.CancelledError):
            self._abort(replica, request_id, call)  # the caller left before the end
            raise
        finally:
            await response.aclose()

    async def _note_failure(self, replica: Replica, failure: Retryable) -> EngineError:
        """A request could not be served by `replica` (if it could not reach it, the replica
        set hears of it); the next replica is tried."""
        if failure.mark_down:
            await self.fleet.unreachable(replica, failure.error.message)
        logger.warning(
            "engine %s failed before any token, trying next: %s", replica.url, failure.error
        )
        return failure.error

    async def _send(self, replica: Replica, path: str, call: Call, content: bytes) -> EngineReply:
        """POST `content` to the replica's `path`: through the lean client where the replica
        is plain http and no transport was given, else through httpx."""
        try:
            endpoint = replica.endpoints[path]
        except KeyError:
            endpoint = replica.endpoints[path] = (
                Endpoint.of(replica.url + path, self._lean_headers)
                if self._lean is not None
                else None
            )
        if endpoint is not None:
            assert self._lean is not None
            session = call.session_id.encode("ascii")
            if b"\r" in session or b"\n" in session:  # written as is: no header injection
                raise ValueError(f"session id {call.session_id!r} cannot be a header value")
            return await self._lean.post(endpoint, _SESSION_LINE % session, content)
        request = self._http.build_request(
            "POST",
            replica.url + path,
            content=content,
            headers={SESSION_HEADER: call.session_id, **_REQUEST_HEADERS},
        )
        return await self._http.send(request, stream=True)

    def _abort(self, replica: Replica, request_id: str, call: Call) -> None:
        """Stop a request the caller left, where the wire says closing its connection is not
        enough. In the background: the caller is being cancelled or closed, and must not wait
        on the engine for it."""
        for path, body in self.wire.aborts(request_id, call):
            task = asyncio.create_task(self._send_abort(replica, path, body))
            self._aborting.add(task)
            task.add_done_callback(self._aborting.discard)

    async def _send_abort(self, replica: Replica, path: str, body: dict[str, Any]) -> None:
        try:
            response = await self._http.post(
                replica.url + path,
                content=encode_body(body),
                headers=_REQUEST_HEADERS,
                timeout=self._health_timeout,
            )
        except httpx.HTTPError as exc:
            logger.warning("engine %s: abort %s failed: %r", replica.url, body, exc)
            return
        if response.status_code != 200:
            logger.warning(
                "engine %s: abort %s answered %d", replica.url, body, response.status_code
            )

    async def _post(self, replica: Replica, call: Call, request_id: str) -> EngineReply:
        """Send the request (the body is read by the caller) and settle the endpoint question:
        a replica the wire has another endpoint for is switched to it (vLLM's completions
        fallback)."""
        while True:
            path, body = self.wire.request(replica, call, request_id)
            try:
                response = await self._send(replica, path, call, encode_body(body))
            except (httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
                raise Retryable(
                    EngineError(
                        503, f"engine {replica.url} unreachable: {exc!r}", "EngineUnavailable"
                    ),
                    mark_down=isinstance(exc, httpx.ConnectTimeout),
                ) from exc
            except httpx.TimeoutException as exc:
                # The engine took the request and is slow: running it again elsewhere would
                # double the wait, so this one is final.
                raise _timeout(replica.url, exc) from exc
            except httpx.HTTPError as exc:
                raise Retryable(
                    EngineError(
                        503, f"engine {replica.url} unreachable: {exc!r}", "EngineUnavailable"
                    ),
                    mark_down=True,
                ) from exc
            if response.status_code == 200:
                return response
            body_bytes = await response.aread()
            await response.aclose()
            error = _engine_error(response.status_code, body_bytes)
            if self.wire.fallback(replica, error):
                continue
            error.status = _client_status(error.status)
            if error.status >= 500:
                raise Retryable(error, mark_down=response.status_code == 503)
            raise error

    async def _generate_on(self, replica: Replica, call: Call) -> Generation:
        request_id = _request_id(call)
        try:
            return await self._generate_with(replica, call, request_id)
        except asyncio.CancelledError:
            self._abort(replica, request_id, call)  # the caller left before the answer
            raise

    async def _generate_with(self, replica: Replica, call: Call, request_id: str) -> Generation:
        response = await self._post(replica, call, request_id)
        try:
            body = await response.aread()
        except httpx.TimeoutException as exc:
            raise _timeout(replica.url, exc) from exc
        except httpx.HTTPError as exc:
            raise Retryable(
                EngineError(
                    502, f"engine {replica.url} dropped the response: {exc!r}", "EngineUnavailable"
                ),
                mark_down=False,
            ) from exc
        finally:
            await response.aclose()
        # The body echoes the whole prompt (O(history) integers, checked by the caller):
        # orjson decodes it several times faster than the standard library.
        try:
            payload = _loads(body, self.wire.echo_check(replica, call))
        except orjson.JSONDecodeError as exc:
            raise Retryable(
                EngineError(502, f"engine {replica.url} sent invalid JSON", "EngineProtocolError"),
                mark_down=False,
            ) from exc
        return self.wire.parse(payload, replica)


def _request_id(call: Call) -> str:
    # 64 random bits (uuid4 costs five Python calls more per request)
    return f"{call.session_id}-{os.urandom(8).hex()}"


# --- SSE --------------------------------------------------------------------------------


_ECHO_KEY = b'"prompt_token_ids":'


def _loads(raw: bytes, sent: Call | None) -> Any:
    """`orjson.loads(raw)`, except that an echoed top-level `prompt_token_ids` array that is
    byte for byte the one sent is not decoded: the payload gets the sent list itself. The
    echo is O(history) integers per turn and decoding them was the largest single cost of
    a served turn at long histories; comparing bytes proves the same thing. An echo that
    differs, or is formatted differently, is decoded and compared by the caller as before.
    (Inside a JSON string every quote is escaped, so the key found is a real key.)"""
    if sent is not None:
        at = raw.find(_ECHO_KEY)
        start = at + len(_ECHO_KEY)
        if at >= 0 and raw.startswith(sent.prompt_json, start):
            payload = orjson.loads(raw[:start] + b"null" + raw[start + len(sent.prompt_json) :])
            if isinstance(payload, dict) and "prompt_token_ids" in payload:
                payload["prompt_token_ids"] = sent.prompt_ids
                return payload
    return orjson.loads(raw)


async def _sse_lines(response: EngineReply) -> AsyncIterator[bytes]:
    """The body's lines as bytes (text lines would decode the first chunk's echoed prompt to
    str only for it to be encoded again)."""
    buffer = bytearray()
    async for chunk in response.aiter_bytes():
        scanned = len(buffer)
        buffer += chunk
        start = 0
        while (end := buffer.find(b"\n", max(start, scanned))) >= 0:
            yield bytes(buffer[start:end]).rstrip(b"\r")
            start = end + 1
        del buffer[:start]
    if buffer:
        yield bytes(buffer)


async def _sse_payloads(
    response: EngineReply, url: str, sent: Call | None = None
) -> AsyncIterator[dict[str, Any]]:
    """The JSON payloads of an SSE body, up to `data: [DONE]`. vLLM sends single-line
    `data:` events only. An error event or a body that ends without [DONE] raises
    `Retryable` (the caller decides whether a token already went out)."""
    try:
        async for line in _sse_lines(response):
            if not line.startswith(b"data:"):
                continue  # blank separators, comments, other fields
            data = line[5:].strip()
            if data == b"[DONE]":
                return
            try:
                payload = _loads(data, sent)
            except orjson.JSONDecodeError:
                payload = None
            if not isinstance(payload, dict):
                raise Retryable(
                    EngineError(
                        502, f"engine {url} sent an invalid SSE line", "EngineProtocolError"
                    ),
                    mark_down=False,
                )
            if (error_info := payload.get("error")) is not None and not payload.get("choices"):
                code = error_info.get("code") if isinstance(error_info, dict) else None
                error = _engine_error(200, data)
                error.status = _client_status(code if isinstance(code, int) else 500)
                if error.status < 500:
                    raise error
                raise Retryable(error, mark_down=False)
            yield payload
    except httpx.TimeoutException as exc:
        raise _timeout(url, exc) from exc
    except httpx.HTTPError as exc:
        raise Retryable(
            EngineError(502, f"engine {url} dropped the stream: {exc!r}", "EngineUnavailable"),
            mark_down=False,
        ) from exc
    raise Retryable(
        EngineError(502, f"engine {url} ended the stream without [DONE]", "EngineUnavailable"),
        mark_down=False,
    )


__all__ = [
    "Call",
    "EngineChoice",
    "EngineClient",
    "EngineError",
    "Generation",
    "GenerationDelta",
    "Protocol",
    "Replica",
    "StreamEvent",
    "StreamStart",
]
