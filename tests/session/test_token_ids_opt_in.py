"""Token IDs in replies are opt-in for the harness APIs: a request field (vLLM's
`return_token_ids`) or a session setting turns them on; the trajectory export always has them."""

from __future__ import annotations

from tests.engine_double import ScriptedCompletion
from tests.session.conftest import Stack

USER = [{"role": "user", "content": "Hi"}]


def test_chat_replies_carry_token_ids_only_when_asked(memory_stack: Stack) -> None:
    stack = memory_stack
    reply = stack.model.encode("Hello.") + stack.model.stop_token_ids[:1]
    stack.double.default = lambda prompt, sampling: ScriptedCompletion(list(reply))
    with stack.http() as http:
        plain = http.post("/sessions/opt-default/v1/chat/completions", json={"messages": USER})
        assert plain.status_code == 200
        assert "prompt_token_ids" not in plain.json()
        assert "token_ids" not in plain.json()["choices"][0]

        asked = http.post(
            "/sessions/opt-request/v1/chat/completions",
            json={"messages": USER, "return_token_ids": True},
        ).json()
        assert asked["prompt_token_ids"] == stack.prompts()[-1]
        assert asked["choices"][0]["token_ids"] == reply

        created = http.post("/sessions", json={"id": "opt-session", "return_token_ids": True})
        assert created.status_code == 201
        by_session = http.post(
            "/sessions/opt-session/v1/chat/completions", json={"messages": USER}
        ).json()
        assert by_session["choices"][0]["token_ids"] == reply
        declined = http.post(
            "/sessions/opt-session/v1/chat/completions",
            json={"messages": USER, "return_token_ids": False},
        ).json()
        assert "prompt_token_ids" not in declined

    segment = stack.trajectory("opt-default")["branches"][0]["segments"][0]
    assert segment["token_ids"] == stack.prompts()[0] + reply
