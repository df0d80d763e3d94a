"""The trainer adapters (`tokenkeep.integrations`) against the frameworks' released packages:
a group of two real rollouts through session URLs of a live server (the OpenAI SDK, real Qwen3
tokenizer and template; the engine double samples, since what is checked is the mapping, not
the model): one calls a tool, gets its result and answers, sampled across a policy update
(versions 3 then 4), one answers at once. Each framework's own types, filled by the adapter
from the group's export, must hold tokenkeep's tokens, loss mask and logprobs, and the prompts
the engine was sent.

verl 0.9.1 and AReaL 1.0.4 share one virtualenv (torch 2.13.0 CPU, the file on disk), NeMo
Gym 0.4.0 has one on Python 3.12 (it requires >= 3.12); each framework with `--no-deps` beside
what its imported modules need (tests/integrations/venvs.py). SkyRL (>= 3.12 and torch at
import: PyPI has only the multi-GB CUDA torch for 3.12) and slime (not on PyPI) are checked in
this process against the fields read from their sources; slime's `Sample` is a stand-in
(slime_sample.py). Both were run against their own code by bench/adapters_recorded.py
(bench/results/adapters.md), which also checks the stand-in against slime's class."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.api.stack import Stack, reply, tool_call
from tests.engine_double import EngineDouble
from tests.harnesses.conftest import live_stack
from tests.integrations.slime_sample import Sample
from tests.integrations.venvs import framework_python, python312
from tokenkeep import AsyncClient
from tokenkeep.integrations.skyrl import OPTIONAL, generator_output
from tokenkeep.integrations.slime import fill_sample
from tokenkeep.types import Row

DRIVER = Path(__file__).with_name("adapter_driver.py")
GROUP = "adapters-q1"
WEATHER, HELLO = "adapters-weather", "adapters-hello"

TORCH_FRAMEWORKS = (
    "torch==2.13.0", "transformers==5.10.4", "tensordict==0.10.0", "ray==2.60.0",
    "hydra-core==1.3.8", "datasets==5.2.0", "accelerate==1.15.0", "codetiming==1.4.0",
    "pillow==13.0.0", "pydantic==2.14.4", "cachetools==8.0.2", "uvicorn==0.54.0",
    "fastapi==0.165.0", "aiohttp==3.14.5", "colorlog==6.12.0", "tenacity==9.2.1",
    "flask==3.1.3", "torchdata==0.11.0", "lark==1.3.1", "uvloop==0.23.0", "numba==0.68.1",
    "einops==0.8.2", "aiofiles==25.1.0", "openai==2.7.2",
)  # fmt: skip
"""What `verl.experimental.agent_loop` and AReaL's workflow modules import (AReaL pins
transformers <= 5.3.0, verl >= 5.5.3: verl's wins; AReaL's workflow code does not use it)."""
NEMO_GYM = (
    "openai==2.7.2", "pydantic==2.14.4", "orjson==3.13.0", "ray==2.60.0", "requests==2.34.2",
    "uvicorn==0.54.0", "aiohttp==3.14.5", "fastapi==0.165.0", "omegaconf==2.3.1",
    "hydra-core==1.3.8", "itsdangerous==2.2.0", "rich==15.0.0", "wandb==0.31.0",
    "gprof2dot==2025.4.14", "pydot==4.0.1", "yappi==1.7.6",
)  # fmt: skip
"""What `nemo_gym.openai_utils` imports."""


@dataclass
class Rollouts:
    url: str
    rows: dict[str, Row]
    prompts: dict[str, list[list[int]]]
    """Per session, the prompt of each engine request, in order."""
    sampled: dict[str, list[tuple[list[int], list[float]]]]
    """Per session, the tokens and logprobs the engine sampled for each request."""
    tool_turn: list[int]
    """The tokens tokenkeep's template added for the tool result (context, mask 0)."""


@pytest.fixture(scope="module")
def rollouts(double: EngineDouble) -> Iterator[Rollouts]:
    with live_stack(double, []) as stack:
        yield asyncio.run(run_group(stack))


