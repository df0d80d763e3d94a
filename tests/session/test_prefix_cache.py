"""Prefix-cache telemetry: each exported turn carries the engine's `cached_tokens` and
`stale_cache` (an earlier turn inside the cached prefix was sampled by another policy
version); the session shows its hit ratio, /metrics the totals."""

from __future__ import annotations

from typing import Any

from tests.engine_double import ScriptedCompletion
from tests.session.adversarial import END, tokens
from tests.session.conftest import Stack

SYSTEM = {"role": "system", "content": "You are a careful assistant. " * 20}


def _turns(stack: Stack, session_id: str) -> list[dict[str, Any]]:
    [branch] = stack.trajectory(session_id)["branches"]
    return [turn for segment in branch["segments"] for turn in segment["turns"]]


def test_cached_tokens_and_stale_cache_per_turn(stack: Stack) -> None:
    stack.double.prefix_cache = True
    client = stack.openai("cache")
    messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "One."}]
    versions = ["1", "1", "2"]
    for i, version in enumerate(versions):
        stack.double.weight_version = version
        stack.double.script(ScriptedCompletion(tokens(stack.model, f"Reply {i}", END)))
        stream = i == 1  # the streamed path reports it from the usage chunk
        if stream:
            for _ in client.chat.completions.create(model="m", messages=messages, stream=True):
                pass
        else:
            client.chat.completions.create(model="m", messages=messages)
        messages += [
            {"role": "assistant", "content": f"Reply {i}"},
            {"role": "user", "content": f"Next {i}."},
        ]
    prompts = stack.prompts()
    turns = _turns(stack, "cache")
    # The double caches 16-token blocks of every prompt + completion it computed: each
    # continued turn finds the previous request's prompt and reply cached.
    computed = [turns[i]["completion_span"][1] for i in range(len(turns))]
    assert [t["cached_tokens"] for t in turns] == [0] + [computed[i - 1] // 16 * 16 for i in (1, 2)]
    assert all(turns[i]["completion_span"][0] == len(prompts[i]) for i in range(3))
    # Turn 3 (version 2) reuses positions turns 1-2 computed under version 1.
    assert [t["stale_cache"] for t in turns] == [False, False, True]
    with stack.http() as http:
        summary = http.get("/sessions/cache").json()
        metrics = http.get("/metrics").text
    prompt_total = sum(len(p) for p in prompts)
    cached_total = sum(t["cached_tokens"] for t in turns)
    assert summary["prefix_cache_hit_ratio"] == round(cached_total / prompt_total, 4)
    assert f"tokenkeep_cached_prompt_tokens_total {float(cached_total)}" in metrics
    assert f"tokenkeep_prompt_tokens_total {float(prompt_total)}" in metrics
    assert "tokenkeep_stale_cache_turns_total 1.0" in metrics


def test_no_cache_report_means_null(stack: Stack) -> None:
    stack.double.script(ScriptedCompletion(tokens(stack.model, "Hi", END)))
    stack.openai("nocache").chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Hi"}]
    )
    [turn] = _turns(stack, "nocache")
    assert turn["cached_tokens"] is None and turn["stale_cache"] is False
    with stack.http() as http:
        assert http.get("/sessions/nocache").json()["prefix_cache_hit_ratio"] is None
