"""Which earlier turn a request continues: retries, forks, n > 1, streaming, rewrites."""

from __future__ import annotations

import time
from typing import Any

import httpx
import openai
import redis

from session_server.conversation import Message
from session_server.store.memory import MemoryStore
from session_server.store.redis import RedisStore
from tests.engine_double import ScriptedCompletion
from tests.session.adversarial import END, TOOLS, naive_prompt, reply_as_harness_sends, tokens
from tests.session.conftest import Stack
from tests.suffix_reference import assert_suffix
from tests.trajectory_values import assert_trajectory_values

USER = [{"role": "user", "content": "What is the weather in Paris?"}]


def _say(stack: Stack, *pieces: Any) -> list[int]:
    ids = tokens(stack.model, *pieces, END)
    stack.double.script(ScriptedCompletion(ids))
    return ids


def _summary(stack: Stack, session_id: str) -> dict[str, Any]:
    with stack.http() as client:
        return client.get(f"/sessions/{session_id}").json()


def test_retry_is_a_sibling_with_the_same_prompt(stack: Stack) -> None:
    client = stack.openai("retry")
    _say(stack, "Sun", "ny.")
    first = client.chat.completions.create(model="m", messages=USER)
    _say(stack, "Rain", "y.")
    again = client.chat.completions.create(model="m", messages=USER)
    assert again.model_extra["tokenkeep"]["kind"] == "retry"
    p1, p2 = stack.prompts()
    assert p1 == p2
    summary = _summary(stack, "retry")
    assert summary["turns"] == 2 and summary["branches"] == 2 and summary["breaks"] == {}
    assert first.choices[0].message.content == "Sunny."


def test_n2_each_choice_is_a_turn_and_either_can_be_continued(stack: Stack) -> None:
    client = stack.openai("n2")
    a = tokens(stack.model, "Option", " A", END)
    b = tokens(stack.model, "Opt", "ion B", END)
    stack.double.script(ScriptedCompletion(a), ScriptedCompletion(b))
    both = client.chat.completions.create(
        model="m", messages=USER, n=2, extra_body={"return_token_ids": True}
    )
    assert [c.token_ids for c in both.choices] == [a, b]
    _say(stack, "OK")
    chosen = reply_as_harness_sends(both.choices[1].message)
    follow = client.chat.completions.create(
        model="m", messages=[*USER, chosen, {"role": "user", "content": "Why?"}]
    )
    assert follow.model_extra["tokenkeep"]["kind"] == "extend"
    p1, p2 = stack.prompts()
    assert p2[: len(p1) + len(b)] == p1 + b
    trajectory = stack.trajectory("n2")
    assert len(trajectory["branches"]) == 2
    kept = next(br for br in trajectory["branches"] if len(br["segments"][0]["turns"]) == 2)
    assert kept["segments"][0]["token_ids"][: len(p1) + len(b)] == p1 + b


def test_fork_continues_an_inner_turn(stack: Stack) -> None:
    client = stack.openai("fork")
    call = _say(
        stack,
        "<tool_call>",
        "\n",
        '{"name":"get_weather","arguments":{"city":"Paris"}}',
        "\n",
        "</tool_call>",
    )
    first = client.chat.completions.create(model="m", messages=USER, tools=TOOLS)
    reply = reply_as_harness_sends(first.choices[0].message)
    call_id = first.choices[0].message.tool_calls[0].id
    sent = []
    for result in ('{"temp_c": 21}', '{"error": "timeout"}'):
        _say(stack, "Done")
        messages = [*USER, reply, {"role": "tool", "tool_call_id": call_id, "content": result}]
        sent.append(messages)
        client.chat.completions.create(model="m", tools=TOOLS, messages=messages)
    trajectory = stack.trajectory("fork")
    p1, p2, p3 = stack.prompts()
    # Each branch continues the tool call with the template's own tokens for ITS result.
    for prompt, messages in zip((p2, p3), sent, strict=True):
        assert_suffix(stack.model, prompt, p1 + call, call, messages, TOOLS)
    assert_trajectory_values(trajectory, stack.double.samples, every_sample=True)
    kinds = [t["kind"] for br in trajectory["branches"] for t in br["segments"][0]["turns"]]
    assert kinds.count("fork") == 1 and kinds.count("extend") == 1