async def run_group(stack: Stack) -> Rollouts:
    stack.script(
        tool_call("get_weather", '{"city": "Paris"}', think="Check it."),
        reply("Paris", " is sunny."),
        reply("Hel", "lo", "!"),
    )
    stack.double.weight_version = "3"
    async with AsyncClient(stack.url) as tk:
        weather = await tk.create_session(id=WEATHER, group=GROUP, group_size=2)
        hello = await tk.create_session(id=HELLO, group=GROUP, group_size=2)
        chat = openai.AsyncOpenAI(api_key="tk", base_url=weather.openai_base_url, max_retries=0)
        messages: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
        first = await chat.chat.completions.create(model="m", messages=messages)
        call = first.choices[0].message
        assert call.tool_calls
        messages += [
            call.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": "sunny, 21C"},
        ]
        stack.double.weight_version = "4"  # the trainer published a new policy mid-rollout
        await chat.chat.completions.create(model="m", messages=messages)
        chat = openai.AsyncOpenAI(api_key="tk", base_url=hello.openai_base_url, max_retries=0)
        await chat.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Say hello."}]
        )
        await tk.finish(WEATHER, reward=1.0)
        await tk.finish(HELLO, reward=0.0)
        rows = {row.session_id: row async for row in tk.export(group=GROUP)}
    requests = [r.prompt_ids for r in stack.engine_requests()]
    sampled = [(s.token_ids, s.logprob_values()) for s in stack.sent]
    return Rollouts(
        url=stack.url,
        rows=rows,
        prompts={WEATHER: requests[:2], HELLO: requests[2:]},
        sampled={WEATHER: sampled[:2], HELLO: sampled[2:]},
        tool_turn=requests[1][len(requests[0]) + len(sampled[0][0]) :],
    )


def expected(rollouts: Rollouts, session: str) -> dict[str, Any]:
    """What every adapter must hand over for a session, from the engine's side: the first
    prompt, then the sampled tokens with the tool result between them."""
    (prompt, *_), sampled = rollouts.prompts[session], rollouts.sampled[session]
    if session == WEATHER:
        (call, call_lp), (answer, answer_lp) = sampled
        tool = rollouts.tool_turn
        return {
            "prompt": prompt,
            "response": call + tool + answer,
            "mask": [1] * len(call) + [0] * len(tool) + [1] * len(answer),
            "logprobs": call_lp + [0.0] * len(tool) + answer_lp,
            "versions": [3] * len(call) + [-1] * len(tool) + [4] * len(answer),
            "reward": 1.0,
        }
    [(answer, answer_lp)] = sampled
    return {
        "prompt": prompt,
        "response": answer,
        "mask": [1] * len(answer),
        "logprobs": answer_lp,
        "versions": [4] * len(answer),
        "reward": 0.0,
    }


def test_the_group_is_what_the_engine_sampled(rollouts: Rollouts) -> None:
    """The ground truth the adapters are held to: the export is the engine's record."""
    for session, row in rollouts.rows.items():
        want = expected(rollouts, session)
        assert row.token_ids == want["prompt"] + want["response"]
        assert row.loss_mask == [0] * len(want["prompt"]) + want["mask"]
        assert row.group == GROUP
    assert rollouts.rows[WEATHER].versions == ["3", "4"]
    assert rollouts.rows[WEATHER].mixed_versions


