"""Policy versions against the real vLLM CPU engine (dev mode): the trainer publishes a new
version between two turns of one session, and the export shows each version on the tokens it
sampled."""

from __future__ import annotations

import uuid

import httpx
import pytest

from tests.integration.conftest import RealStack

pytestmark = pytest.mark.vllm


def publish(engine_url: str, version: str) -> None:
    response = httpx.post(
        f"{engine_url}/update_weight_version", json={"new_version": version}, timeout=30
    )
    if response.status_code == 404:
        pytest.skip("the engine is not in dev mode (VLLM_SERVER_DEV_MODE=1)")
    response.raise_for_status()


def test_a_version_published_between_two_turns_marks_the_right_spans(
    real_stack: RealStack,
) -> None:
    old, new = f"{uuid.uuid4().int % 10**6}", None
    new = str(int(old) + 1)
    with real_stack.http() as http:
        session = http.post("/sessions", json={"sampling": {"seed": 3}}).json()
        client = real_stack.openai(session)
        history = [{"role": "user", "content": "Say something."}]
        publish(real_stack.engine.url, old)
        first = client.chat.completions.create(model="m", messages=history, max_tokens=6)
        history += [
            {"role": "assistant", "content": first.choices[0].message.content or ""},
            {"role": "user", "content": "More."},
        ]
        publish(real_stack.engine.url, new)
        client.chat.completions.create(model="m", messages=history, max_tokens=6)

        trajectory = http.get(f"/sessions/{session['id']}/trajectory").json()
        [branch] = trajectory["branches"]
        [segment] = branch["segments"]
        turn1, turn2 = segment["turns"]
        assert segment["weight_versions"] == [
            {
                "version": old,
                "start": turn1["completion_span"][0],
                "end": turn1["completion_span"][1],
            },
            {
                "version": new,
                "start": turn2["completion_span"][0],
                "end": turn2["completion_span"][1],
            },
        ]
        assert segment["versions"] == [old, new] and segment["mixed_versions"]

        masked = http.get(
            f"/sessions/{session['id']}/trajectory", params={"min_weight_version": new}
        ).json()["branches"][0]["segments"][0]
        start, end = turn1["completion_span"]
        assert masked["loss_mask"][start:end] == [0] * (end - start)
        assert masked["stale_tokens"] == end - start

        info = http.get(f"/sessions/{session['id']}").json()
        assert info["turns_by_weight_version"] == {old: 1, new: 1}
        assert list(info["engine_weight_versions"].values()) == [new]
