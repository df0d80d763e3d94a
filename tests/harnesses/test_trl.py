"""TRL's `GRPOTrainer` (PyPI `trl==1.16.0`, pinned) trained for one real step on rollouts
exported from a live session server through `tokenkeep.integrations.trl.rollout_output`, its
`rollout_func` contract. What TRL builds its loss from (prompt and completion ids, the rollout
logprobs it uses for importance sampling, its tool mask) must equal tokenkeep's export and
what the engine (the double) was sent and sampled.

TRL pulls torch, transformers and accelerate, which tokenkeep must not depend on, so it is
installed into its own virtualenv under `.cache/harnesses/` (once; torch 2.13.0 is pinned so
pip takes the CPU build; skipped where PyPI is unreachable, which under CI=true fails) and
driven as a subprocess (`trl_grpo_driver.py`, a 2-layer random-weights Qwen3 policy)."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.api.stack import reply, tool_call
from tests.engine_double import EngineDouble
from tests.harnesses.conftest import live_stack
from tests.integrations.venvs import framework_python
from tests.real_tokenizers import qwen3_dir
from tokenkeep import AsyncClient

VERSION = "1.16.0"
TORCH = "2.13.0"
DRIVER = Path(__file__).with_name("trl_grpo_driver.py")


@pytest.fixture(scope="module")
def trl_python() -> Path:
    return framework_python(f"trl-{VERSION}", (f"torch=={TORCH}", f"trl=={VERSION}"))


def run_driver(python: Path, *arguments: str) -> dict[str, Any]:
    done = subprocess.run(
        [str(python), str(DRIVER), *arguments],
        capture_output=True, text=True, timeout=300, check=False,
        env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"},
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


async def test_grpo_step_consumes_tokenkeep_rollouts_exactly(
    double: EngineDouble, trl_python: Path
) -> None:
    """A tool-calling rollout (its tool result is context, env mask 0) and a one-turn rollout,
    finished with rewards 1 and 0, become TRL's completions token for token; the step runs."""
    weather, hello = "trl-weather", "trl-hello"
    with live_stack(double, []) as stack:
        stack.script(
            tool_call("get_weather", '{"city": "Paris"}', think="Check it."),
            reply("Paris", " is sunny."),
            reply("Hel", "lo", "!"),
        )
        chat = openai.AsyncOpenAI(
            api_key="tk", base_url=f"{stack.url}/sessions/{weather}/v1", max_retries=0
        )
        messages: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
        first = await chat.chat.completions.create(model="m", messages=messages)
        call = first.choices[0].message
        assert call.tool_calls
        messages += [
            call.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": "sunny, 21C"},
        ]
        await chat.chat.completions.create(model="m", messages=messages)
        chat = openai.AsyncOpenAI(
            api_key="tk", base_url=f"{stack.url}/sessions/{hello}/v1", max_retries=0
        )
        await chat.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Say hello."}]
        )
        async with AsyncClient(stack.url) as tk:
            await tk.finish(weather, reward=1.0)
            await tk.finish(hello, reward=0.0)
            rows = [row async for row in tk.export(session_ids=[weather, hello])]
        requests, sent = stack.engine_requests(), stack.sent

        result = await asyncio.to_thread(
            run_driver, trl_python, stack.url, str(qwen3_dir()), weather, hello
        )

    adapter, consumed = result["adapter"], result["consumed"]
    assert [r.session_id for r in rows] == [weather, hello] == adapter["session_id"]
    # The engine's first prompt of each rollout is TRL's prompt; the rest is its completion.
    assert adapter["prompt_ids"] == [requests[0].prompt_ids, requests[2].prompt_ids]
    assert adapter["completion_ids"] == [
        r.token_ids[len(p) :] for r, p in zip(rows, adapter["prompt_ids"], strict=True)
    ]
    # The tool call's turn, then the tool result (context: mask 0), then the answer.
    call_ids, answer_ids, hello_ids = (s.token_ids for s in sent)
    tool_turn = requests[1].prompt_ids[
        len(requests[0].prompt_ids) + len(call_ids) :
    ]  # what tokenkeep's template added
    assert adapter["completion_ids"][0] == call_ids + tool_turn + answer_ids
    assert adapter["env_mask"][0] == [1] * len(call_ids) + [0] * len(tool_turn) + [1] * len(
        answer_ids
    )
    assert adapter["completion_ids"][1] == hello_ids
    assert adapter["env_mask"][1] == [1] * len(hello_ids)
    # The engine's logprob of each sampled token (float32 in the store), 0.0 on context.
    expected_logprobs = [
        sent[0].logprob_values() + [0.0] * len(tool_turn) + sent[1].logprob_values(),
        sent[2].logprob_values(),
    ]
    for got, want in zip(adapter["logprobs"], expected_logprobs, strict=True):
        assert got == pytest.approx(want, abs=1e-6)
    assert result["rewards"] == [1.0, 0.0]

    # What TRL built its loss from is the adapter's output, unchanged.
    for key in ("prompt_ids", "completion_ids", "env_mask"):
        assert consumed[key] == adapter[key], key
    for got, want in zip(consumed["logprobs"], adapter["logprobs"], strict=True):
        assert got == pytest.approx(want, abs=1e-6)
    assert consumed["advantages"][0] > 0 > consumed["advantages"][1]
    assert len(result["losses"]) == 1 and result["weights_moved"]