def test_a_tool_call_with_edited_arguments_is_not_the_sampled_turn(stack: Stack) -> None:
    """A harness that rewrites a call's arguments (not only their spelling) sends history
    the model did not sample: the engine must get the request's call, not the stored one."""
    client = stack.openai("edited-args")
    call = _say(
        stack,
        "<tool_call>",
        "\n",
        '{"name":"get_weather","arguments":{"city":"Paris"}}',
        "\n",
        "</tool_call>",
    )
    first = client.chat.completions.create(model="m", messages=USER, tools=TOOLS)
    echoed = reply_as_harness_sends(first.choices[0].message)
    echoed["tool_calls"][0]["function"]["arguments"] = '{"city": "Lyon"}'
    result = {"role": "tool", "tool_call_id": echoed["tool_calls"][0]["id"], "content": "21C"}
    _say(stack, "Done")
    second = client.chat.completions.create(
        model="m", tools=TOOLS, messages=[*USER, echoed, result]
    )
    p1, p2 = stack.prompts()
    assert p2[: len(p1) + len(call)] != p1 + call  # the sampled Paris call is not continued
    sent = stack.model.decode(p2)
    assert '"Lyon"' in sent and '"Paris"' not in sent
    assert second.model_extra["tokenkeep"]["kind"] == "rewrite"
    assert_trajectory_values(stack.trajectory("edited-args"), stack.double.samples)


def test_edited_history_starts_a_new_segment_with_its_reason(stack: Stack) -> None:
    client = stack.openai("rewrite")
    _say(stack, "Sunny")
    first = client.chat.completions.create(model="m", messages=USER)
    _say(stack, "Fine")
    compacted = [{"role": "user", "content": "Summary of earlier chat: it was sunny. Now?"}]
    second = client.chat.completions.create(model="m", messages=compacted)
    assert second.model_extra["tokenkeep"] == {
        "kind": "rewrite",
        "break_reason": "history_mismatch",
        "turn_ids": [2],
    }
    _say(stack, "Again")
    edited = {"role": "assistant", "content": "Cloudy (edited by the harness)"}
    third = client.chat.completions.create(
        model="m", messages=[*USER, edited, {"role": "user", "content": "Sure?"}]
    )
    assert third.model_extra["tokenkeep"]["break_reason"] == "history_mismatch"
    _say(stack, "Yes")
    injected = client.chat.completions.create(
        model="m",
        messages=[
            *USER,
            reply_as_harness_sends(first.choices[0].message),
            {"role": "user", "content": "Sure?"},
            {"role": "assistant", "content": "Let me think (written by the harness)."},
            {"role": "user", "content": "Go on"},
        ],
    )
    assert injected.model_extra["tokenkeep"]["break_reason"] == "assistant_message_not_sampled"
    summary = _summary(stack, "rewrite")
    assert summary["breaks"] == {"history_mismatch": 2, "assistant_message_not_sampled": 1}
    assert summary["segments"] == 4
    with stack.http() as http:
        metrics = http.get("/metrics").text
    assert 'tokenkeep_segment_breaks_total{reason="history_mismatch"}' in metrics
    trajectory = stack.trajectory("rewrite")
    reasons = sorted(s["start_reason"] for br in trajectory["branches"] for s in br["segments"])
    # t1 -> t4 (new segment), t2 and t3 are roots of their own
    assert reasons == [
        "assistant_message_not_sampled",
        "first",
        "history_mismatch",
        "history_mismatch",
    ]


