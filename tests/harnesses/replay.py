"""Replaying a recorded harness fixture against a session server, without the harness."""

from __future__ import annotations

import json
from typing import Any

import httpx2

from tests.api.stack import Stack
from tests.engine_double import ScriptedCompletion

AUTH = {"x-api-key": "x-api-key", "bearer": "authorization"}


def harness_posts(fixture: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in fixture["requests"] if r["method"] == "POST"]


def with_session(path: str, session_id: str) -> str:
    """The recorded path, moved to another session."""
    parts = path.split("/")
    if parts[1] == "sessions":
        parts[2] = session_id
    return "/".join(parts)


async def replay(
    stack: Stack,
    fixture: dict[str, Any],
    session_id: str,
    bodies: list[dict[str, Any]] | None = None,
) -> list[httpx2.Response]:
    """Send the fixture's POSTs in order (optionally with edited bodies), scripting the
    completions the engine sampled when it was recorded. `previous_response_id` values
    are mapped to the ids this replay handed out."""
    stack.script(*_completions(fixture))
    posts = harness_posts(fixture)
    bodies = bodies or [post["body"] for post in posts]
    issued: dict[str, str] = {}
    answers = []
    async with httpx2.AsyncClient(transport=stack.transport(), base_url="http://t") as http:
        for post, body in zip(posts, bodies, strict=True):
            body = dict(body)
            if body.get("previous_response_id"):
                body["previous_response_id"] = issued[body["previous_response_id"]]
            key = f"tk-{session_id}"
            auth = {AUTH[post["auth"]]: key if post["auth"] == "x-api-key" else f"Bearer {key}"}
            answer = await http.post(
                with_session(post["path"], session_id),
                params=post["query"] or None,
                json=body,
                headers={**post["headers"], **auth},
            )
            answers.append(answer)
            recorded_id = _recorded_response_id(fixture, len(answers))
            if recorded_id and answer.status_code == 200:
                issued[recorded_id] = _response_id(answer)
    return answers


def _completions(fixture: dict[str, Any]) -> list[ScriptedCompletion]:
    return [ScriptedCompletion(ids) for ids in fixture["engine_completions"]]


def _recorded_response_id(fixture: dict[str, Any], position: int) -> str | None:
    """The response id the harness referred to after the `position`-th request, if any."""
    posts = harness_posts(fixture)
    if position < len(posts):
        return posts[position]["body"].get("previous_response_id")
    return None


def _response_id(answer: httpx2.Response) -> str:
    if answer.headers["content-type"].startswith("application/json"):
        return answer.json()["id"]
    last = [line for line in answer.text.splitlines() if line.startswith("data: ")][-1]
    return json.loads(last.removeprefix("data: "))["response"]["id"]
