"""Client-supplied normalization rules cannot stop a replica: they run on RE2 (linear time),
what RE2 cannot run in linear time is refused, and a request whose rules could still scan too
much text is refused before any scanning."""

from __future__ import annotations

import httpx

from tests.security.conftest import (
    LiveServer,
    assert_responsive,
    chat_body,
    health_watch,
    in_thread,
)


def _chat(server: LiveServer, session_id: str, body: dict) -> httpx.Response:
    with server.client(server.sessions[session_id]) as client:
        return client.post(f"/sessions/{session_id}/v1/chat/completions", json=body)


def test_catastrophic_backtracking_pattern_runs_in_linear_time(keyed: LiveServer) -> None:
    """The issue's attack: `(a+)+$` against 28 a's and a `!` froze the replica for 30 s."""
    keyed.create("redos", normalization=[{"pattern": "(a+)+$"}])
    with health_watch(keyed) as health:
        answer = in_thread(lambda: _chat(keyed, "redos", chat_body("hi", system="a" * 28 + "!")))
        response = answer()
    assert response.status_code == 200, response.text
    assert_responsive(health)
    assert keyed.turns("redos") == 1


def test_quadratic_rule_on_big_text_is_refused_and_changes_nothing(keyed: LiveServer) -> None:
    """`(?:a*b|a)` makes every RE2 search scan to the end of the text: each rule's searches
    per text are capped and the request's worst case is priced before anything runs."""
    keyed.create("quadratic", normalization=[{"pattern": "(?:a*b|a)"}] * 16)
    assert _chat(keyed, "quadratic", chat_body("first")).status_code == 200
    with health_watch(keyed) as health:
        answer = in_thread(lambda: _chat(keyed, "quadratic", chat_body("a" * 400_000)))
        response = answer()
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "normalization" in error["message"]
    assert_responsive(health)
    assert keyed.turns("quadratic") == 1


def test_quadratic_rule_within_the_budget_is_bounded(keyed: LiveServer) -> None:
    """Within the budget the rule runs (8 matches at most); the text is then too many
    tokens for the 4096-token context, which is a clean 400 as well."""
    keyed.create("quadratic-small", normalization=[{"pattern": "(?:a*b|a)"}])
    with health_watch(keyed) as health:
        answer = in_thread(lambda: _chat(keyed, "quadratic-small", chat_body("a" * 50_000)))
        response = answer()
    assert response.status_code in (200, 400), response.text
    if response.status_code == 400:
        assert response.json()["error"]["type"] == "invalid_request_error"
    assert_responsive(health)


def test_patterns_re2_cannot_run_linearly_are_refused(keyed: LiveServer) -> None:
    with keyed.admin() as client:
        for pattern in ("(a)\\1", "(?=a)b", "a" * 600):
            response = client.post(
                "/sessions", json={"id": "bad-rule", "normalization": [{"pattern": pattern}]}
            )
            assert response.status_code == 400, response.text
            assert response.json()["error"]["type"] == "invalid_request_error"
        too_many = [{"pattern": "x"}] * 17
        response = client.post("/sessions", json={"id": "bad-rule", "normalization": too_many})
        assert response.status_code == 400
        assert client.get("/sessions/bad-rule").status_code == 404


def test_text_that_cannot_fit_the_context_is_refused_before_tokenizing(keyed: LiveServer) -> None:
    """4096-token context, longest Qwen3 token 128 characters: 600k characters cannot fit."""
    keyed.create("huge-text")
    with keyed.client(keyed.sessions["huge-text"]) as client:
        response = client.post(
            "/sessions/huge-text/v1/messages",
            json={
                "model": "m",
                "max_tokens": 5,
                "messages": [{"role": "user", "content": "x" * 600_000}],
            },
        )
        assert response.status_code == 400, response.text
        assert response.json()["type"] == "error"
        assert "cannot fit" in response.json()["error"]["message"]
        # Many tiny messages: each takes at least one token, whatever its text.
        response = client.post(
            "/sessions/huge-text/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "a"}] * 5000},
        )
        assert response.status_code == 400, response.text
        assert "5000 messages cannot fit" in response.json()["error"]["message"]
    assert keyed.turns("huge-text") == 0