def test_streaming_reasoning_content_and_tool_calls(stack: Stack) -> None:
    client = stack.openai("stream")
    sampled = _say(
        stack,
        "<think>",
        "\nNeed ",
        "weather.\n",
        "</think>",
        "\n\n",
        "Check",
        "ing.",
        "\n",
        "<tool_call>",
        "\n",
        '{"name": "get_weather", "arguments": {"city": "Paris"}}',
        "\n",
        "</tool_call>",
    )
    stream = client.chat.completions.create(
        model="m",
        messages=USER,
        tools=TOOLS,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"return_token_ids": True},
    )
    content = reasoning = ""
    calls: dict[int, dict[str, str]] = {}
    streamed_tokens: list[int] = []
    finish = usage = None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            streamed_tokens += (choice.model_extra or {}).get("token_ids") or []
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"name": "", "arguments": "", "id": ""})
                entry["id"] = call.id or entry["id"]
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    assert streamed_tokens == sampled
    assert reasoning.strip() == "Need weather."
    assert content.strip() == "Checking."
    assert finish == "tool_calls"
    assert [c["name"] for c in calls.values()] == ["get_weather"]
    assert usage is not None and usage.completion_tokens == len(sampled)
    _say(stack, "Warm")
    client.chat.completions.create(
        model="m",
        tools=TOOLS,
        messages=[
            *USER,
            {
                "role": "assistant",
                "content": content,
                "tool_calls": [
                    {
                        "id": c["id"],
                        "type": "function",
                        "function": {"name": c["name"], "arguments": c["arguments"]},
                    }
                    for c in calls.values()
                ],
            },
            {"role": "tool", "tool_call_id": calls[0]["id"], "content": "21C"},
        ],
    )
    p1, p2 = stack.prompts()
    assert p2[: len(p1) + len(sampled)] == p1 + sampled


def test_session_from_header_or_api_key(stack: Stack) -> None:
    _say(stack, "One")
    _say(stack, "Two")
    by_header = openai.OpenAI(
        base_url=f"{stack.url}/v1",
        api_key="x",
        max_retries=0,
        default_headers={"X-Session-ID": "hdr"},
    )
    by_key = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="tk-hdr", max_retries=0)
    first = by_header.chat.completions.create(model="m", messages=USER)
    second = by_key.chat.completions.create(
        model="m",
        messages=[
            *USER,
            reply_as_harness_sends(first.choices[0].message),
            {"role": "user", "content": "More"},
        ],
    )
    assert second.model_extra["tokenkeep"]["kind"] == "extend"
    assert _summary(stack, "hdr")["turns"] == 2
    models = by_key.models.list()
    assert [m.id for m in models.data] == [stack.double.model]


def test_session_overrides_win_and_every_sampling_parameter_is_explicit(stack: Stack) -> None:
    with stack.http() as http:
        created = http.post("/sessions", json={"id": "ovr", "sampling": {"temperature": 0.25}})
        assert created.status_code == 201
        assert created.json()["openai_base_url"].endswith("/sessions/ovr/v1")
    _say(stack, "x")
    stack.openai("ovr").chat.completions.create(
        model="m", messages=USER, temperature=1.3, max_tokens=10_000_000, seed=7
    )
    sampling = stack.double.requests[-1].sampling
    assert sampling["temperature"] == 0.25
    assert sampling["seed"] == 7
    for key in ("top_p", "top_k", "min_p", "max_tokens", "stop_token_ids"):
        assert key in sampling
    assert sampling["max_tokens"] == stack.double.max_model_len - len(stack.prompts()[-1])


def test_jsonl_export_and_delete(stack: Stack) -> None:
    _say(stack, "Hi")
    stack.openai("jsonl").chat.completions.create(model="m", messages=USER)
    with stack.http() as http:
        lines = http.get("/sessions/jsonl/trajectory", params={"format": "jsonl"}).text
        assert len(lines.strip().splitlines()) == 1
        assert http.delete("/sessions/jsonl").status_code == 204
        assert http.get("/sessions/jsonl").status_code == 404
        assert http.delete("/sessions/jsonl").status_code == 404


