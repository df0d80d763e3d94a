"""vLLM's token-in `/inference/v1/generate` front-end, for trainers that render prompts
themselves (verifiers' TrainClient via `renderers.client.generate`, prime-rl).

The request is vLLM 0.32's `GenerateRequest` (`token_ids`, `sampling_params`, `model`, ...);
the turn is planned and stored by the same token-ID path as `/v1/completions`
(`TurnService.complete_tokens`: the prompt is matched against the session's stored tokens).
The answer is vLLM's tokens-mode `GenerateResponse`. Each logprob entry carries both vLLM
0.32's `token_id` and the `"token": "token_id:N"` string that `renderers` 0.1.x checks.
Not served: streaming, multimodal `features` / `content_parts`, `prompt_logprobs`, top-k
logprobs (the sampled token's logprob is always returned).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from session_server.api import turn_service
from session_server.api.params import SAMPLING_FIELDS
from session_server.api.replies import tokenkeep_info, usage
from session_server.api.routing import LeanRoute
from session_server.api.serving import IDEMPOTENCY_KEY_DOC, serve_turn
from session_server.api.session_ids import check_session_id, session_id_from_headers
from session_server.api.sse import openai_error_line
from session_server.conversation import Conversation, ConversationError
from session_server.results import TurnResult
from session_server.sampling import check_sampling

router = APIRouter(route_class=LeanRoute)

# vLLM SamplingParams fields forwarded to the engine as given (the core merges them with the
# model's and the session's defaults, like every front-end's sampling).
_FORWARDED = frozenset(
    (*SAMPLING_FIELDS, "max_tokens", "min_tokens", "stop", "stop_token_ids", "ignore_eos")
)
# Fields that change only text or what is reported, never which tokens are sampled: tokenkeep
# always records the sampled token's logprob and returns token ids, so they are accepted and
# have no effect. `routed_experts_prompt_start` is the core's to set from the stored history.
_NO_EFFECT = frozenset(
    {
        "logprobs",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "include_stop_str_in_output",
        "detokenize",
        "routed_experts_prompt_start",
    }
)


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    request_id: str | None = None
    token_ids: list[int] = Field(min_length=1)
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    model: str | None = None
    return_token_ids: bool | None = None
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    cache_salt: str | None = None
    priority: int = 0
    reasoning_ended: bool | None = None
    features: dict[str, Any] | None = None
    content_parts: list[dict[str, Any]] | None = None
    output_mode: str = "tokens"


def to_conversation(body: GenerateRequest) -> Conversation:
    if body.stream:
        raise ConversationError("streaming is not supported on generate", param="stream")
    if body.features is not None or body.content_parts is not None:
        raise ConversationError("multimodal prompts are not supported", param="features")
    if body.output_mode != "tokens":
        raise ConversationError('only output_mode "tokens" is supported', param="output_mode")
    params = body.sampling_params
    unknown = sorted(set(params) - _FORWARDED - _NO_EFFECT - {"n", "structured_outputs"})
    if unknown:
        raise ConversationError(
            f"sampling_params.{unknown[0]} is not supported", param=f"sampling_params.{unknown[0]}"
        )
    n = params.get("n", 1)
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 128:
        raise ConversationError("n must be between 1 and 128", param="sampling_params.n")
    logprobs = params.get("logprobs")
    if logprobs not in (None, 0, 1):
        raise ConversationError(
            "only the sampled token's logprob is returned (logprobs 0 or 1)",
            param="sampling_params.logprobs",
        )
    return Conversation(
        messages=[],
        sampling=check_sampling(
            {k: v for k, v in params.items() if k in _FORWARDED}, prefix="sampling_params."
        ),
        n=n,
        logprobs=True,
        response_format=params.get("structured_outputs"),
        api="completions",
        model=body.model,
        reasoning_ended=body.reasoning_ended,
        return_token_ids=True,
    )


def format_result(result: TurnResult, body: GenerateRequest) -> dict[str, Any]:
    reply: dict[str, Any] = {
        "request_id": body.request_id or result.response_id,
        "model": result.model,
        "created": result.created,
        "choices": [
            {
                "index": c.index,
                # /generate has no tool-call vocabulary: a parsed tool call ended on a stop.
                "finish_reason": "length" if c.finish_reason == "length" else "stop",
                "stop_reason": c.stop_reason,
                "token_ids": c.token_ids,
                "logprobs": {
                    "content": [
                        {
                            "token_id": t,
                            "token": f"token_id:{t}",
                            "logprob": lp,
                            "top_logprobs": [],
                        }
                        for t, lp in zip(c.token_ids, c.logprobs, strict=True)
                    ]
                },
            }
            for c in result.choices
        ],
        "usage": usage(result),
        "tokenkeep": tokenkeep_info(result),
    }
    if body.return_token_ids:
        reply["prompt_token_ids"] = result.prompt_ids
    return reply


async def _serve(session_id: str, body: GenerateRequest, request: Request) -> Any:
    service = turn_service(request)
    conversation = to_conversation(body)
    ids = list(body.token_ids)

    return await serve_turn(
        request,
        session_id,
        "generate",
        conversation,
        streaming=False,
        complete=lambda: service.complete_tokens(session_id, ids, conversation),
        stream=lambda: service.stream_tokens(session_id, ids, conversation),
        reply=lambda result: format_result(result, body),
        # to_conversation refuses stream=true, so the SSE side is never used.
        frames=lambda events: events,
        on_error=openai_error_line(request.url.path),
    )


@router.post("/sessions/{session_id}/inference/v1/generate", openapi_extra=IDEMPOTENCY_KEY_DOC)
async def session_generate(session_id: str, body: GenerateRequest, request: Request) -> Any:
    return await _serve(check_session_id(session_id), body, request)


@router.post("/inference/v1/generate", openapi_extra=IDEMPOTENCY_KEY_DOC)
async def generate(body: GenerateRequest, request: Request) -> Any:
    return await _serve(session_id_from_headers(request), body, request)