def run_driver(python: Path, framework: str, url: str) -> dict[str, Any]:
    done = subprocess.run(
        [str(python), str(DRIVER), framework, url, GROUP],
        capture_output=True, text=True, timeout=300, check=False,
        env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0"},
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def torch_python() -> Path:
    return framework_python(
        "verl-0.9.1-areal-1.0.4", TORCH_FRAMEWORKS, ("verl==0.9.1", "areal==1.0.4")
    )


def test_verl_agent_loop_output(rollouts: Rollouts, torch_python: Path) -> None:
    result = run_driver(torch_python, "verl", rollouts.url)
    for i, session in enumerate(result["session_ids"]):
        want = expected(rollouts, session)
        assert result["prompts"][i] == want["prompt"]
        assert result["responses"][i] == want["response"]
        assert result["response_mask"][i] == want["mask"]
        assert result["rollout_log_probs"][i] == pytest.approx(want["logprobs"], abs=1e-6)
        # verl puts the reward on the last response token.
        assert result["rm_scores"][i] == [0.0] * (len(want["response"]) - 1) + [want["reward"]]
        assert result["extra_fields"][i]["session_id"] == session


def test_areal_grouped_workflow(rollouts: Rollouts, torch_python: Path) -> None:
    """AReaL's `GroupedRolloutWorkflow` pads and concatenates the group's trajectories."""
    result = run_driver(torch_python, "areal", rollouts.url)
    width = max(len(row.token_ids) for row in rollouts.rows.values())
    for i, session in enumerate(result["session_ids"]):
        want = expected(rollouts, session)
        n_prompt, pad = len(want["prompt"]), width - len(rollouts.rows[session].token_ids)
        assert result["input_ids"][i] == want["prompt"] + want["response"] + [0] * pad
        assert result["loss_mask"][i] == [0] * n_prompt + want["mask"] + [0] * pad
        assert result["logprobs"][i] == pytest.approx(
            [0.0] * n_prompt + want["logprobs"] + [0.0] * pad, abs=1e-6
        )
        assert result["versions"][i] == [-1] * n_prompt + want["versions"] + [0] * pad
        assert result["attention_mask"][i] == [True] * (width - pad) + [False] * pad
        assert result["rewards"][i] == want["reward"]


@pytest.fixture(scope="module")
def nemo_gym_python() -> Path:
    python = python312()
    if python is None:
        pytest.skip("no Python 3.12 (NeMo Gym requires >= 3.12)")
    return framework_python("nemo-gym-0.4.0", NEMO_GYM, ("nemo-gym==0.4.0",), python=python)


def test_nemo_gym_training_fields(rollouts: Rollouts, nemo_gym_python: Path) -> None:
    """NeMo Gym's `...ForTraining` output items, one per model call, hold the exact prompt the
    engine was sent (not a re-tokenization) and what it sampled."""
    result = run_driver(nemo_gym_python, "nemo_gym", rollouts.url)
    by_session: dict[str, list[dict[str, Any]]] = {}
    for item in result["items"]:
        by_session.setdefault(item.pop("session_id"), []).append(item)
    for session, items in by_session.items():
        assert [i["prompt_token_ids"] for i in items] == rollouts.prompts[session]
        assert [i["generation_token_ids"] for i in items] == [
            ids for ids, _ in rollouts.sampled[session]
        ]
        for item, (_, logprobs) in zip(items, rollouts.sampled[session], strict=True):
            assert item["generation_log_probs"] == pytest.approx(logprobs, abs=1e-6)
    assert sorted(by_session) == sorted([WEATHER, HELLO])


def test_skyrl_generator_output(rollouts: Rollouts) -> None:
    """SkyRL's `GeneratorOutput` fields (skyrl 0.4.0), and the length checks of its
    `validate_generator_output`: one entry per trajectory, response-long lists."""
    sessions = [WEATHER, HELLO]
    output = generator_output([rollouts.rows[s] for s in sessions], trajectory_ids=["t0", "t1"])
    for i, session in enumerate(sessions):
        want = expected(rollouts, session)
        assert output["prompt_token_ids"][i] == want["prompt"]
        assert output["response_ids"][i] == want["response"]
        assert output["loss_masks"][i] == want["mask"]
        assert output["rollout_logprobs"][i] == pytest.approx(want["logprobs"], abs=1e-6)
    assert output["rewards"] == [1.0, 0.0]
    assert output["trajectory_ids"] == ["t0", "t1"]
    assert all(output[key] is None for key in OPTIONAL)


def test_slime_sample(rollouts: Rollouts) -> None:
    for session, row in rollouts.rows.items():
        want = expected(rollouts, session)
        sample = fill_sample(Sample(), row)
        assert sample.tokens == want["prompt"] + want["response"]
        assert sample.response_length == len(want["response"])
        assert sample.loss_mask == want["mask"]
        assert sample.rollout_log_probs == pytest.approx(want["logprobs"], abs=1e-6)
        assert sample.reward == want["reward"]
        assert sample.status is Sample.Status.COMPLETED
        assert sample.session_id == session
    assert fill_sample(Sample(), rollouts.rows[WEATHER]).weight_versions == ["3", "4"]