def test_tokenize_and_detokenize_match_the_served_template(stack: Stack) -> None:
    with httpx.Client(base_url=stack.url) as http:
        # The reference is the chat template itself (as vLLM's chat endpoint applies it),
        # not the renderer the server uses.
        rendered = http.post("/tokenize", json={"messages": USER}).json()
        assert rendered["tokens"] == naive_prompt(stack.model, USER, None)
        with_tools = http.post("/tokenize", json={"messages": USER, "tools": TOOLS})
        assert with_tools.json()["tokens"] == naive_prompt(stack.model, USER, TOOLS)
        text = http.post("/detokenize", json={"tokens": rendered["tokens"]}).json()["prompt"]
        assert text.endswith("<|im_start|>assistant\n")
        bad = http.post("/detokenize", json={"tokens": [10**9]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_client_hanging_up_mid_stream_stops_generation_and_stores_nothing(stack: Stack) -> None:
    # 2000 tokens at 20 ms each: the stream would run 40 s; the client leaves after one.
    stack.double.script(ScriptedCompletion(tokens(stack.model, *(["tok"] * 2000), END)))
    stack.double.chunk_delay_s = 0.02
    with (
        httpx.Client(base_url=stack.url, timeout=30) as http,
        http.stream(
            "POST", "/sessions/hangup/v1/chat/completions", json={"messages": USER, "stream": True}
        ) as response,
    ):
        assert next(line for line in response.iter_lines() if line.startswith("data:"))
    deadline = time.monotonic() + 60  # a bound for a hung test, not a timing claim
    while stack.double.streams_ended == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert stack.double.streams_ended == 1
    assert stack.double.streams_abandoned == 1, "the engine kept generating for a gone client"
    assert _summary(stack, "hangup")["turns"] == 0


def test_token_aware_client_keeps_its_tokens_where_no_stored_turn_matches(stack: Stack) -> None:
    """A client that resends the tokens of its last turn (as NeMo-RL style clients do) keeps
    them even in a session that has never seen them (e.g. after the session expired)."""
    prompt = stack.model.render_prompt([Message("user", USER[0]["content"])], [])
    sampled = tokens(stack.model, "Sun", "ny", END)
    _say(stack, "Warm")
    reply = stack.openai("client-tokens").chat.completions.create(
        model="m",
        messages=[
            *USER,
            {
                "role": "assistant",
                "content": "Sunny",
                "prompt_token_ids": prompt,
                "generation_token_ids": sampled,
            },
            {"role": "user", "content": "And tomorrow?"},
        ],
    )
    assert reply.model_extra["tokenkeep"]["kind"] == "first"
    (sent,) = stack.prompts()
    assert sent[: len(prompt) + len(sampled)] == prompt + sampled
    assert stack.model.decode(sent[len(prompt) + len(sampled) :]).count("And tomorrow?") == 1


def _expire_in_store(stack: Stack, redis_url: str, session_id: str) -> None:
    """Make the store forget a session the way its TTL would, without waiting for one: the
    server process keeps its cached metadata, as it does when a TTL runs out."""
    store = stack.service.store
    if isinstance(store, MemoryStore):
        base = time.monotonic()
        store._clock = lambda: time.monotonic() - base + 10**7  # the store's time moves on
        return
    assert isinstance(store, RedisStore)
    client = redis.Redis.from_url(redis_url)
    keys = store.session_keys(session_id)
    for key in reversed(keys):  # the meta key last: once it is gone, all are
        client.pexpire(key, 1)
    deadline = time.monotonic() + 60  # a bound for a hung Redis, not a timing claim
    while client.exists(keys[0]):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    client.close()


def test_an_expired_session_starts_again_on_first_use(stack: Stack, redis_server: str) -> None:
    with stack.http() as http:
        assert http.post("/sessions", json={"id": "brief", "ttl_seconds": 3600}).status_code == 201
    _say(stack, "One")
    stack.openai("brief").chat.completions.create(model="m", messages=USER)
    _expire_in_store(stack, redis_server, "brief")
    _say(stack, "Two")
    again = stack.openai("brief").chat.completions.create(model="m", messages=USER)
    assert again.model_extra["tokenkeep"]["kind"] == "first"
    assert _summary(stack, "brief")["turns"] == 1
