"""vLLM's token-in `/inference/v1/generate` at session URLs (what verifiers' TrainClient posts),
over HTTP against the engine double: the turn is stored exactly as sent and sampled."""

from __future__ import annotations

from typing import Any

import pytest

from tests.engine_double import ScriptedCompletion
from tests.session.adversarial import END, tokens
from tests.session.conftest import Stack


def _render(stack: Stack, text: str) -> list[int]:
    return stack.model.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")


def _body(token_ids: list[int], **extra: Any) -> dict[str, Any]:
    # What renderers.client.generate (verifiers 0.4's TrainClient) sends.
    return {
        "model": "m",
        "token_ids": token_ids,
        "sampling_params": {
            "max_tokens": 50,
            "temperature": 1.0,
            "stop_token_ids": [151645],
            "logprobs": 1,
            "skip_special_tokens": False,
        },
        **extra,
    }


def test_generate_records_turns_and_exports_them_contiguous(stack: Stack) -> None:
    prompt1 = _render(stack, "Hi")
    sampled1 = ScriptedCompletion(tokens(stack.model, "Hel", "lo", END))
    stack.double.script(sampled1)
    with stack.http() as http:
        first = http.post(
            "/sessions/gen/inference/v1/generate", json=_body(prompt1, return_token_ids=True)
        )
        assert first.status_code == 200, first.text
        reply = first.json()
        (choice,) = reply["choices"]
        assert choice["token_ids"] == sampled1.token_ids
        assert choice["finish_reason"] == "stop"
        assert [e["logprob"] for e in choice["logprobs"]["content"]] == (sampled1.logprob_values())
        assert [e["token_id"] for e in choice["logprobs"]["content"]] == sampled1.token_ids
        assert [e["token"] for e in choice["logprobs"]["content"]] == [
            f"token_id:{t}" for t in sampled1.token_ids
        ]
        assert reply["prompt_token_ids"] == prompt1
        assert reply["tokenkeep"]["kind"] == "first"
        assert stack.prompts() == [prompt1]
        # The engine got the trainer's stop ids and sampling values.
        assert 151645 in stack.double.requests[0].sampling["stop_token_ids"]

        prompt2 = prompt1 + sampled1.token_ids + stack.model.encode("\n") + _render(stack, "More")
        sampled2 = ScriptedCompletion(tokens(stack.model, "Sure", END))
        stack.double.script(sampled2)
        # Session chosen by header on the session-less path, as with the other routes.
        second = http.post(
            "/inference/v1/generate", json=_body(prompt2), headers={"X-Session-ID": "gen"}
        )
        assert second.status_code == 200, second.text
        assert second.json()["tokenkeep"]["kind"] == "extend"
        assert "prompt_token_ids" not in second.json()
        assert second.json()["choices"][0]["token_ids"] == sampled2.token_ids
    assert stack.prompts()[-1] == prompt2

    (branch,) = stack.trajectory("gen")["branches"]
    (segment,) = branch["segments"]
    assert segment["token_ids"] == prompt2 + sampled2.token_ids
    sampled_at = [
        *range(len(prompt1), len(prompt1) + len(sampled1.token_ids)),
        *range(len(prompt2), len(prompt2) + len(sampled2.token_ids)),
    ]
    assert [i for i, m in enumerate(segment["loss_mask"]) if m] == sampled_at
    # The store keeps logprobs as float32.
    assert [segment["logprobs"][i] for i in sampled_at] == pytest.approx(
        sampled1.logprob_values() + sampled2.logprob_values(), abs=1e-6
    )


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"token_ids": []}, "token_ids"),
        ({"token_ids": [10**9]}, "prompt"),
        ({"token_ids": [1, 2], "stream": True}, "stream"),
        ({"token_ids": [1, 2], "sampling_params": {"max_tokens": 0}}, "sampling_params.max_tokens"),
        ({"token_ids": [1, 2], "sampling_params": {"n": 0}}, "sampling_params.n"),
        ({"token_ids": [1, 2], "sampling_params": {"logprobs": 5}}, "sampling_params.logprobs"),
        ({"token_ids": [1, 2], "sampling_params": {"best_of": 2}}, "sampling_params.best_of"),
        ({"token_ids": [1, 2], "features": {"mm_hashes": {}}}, "features"),
        ({"prompt": "text"}, "token_ids"),
    ],
)
def test_bad_generate_requests_store_nothing(stack: Stack, body: dict, param: str) -> None:
    prompt = _render(stack, "Hi")
    stack.double.script(ScriptedCompletion(tokens(stack.model, "Ok", END)))
    with stack.http() as http:
        ok = http.post("/sessions/gen-bad/inference/v1/generate", json=_body(prompt))
        assert ok.status_code == 200, ok.text
        before = stack.trajectory("gen-bad")
        response = http.post("/sessions/gen-bad/inference/v1/generate", json={"model": "m", **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert error["code"] == 400
    assert error["type"] == "invalid_request_error"
    assert error["message"]
    assert len(stack.double.requests) == 1
    assert stack.trajectory("gen-bad") == before
