"""Policy versions: stored with each turn, exported in segment coordinates over exactly the
sampled tokens, filtered by staleness, counted in metrics (engine double; the real engine is
in tests/integration/test_weight_versions_vllm.py)."""

from __future__ import annotations

import uuid
from typing import Any

import httpx

from session_server.engines import EngineClient
from tests.engine_double import EngineDouble, ScriptedCompletion
from tests.session.conftest import Stack
from tests.trajectory_values import assert_trajectory_values


def said(stack: Stack, text: str, **options: Any) -> ScriptedCompletion:
    return ScriptedCompletion(stack.model.encode(text) + stack.model.stop_token_ids[:1], **options)


def publish(double: EngineDouble, version: str) -> None:
    """What a trainer does after a weight update (vLLM dev mode)."""
    response = httpx.post(f"{double.url}/update_weight_version", json={"new_version": version})
    assert response.json() == {"success": True, "new_version": version}


def two_turns(stack: Stack, sid: str, *, stream: bool = False) -> None:
    """Turn 1 under version 1; the trainer publishes version 2; turn 2 under it."""
    stack.double.dev_mode = True
    client = stack.openai(sid)
    history: list[dict[str, Any]] = [{"role": "user", "content": "Count to three."}]
    publish(stack.double, "1")
    stack.double.script(said(stack, "One, two, three."))
    first = client.chat.completions.create(model="m", messages=history)
    history += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Again, slower."},
    ]
    publish(stack.double, "2")
    stack.double.script(said(stack, "One... two... three."))
    if stream:
        for _ in client.chat.completions.create(model="m", messages=history, stream=True):
            pass
    else:
        client.chat.completions.create(model="m", messages=history)


def only_segment(trajectory: dict[str, Any]) -> dict[str, Any]:
    [branch] = trajectory["branches"]
    [segment] = branch["segments"]
    return segment


def test_a_version_change_between_turns_shows_on_the_sampled_spans(stack: Stack) -> None:
    sid = uuid.uuid4().hex
    two_turns(stack, sid)
    trajectory = stack.trajectory(sid)
    assert_trajectory_values(trajectory, stack.double.samples, every_sample=True)
    segment = only_segment(trajectory)
    first, second = segment["turns"]
    assert segment["weight_versions"] == [
        {"version": "1", "start": first["completion_span"][0], "end": first["completion_span"][1]},
        {
            "version": "2",
            "start": second["completion_span"][0],
            "end": second["completion_span"][1],
        },
    ]
    assert first["weight_versions"] == segment["weight_versions"][:1]
    assert segment["versions"] == ["1", "2"]
    assert segment["mixed_versions"] is True
    # Exactly the sampled positions: the spans are where the loss mask is 1.
    covered = {i for s in segment["weight_versions"] for i in range(s["start"], s["end"])}
    assert covered == {i for i, m in enumerate(segment["loss_mask"]) if m == 1}


def test_streamed_turns_keep_their_versions(memory_stack: Stack) -> None:
    sid = uuid.uuid4().hex
    two_turns(memory_stack, sid, stream=True)
    trajectory = memory_stack.trajectory(sid)
    assert only_segment(trajectory)["versions"] == ["1", "2"]
    assert_trajectory_values(trajectory, memory_stack.double.samples, every_sample=True)


def test_a_turn_sampled_across_an_update_keeps_both_spans(memory_stack: Stack) -> None:
    sid = uuid.uuid4().hex
    completion = said(memory_stack, "Halfway through an update.")
    n = len(completion.token_ids)
    completion.weight_versions = [("4", 0, 3), ("5", 3, n)]
    memory_stack.double.script(completion)
    memory_stack.openai(sid).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Go."}]
    )
    trajectory = memory_stack.trajectory(sid)
    assert_trajectory_values(trajectory, memory_stack.double.samples, every_sample=True)
    segment = only_segment(trajectory)
    start = segment["turns"][0]["completion_span"][0]
    assert segment["weight_versions"] == [
        {"version": "4", "start": start, "end": start + 3},
        {"version": "5", "start": start + 3, "end": start + n},
    ]
    assert segment["mixed_versions"] is True


def test_staleness_masks_or_drops_old_tokens(stack: Stack) -> None:
    sid = uuid.uuid4().hex
    two_turns(stack, sid)
    with stack.http() as http:
        masked = http.get(f"/sessions/{sid}/trajectory", params={"min_weight_version": 2}).json()
        dropped = http.get(
            f"/sessions/{sid}/trajectory", params={"min_weight_version": 2, "stale": "drop"}
        ).json()
        fresh = http.get(f"/sessions/{sid}/trajectory", params={"min_weight_version": 1}).json()
        bad = http.get(f"/sessions/{sid}/trajectory", params={"min_weight_version": "two"})
    segment = only_segment(masked)
    old, new = segment["turns"]
    start, end = old["completion_span"]
    assert segment["loss_mask"][start:end] == [0] * (end - start)
    assert segment["stale_tokens"] == end - start == old["stale_tokens"]
    assert new["stale_tokens"] == 0
    assert segment["loss_mask"][new["completion_span"][0] : new["completion_span"][1]] == [1] * (
        new["completion_span"][1] - new["completion_span"][0]
    )
    assert dropped["branches"] == []  # its only segment holds stale tokens
    assert only_segment(fresh)["stale_tokens"] == 0
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "query.min_weight_version"


def test_session_and_metrics_report_versions(memory_stack: Stack) -> None:
    sid = uuid.uuid4().hex
    two_turns(memory_stack, sid)
    with memory_stack.http() as http:
        session = http.get(f"/sessions/{sid}").json()
        metrics = http.get("/metrics").text
    assert session["turns_by_weight_version"] == {"1": 1, "2": 1}
    url = memory_stack.double.url
    assert session["engine_weight_versions"] == {url: "2"}
    assert 'tokenkeep_turns_by_weight_version_total{version="2"} 1.0' in metrics
    assert f'tokenkeep_engine_weight_version{{replica="{url}",version="2"}} 1.0' in metrics


async def test_the_engine_client_reads_weight_info_in_dev_mode(engine_double: EngineDouble) -> None:
    engine_double.dev_mode = True
    engine_double.weight_version = "17"
    async with EngineClient([engine_double.url], model=engine_double.model) as client:
        assert client.replicas[0].weight_version == "17"
    engine_double.dev_mode = False  # vLLM without VLLM_SERVER_DEV_MODE: 404
    async with EngineClient([engine_double.url], model=engine_double.model) as client:
        assert client.replicas[0].weight_version is None
        assert client.replicas[0].weight_info is False
