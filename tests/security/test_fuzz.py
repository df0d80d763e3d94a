"""A bounded fuzzing pass over every endpoint in the live server's OpenAPI schema.

Hypothesis mutates a valid request of each endpoint (a field replaced by arbitrary JSON, a
field dropped or added, a body that is not JSON at all; values include integers past 64
bits, Infinity and NaN, and nesting thousands deep) and sends it with a credential drawn
from every role (none, wrong, `tk-<id>`, the session's key, the admin key). The server must
never answer 5xx, every error must be JSON, a refused request must leave the session it
named exactly as it was, and /healthz must answer within 100 ms throughout. Bounded by a time
budget (FUZZ_SECONDS) as well as an example count.
"""

from __future__ import annotations

import json
import os
import re
import time
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.security.conftest import LiveServer, assert_responsive, health_watch

FUZZ_SECONDS = float(os.environ.get("TOKENKEEP_FUZZ_SECONDS", "45"))
SESSION = "fuzz"
MESSAGES = [{"role": "user", "content": "hi"}]
BASES: dict[str, Any] = {
    "/chat/completions": {"model": "m", "messages": MESSAGES, "max_tokens": 3},
    "/messages": {"model": "m", "max_tokens": 3, "messages": MESSAGES},
    "/messages/count_tokens": {"model": "m", "messages": MESSAGES},
    "/responses": {"model": "m", "input": "hi", "max_output_tokens": 3},
    "/completions": {"model": "m", "prompt": [9707, 11], "max_tokens": 3},
    "/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [9707]},
    "/sessions": {"id": "fuzz-made", "ttl_seconds": 60},
}

_DEEP = re.compile(r'"\\u0000deep(\d+)"')


def _deepen(encoded: str) -> str:
    """JSON text with each deep-nesting marker replaced by that many nested arrays (built as
    text: `json.dumps` itself would hit Python's recursion limit)."""
    return _DEEP.sub(lambda m: "[" * int(m[1]) + "]" * int(m[1]), encoded)


# Integers past 64 bits, non-finite floats (`json.dumps` writes Infinity and NaN, as Python
# clients send them) and nesting past any parser's limit: what a store, the engine request's
# encoder or a recursive parser once failed on with a 500.
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()
    | st.text(max_size=40)
    | st.integers(min_value=100, max_value=3000).map(lambda depth: f"\x00deep{depth}"),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=12,
)


def _operations(server: LiveServer) -> list[tuple[str, str]]:
    with server.admin() as admin:
        schema = admin.get("/openapi.json").json()
    return sorted(
        (method.upper(), path)
        for path, item in schema["paths"].items()
        for method in item
        if method in ("get", "post", "delete")
    )


def _base(path: str) -> Any:
    for suffix, body in BASES.items():
        if path.endswith(suffix):
            return body
    return None


@st.composite
def _bodies(draw: st.DrawFn, base: Any) -> bytes | None:
    kind = draw(st.sampled_from(["valid", "replace", "drop", "add", "any", "bytes"]))
    if base is None or kind == "any":
        return _deepen(json.dumps(draw(json_values))).encode()
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    body = json.loads(json.dumps(base))
    if kind == "replace":
        body[draw(st.sampled_from(sorted(body)))] = draw(json_values)
    elif kind == "drop":
        body.pop(draw(st.sampled_from(sorted(body))))
    elif kind == "add":
        body[draw(st.text(max_size=12))] = draw(json_values)
    return _deepen(json.dumps(body)).encode()


@pytest.fixture(scope="module")
def target(keyed: LiveServer) -> LiveServer:
    keyed.create(SESSION)
    return keyed


def test_no_endpoint_answers_5xx_or_changes_a_session_it_refuses(target: LiveServer) -> None:
    operations = _operations(target)
    assert len(operations) >= 20
    keys = {
        "none": None,
        "wrong": "sk-wrong",
        "id": f"tk-{SESSION}",
        "session": target.sessions[SESSION],
        "admin": target.admin_key,
    }
    stop_at = time.monotonic() + FUZZ_SECONDS
    seen: dict[int, int] = {}
    turns = [target.turns(SESSION)]
    client = httpx.Client(base_url=target.url, timeout=60)

    @settings(
        max_examples=600,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(
        operation=st.sampled_from(operations),
        role=st.sampled_from(sorted(keys)),
        session=st.sampled_from([SESSION, "other", "x" * 129, "bad id", ""]),
        data=st.data(),
    )
    def fuzz(operation: tuple[str, str], role: str, session: str, data: st.DataObject) -> None:
        method, template = operation
        if method == "DELETE" and session == SESSION:
            session = "other"  # deleting the watched session is allowed, not interesting
        path = re.sub(r"\{session_id\}", session, template)
        headers = {"content-type": "application/json"}
        if keys[role]:
            headers["authorization"] = f"Bearer {keys[role]}"
        if path.startswith("/v1/") and data.draw(st.booleans()):
            headers["x-session-id"] = session
        body = data.draw(_bodies(_base(template))) if method == "POST" else None
        if time.monotonic() > stop_at:  # after drawing: generation must not depend on time
            return
        response = client.request(method, path, content=body, headers=headers)
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        assert response.status_code < 500, (method, path, body, response.text)
        turns.append(target.turns(SESSION))
        if response.status_code >= 400:
            assert response.headers["content-type"].startswith("application/json")
            assert turns[-1] == turns[-2], (method, path, body, response.text)

    with client, health_watch(target) as health:
        fuzz()
    assert_responsive(health)
    print(f"fuzz: {sum(seen.values())} requests in {FUZZ_SECONDS:.0f} s, by status {seen}")
    assert any(status < 300 for status in seen), seen
    assert any(400 <= status < 500 for status in seen), seen
