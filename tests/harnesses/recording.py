"""What a harness sent: an ASGI middleware that keeps every request, and the fixture files
made from them (`tests/fixtures/harnesses/`).

A harness test records the requests of its live run; with `TOKENKEEP_RECORD_HARNESS_FIXTURES=1`
it also writes them, with the completions the engine double sampled, as a fixture. The
fixtures are replayed without the harness (`test_recorded_shapes.py`), so the request shapes
of a harness version stay covered on machines that cannot install it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "harnesses"
# Headers that describe the client; credentials, hosts and lengths are left out.
KEPT_HEADERS = (
    "accept", "anthropic-beta", "anthropic-version", "content-type", "user-agent", "x-app",
    "x-stainless-lang", "x-stainless-package-version", "openai-beta",
)  # fmt: skip


class RequestRecorder:
    """ASGI middleware: appends each HTTP request (method, path, query, client headers, JSON
    body) to `records`, then serves it unchanged."""

    def __init__(self, app: Any, records: list[dict[str, Any]]) -> None:
        self.app = app
        self.records = records

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        self.records.append(
            {
                "method": scope["method"],
                "path": scope["path"],
                "query": scope["query_string"].decode(),
                "headers": {k: headers[k] for k in KEPT_HEADERS if k in headers},
                "auth": "x-api-key"
                if "x-api-key" in headers
                else ("bearer" if "authorization" in headers else None),
                "body": json.loads(body) if body else None,
            }
        )
        delivered = False

        async def replay() -> dict[str, Any]:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # afterwards: wait for the disconnect, as the app expects

        await self.app(scope, replay, send)


def save_fixture(
    name: str, harness: str, records: list[dict[str, Any]], completions: list[list[int]]
) -> None:
    """Write the fixture when asked to (`TOKENKEEP_RECORD_HARNESS_FIXTURES=1`)."""
    if os.environ.get("TOKENKEEP_RECORD_HARNESS_FIXTURES") != "1":
        return
    FIXTURES.mkdir(parents=True, exist_ok=True)
    fixture = {"harness": harness, "requests": records, "engine_completions": completions}
    (FIXTURES / f"{name}.json").write_text(json.dumps(fixture, indent=1, ensure_ascii=False))


def load_fixtures() -> list[tuple[str, dict[str, Any]]]:
    return [(path.stem, json.loads(path.read_text())) for path in sorted(FIXTURES.glob("*.json"))]
