"""Publishing a policy (`POST /policy`) to SGLang replicas, through a real `tokenkeep serve`
app (`--engine sglang`) in front of two SGLang engine doubles.

SGLang cannot run here (its CPU build needs `sgl-kernel`'s CPU wheel, which PyPI does not
ship), so these run against `tests/engine_double_sglang.py`: SGLang 0.5.x's control
endpoints (`/pause_generation`, `/update_weights_from_disk`, `/flush_cache`,
`/update_weight_version`, `/get_weight_version`, `/continue_generation`) as sgl-project/sglang
defines them at commit 0025436 (`python/sglang/srt/entrypoints/http_server.py`). The same
scenarios on real vLLM CPU replicas are `tests/integration/test_policy_vllm.py`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from session_server.app import create_app
from session_server.settings import Settings
from session_server.splice import ChatModel
from tests.engine_double import ScriptedCompletion
from tests.engine_double_sglang import SglangDouble
from tests.live_server import serving
from tests.policy.test_checkpoint import CONFIG, TENSORS, write_checkpoint
from tests.session.adversarial import END, tokens
from tests.trajectory_values import version_labels

ADMIN_KEY = "admin-key-for-tests"


@dataclass
class Fleet:
    url: str
    doubles: list[SglangDouble]
    model: ChatModel
    root: Path

    def admin(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=60
        )

    def checkpoint(self, name: str) -> Path:
        return write_checkpoint(self.root / name, CONFIG, TENSORS)

    def publish(self, version: int, path: Path, pause: str = "abort") -> httpx.Response:
        body = {"version": version, "source": {"path": str(path)}, "pause": pause}
        with self.admin() as http:
            return http.post("/policy", json=body)

    def policy(self) -> dict[str, Any]:
        with self.admin() as http:
            return http.get("/policy").json()

    def states(self) -> dict[str, tuple[str, str | None]]:
        return {r["engine"]: (r["state"], r["version"]) for r in self.policy()["replicas"]}

    def session(self) -> dict[str, Any]:
        with self.admin() as http:
            return http.post("/sessions", json={}).json()

    def turn(self, session: dict[str, Any]) -> httpx.Response:
        body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
        return httpx.post(
            session["openai_base_url"] + "/chat/completions",
            json=body,
            headers={"authorization": f"Bearer {session['api_key']}"},
            timeout=60,
        )

    def versions(self, session_id: str) -> list[str]:
        with self.admin() as http:
            return version_labels(http.get(f"/sessions/{session_id}/trajectory").json())


@pytest.fixture
def fleet(qwen3_model: ChatModel, tmp_path: Path) -> Iterator[Fleet]:
    doubles = [SglangDouble().start(), SglangDouble().start()]
    answer = tokens(qwen3_model, "Hello", END)
    for double in doubles:
        double.default = lambda _prompt, _sampling: ScriptedCompletion(list(answer))
    settings = Settings(
        engine_urls=[d.url for d in doubles],
        engine_kind="sglang",
        model=doubles[0].model,
        tokenizer=str(qwen3_model.tokenizer.name_or_path),
        context_length=doubles[0].max_model_len,
        admin_key=ADMIN_KEY,
        engine_health_interval_s=0.1,
    )
    try:
        with serving(create_app(settings)) as url:
            yield Fleet(url, doubles, qwen3_model, tmp_path)
    finally:
        for double in doubles:
            double.stop()


def _wait_for(condition: Any, what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_an_abort_publish_moves_both_sglang_replicas(fleet: Fleet) -> None:
    """Pause (abort-all: SGLang's only pause), reload with the version in the same call,
    flush the radix cache, the version set without SGLang's default abort-all, resume; the
    next turns are sampled (and stored) under the new version."""
    path = fleet.checkpoint("step-1")
    published = fleet.publish(1, path, "abort")
    assert published.status_code == 200, published.text
    answer = published.json()
    assert answer["version"] == "1"
    assert answer["requests"] == {"aborted": 0}
    assert [r["state"] for r in answer["replicas"]] == ["serving", "serving"]
    assert {r["checksum"] for r in answer["replicas"]} == {None}  # SGLang has no checker
    for double in fleet.doubles:
        assert [p for p, _ in double.control] == [
            "/pause_generation",
            "/update_weights_from_disk",
            "/flush_cache",
            "/update_weight_version",
            "/continue_generation",
        ]
        bodies = dict(double.control)
        assert bodies["/pause_generation"] == {}  # 0025436's pause reads no body
        assert bodies["/update_weights_from_disk"] == {
            "model_path": str(path),
            "abort_all_requests": False,
            "weight_version": "1",
        }
        assert bodies["/update_weight_version"] == {
            "new_version": "1",
            "abort_all_requests": False,
        }
        assert (double.loaded, double.weight_version, double.paused) == (str(path), "1", False)
        assert double.flushes == 2  # the reload's own flush, then the explicit one
    session = fleet.session()
    assert fleet.turn(session).status_code == 200
    assert fleet.versions(session["id"]) == ["1"]
    assert fleet.policy()["version"] == "1"


def test_a_wait_publish_sends_no_pause_and_sets_the_version_with_the_weights(
    fleet: Fleet,
) -> None:
    """`wait`: no /pause_generation (it would abort); the reload's writer lock lets the turns
    in flight finish on the old weights, and the version comes with the weights."""
    path = fleet.checkpoint("step-1")
    published = fleet.publish(1, path, "wait")
    assert published.status_code == 200, published.text
    for double in fleet.doubles:
        paths = [p for p, _ in double.control]
        assert "/pause_generation" not in paths and "/flush_cache" not in paths
        assert dict(double.control)["/update_weights_from_disk"]["weight_version"] == "1"
        assert double.weight_version == "1"
        assert "*" not in double.aborted  # nothing on the engine was aborted


def test_a_keep_publish_is_refused_before_any_sglang_engine_is_touched(fleet: Fleet) -> None:
    """SGLang (0025436) cannot freeze the turns in flight and resume them on the new
    weights: `keep` is 501, not silently turned into an abort."""
    published = fleet.publish(1, fleet.checkpoint("step-1"), "keep")
    assert published.status_code == 501, published.text
    assert "keep" in published.text
    for double in fleet.doubles:
        assert double.control == []
        assert double.weight_version == "default"
    assert fleet.policy()["version"] is None


def test_a_replica_whose_update_fails_is_fenced_and_gets_no_turns(fleet: Fleet) -> None:
    """Replica B cannot read the folder (SGLang answers 400, success false, and keeps its
    weights): the publish is 502 naming it, A serves the new version, B is fenced and every
    turn goes to A."""
    good, bad = fleet.doubles
    path = fleet.checkpoint("step-1")
    bad.unreadable.add(str(path))
    published = fleet.publish(1, path, "abort")
    assert published.status_code == 502, published.text
    assert bad.url in published.json()["error"]["message"]
    assert "Failed to get weights iterator" in published.json()["error"]["message"]
    states = {r["engine"]: r["state"] for r in published.json()["replicas"]}
    assert states == {good.url: "serving", bad.url: "fenced"}
    assert bad.weight_version == "default" and bad.paused  # left paused, not rolled back
    before = len(bad.requests)
    sessions = [fleet.session() for _ in range(6)]
    for session in sessions:
        assert fleet.turn(session).status_code == 200
        assert fleet.versions(session["id"]) == ["1"]
    assert len(bad.requests) == before
    time.sleep(0.5)  # follow rounds keep it fenced: its version is still behind
    assert fleet.states()[bad.url][0] in {"fenced", "behind"}


def test_a_replica_restarted_at_the_base_version_is_caught_up_before_serving(
    fleet: Fleet,
) -> None:
    """B restarts (same address, base weights, version "default"): its probe reads the
    version, it is fenced as behind and reloaded from the published folder (SGLang's
    abort pause, the reload, the version) before any turn reaches it."""
    path = fleet.checkpoint("step-1")
    assert fleet.publish(1, path, "abort").status_code == 200
    _, restarted = fleet.doubles
    restarted.healthy = False
    _wait_for(lambda: not fleet.policy()["replicas"][1]["healthy"], "B seen down")
    restarted.restart()
    restarted.control.clear()
    before = len(restarted.requests)
    restarted.healthy = True
    _wait_for(lambda: fleet.states()[restarted.url] == ("serving", "1"), "B caught up and serving")
    assert (restarted.loaded, restarted.weight_version) == (str(path), "1")
    assert [p for p, _ in restarted.control][:2] == [
        "/pause_generation",
        "/update_weights_from_disk",
    ]
    assert len(restarted.requests) == before  # no turn reached it while behind
    sessions = [fleet.session() for _ in range(8)]
    for session in sessions:
        assert fleet.turn(session).status_code == 200
        assert fleet.versions(session["id"]) == ["1"]
    assert len(restarted.requests) > before  # and it serves again
