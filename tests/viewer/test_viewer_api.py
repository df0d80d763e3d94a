"""The viewer's pages and JSON over HTTP, as a browser fetches them."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.api.stack import qwen3, reply
from tests.real_tokenizers import qwen3_dir
from tests.viewer.conftest import HOSTILE_USER, Live, drive_rich_session

# Independent of the server's tokenizer wrapper: the tokenizer file's own list.
SPECIAL_IDS = {
    token["id"]
    for token in json.loads((qwen3_dir() / "tokenizer.json").read_text())["added_tokens"]
    if token["special"]
}


@pytest.fixture(scope="module")
def rich(live: Live) -> str:
    drive_rich_session(live, "viewer-api")
    return "viewer-api"


def test_pages_are_served_from_the_package_with_a_strict_policy(live: Live) -> None:
    with httpx.Client(base_url=live.url) as http:
        assert http.get("/ui", follow_redirects=False).headers["location"] == "/ui/"
        for path in ("/ui/", "/ui/sessions/anything"):
            page = http.get(path)
            assert page.status_code == 200
            assert page.headers["content-type"].startswith("text/html")
            policy = page.headers["content-security-policy"]
            assert "script-src 'self'" in policy and "unsafe-inline" not in policy
            assert '<script src="/ui/static/viewer.js">' in page.text
        script = http.get("/ui/static/viewer.js")
        assert script.status_code == 200 and "textContent" in script.text
        assert "innerHTML" not in script.text  # untrusted text never becomes markup
        assert http.get("/ui/static/viewer.css").status_code == 200
        assert http.get("/ui/static/secret.py").status_code == 404
        assert http.get("/ui/sessions/bad id!").status_code == 400


def test_session_view_carries_pieces_the_tokenizer_agrees_with(live: Live, rich: str) -> None:
    view = httpx.get(f"{live.url}/ui/api/sessions/{rich}").json()
    assert view["turns"] == 4
    assert view["turns_by_kind"] == {"first": 1, "extend": 1, "retry": 1, "rewrite": 1}
    assert len(view["branches"]) == 3  # the answer, its retry, the rewritten history
    assert {t["turn_id"] for t in view["turn_tree"]} == {1, 2, 3, 4}
    tokenizer = qwen3().tokenizer
    reasons = []
    for branch in view["branches"]:
        for segment in branch["segments"]:
            ids = segment["token_ids"]
            assert len(segment["pieces"]) == len(segment["special"]) == len(ids)
            assert "".join(segment["pieces"]) == tokenizer.decode(ids)
            for token, piece, special in zip(
                ids, segment["pieces"], segment["special"], strict=True
            ):
                assert piece == tokenizer.decode([token])
                assert bool(special) == (token in SPECIAL_IDS)
            reasons.append(segment["start_reason"])
    assert "assistant_message_not_sampled" in reasons
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    first = view["branches"][0]["segments"][0]
    assert first["special"][first["token_ids"].index(im_start)] == 1
    assert HOSTILE_USER in "".join(first["pieces"])


def test_listing_pages_and_filters(live: Live, rich: str) -> None:
    with httpx.Client(base_url=live.url) as http:
        for name in ("list-a", "list-b", "list-c"):
            created = http.post("/sessions", json={"id": name, "metadata": {"task": name[-1]}})
            assert created.status_code == 201
        first = http.get("/ui/api/sessions", params={"q": "list-", "limit": 2}).json()
        assert first["total"] == 3
        assert [s["id"] for s in first["sessions"]] == ["list-c", "list-b"]  # newest first
        rest = http.get("/ui/api/sessions", params={"q": "list-", "limit": 2, "offset": 2})
        assert [s["id"] for s in rest.json()["sessions"]] == ["list-a"]
        only_b = http.get("/ui/api/sessions", params={"metadata": "task=b"}).json()
        assert [s["id"] for s in only_b["sessions"]] == ["list-b"]
        listed = http.get("/ui/api/sessions", params={"q": rich}).json()["sessions"][0]
        assert listed["turns"] == 4 and listed["breaks"] == {"assistant_message_not_sampled": 1}
        finished = http.post("/sessions/list-a/finish", json={"reward": 0.5})
        assert finished.status_code == 200, finished.text
        done = http.get("/ui/api/sessions", params={"q": "list-", "state": "finished"}).json()
        assert [(s["id"], s["state"], s["reward"]) for s in done["sessions"]] == [
            ("list-a", "finished", 0.5)
        ]
        running = http.get("/ui/api/sessions", params={"q": "list-", "state": "running"})
        assert [s["id"] for s in running.json()["sessions"]] == ["list-c", "list-b"]
        assert http.get("/ui/api/sessions", params={"state": "done"}).status_code in (400, 422)
        assert http.get("/ui/api/sessions", params={"limit": 0}).status_code == 400
        assert http.get("/ui/api/sessions", params={"metadata": "nokey"}).status_code == 400
        assert http.get("/ui/api/sessions/missing-session").status_code == 404


def test_the_viewer_and_the_export_select_by_metadata_alike(live: Live) -> None:
    """One selector, one semantics (`batch.parse_selector` + `batch.matches`): values
    compared as JSON text (`done=true` matches `{"done": true}`, `n=3` matches 3), a key the
    session lacks matches nothing (not even `key=None`). The viewer once compared Python
    text: `done=true` matched nothing there, and a missing key matched `None`."""
    cases = {
        "sel-done": {"done": True, "n": 3, "tag": "x"},
        "sel-open": {"done": False, "n": 3.5},
        "sel-bare": {"tag": "None"},
    }
    selectors = {
        "done=true": ["sel-done"],
        "done=false": ["sel-open"],
        "n=3": ["sel-done"],
        "n=3.5": ["sel-open"],
        "tag=x,done=true": ["sel-done"],
        "tag=None": ["sel-bare"],
        "done=None": [],
        "missing=": [],
    }
    with httpx.Client(base_url=live.url) as http:
        for session_id, metadata in cases.items():
            assert http.post("/sessions", json={"id": session_id, "metadata": metadata}).is_success
            live.double.script(reply("ok"))
            turn = http.post(
                f"/sessions/{session_id}/v1/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            )
            assert turn.status_code == 200, turn.text
            finished = http.post(f"/sessions/{session_id}/finish", json={"reward": 1.0})
            assert finished.status_code == 200, finished.text
        for selector, expected in selectors.items():
            page = http.get("/ui/api/sessions", params={"q": "sel-", "metadata": selector})
            assert page.status_code == 200, page.text
            viewer = sorted(s["id"] for s in page.json()["sessions"])
            listed = http.get("/sessions", params={"selector": selector}).json()["sessions"]
            finished_list = sorted(s["id"] for s in listed if s["id"].startswith("sel-"))
            exported = http.post("/sessions/export", json={"selector": selector})
            rows = (
                {json.loads(line)["session_id"] for line in exported.text.splitlines()}
                if exported.status_code == 200
                else set()
            )
            assert viewer == finished_list == sorted(expected), selector
            assert sorted(r for r in rows if r.startswith("sel-")) == sorted(expected), selector
