"""Run in a venv with `verifiers==0.4.0` (not a project dependency): two chat turns through
verifiers' real `TrainClient` (renderer + `renderers.client.generate`, which posts to
`<base>/inference/v1/generate`) against a tokenkeep session URL. Prints each turn's
`TurnTokens`, in one JSON line at the end.

Usage: python verifiers_train_client.py <session base url ending /v1> <tokenizer dir> <session>
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

from verifiers.v1.clients.train import TrainClient
from verifiers.v1.configs.client import TrainClientConfig
from verifiers.v1.dialects.chat import ChatDialect
from verifiers.v1.types import SamplingConfig


async def main(base_url: str, tokenizer: str, session: str) -> None:
    os.environ.setdefault("TOKENKEEP_KEY", "unused")
    client = TrainClient(
        TrainClientConfig(
            base_url=base_url, api_key_var="TOKENKEEP_KEY", renderer_model_name=tokenizer
        )
    )
    messages: list[dict] = [{"role": "user", "content": "Hi"}]
    turns: list[dict] = []
    try:
        for follow_up in ("More", None):
            response = await client.get_response(
                ChatDialect(),
                {"model": "m", "messages": messages},
                SamplingConfig(max_tokens=50, temperature=1.0),
                session_id=session,
            )
            tokens = response.tokens
            assert tokens is not None
            turns.append(
                {
                    "prompt_ids": tokens.prompt_ids,
                    "completion_ids": tokens.completion_ids,
                    "completion_logprobs": tokens.completion_logprobs,
                    "content": response.message.content,
                    "finish_reason": response.finish_reason,
                }
            )
            if follow_up is None:
                break
            messages += [
                {"role": "assistant", "content": response.message.content},
                {"role": "user", "content": follow_up},
            ]
    finally:
        await client.close()
    print(json.dumps({"turns": turns}))


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
