"""Publishing a policy (`POST /policy`) to SGLang replicas, through a real `tokenkeep serve`
app (`--engine sglang`) in front of two SGLang engine doubles.

SGLang cannot run here (its CPU build needs `sgl-kernel`'s CPU wheel, which PyPI does not
ship), so these run against `tests/engine_double_sglang.py`: SGLang 0.5.23's control
endpoints (`/pause_generation` with its modes, `/update_weights_from_disk`, `/flush_cache`,
`/update_weight_version`, `/get_weight_version`, `/continue_generation`) as SGLang 0.5.23
defines them (`sglang/srt/entrypoints/http_server.py`, `managers/io_struct.py`). The same
scenarios on real vLLM CPU replicas are `tests/integration/test_policy_vllm.py`; the transfer
ones on vLLM's transfer double are `tests/session/test_policy_transfer.py`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import count
from pathlib import Path
from typing import Any

import httpx
import pytest

from session_server.app import create_app
from session_server.settings import Settings
from session_server.splice import ChatModel
from tests.engine_double import ScriptedCompletion
from tests.engine_double_sglang import SglangDouble
from tests.engine_double_transfer import DoubleTrainerEngine, NcclGroup
from tests.live_server import serving
from tests.policy.test_checkpoint import CONFIG, TENSORS, write_checkpoint
from tests.session.adversarial import END, tokens
from tests.trajectory_values import version_labels
from tokenkeep import Client, TokenkeepError

ADMIN_KEY = "admin-key-for-tests"
_ports = count(29700)


FOLDER_PUBLISH_CALLS = [
    "/pause_generation",
    "/update_weights_from_disk",
    "/flush_cache",
    "/update_weight_version",
    "/continue_generation",
]
"""SGLang's calls for a folder publish that pauses (abort or keep), in order."""


class SglangTrainer(DoubleTrainerEngine):
    """The trainer's side of SGLang's update from distributed, as SGLang's own tests drive it
    (rank 0 of a process group the engines join with `/init_weights_update_group`, then per
    update the tensors' names, dtypes and shapes sent with `/update_weights_from_distributed`
    while rank 0 broadcasts them), through tokenkeep's client: `init_info` is SGLang's
    `InitWeightsUpdateGroupReqInput` less `rank_offset` (tokenkeep sets each replica's),
    `update_info` its `UpdateWeightsFromDistributedReqInput` tensor fields. The broadcast is
    `NcclGroup`'s (no torch.distributed here)."""

    @staticmethod
    def init_info(group: NcclGroup) -> dict[str, Any]:
        return {
            "master_address": group.address,
            "master_port": group.port,
            "world_size": group.world_size,
            "backend": "nccl",
            "group_name": "weight_update_group",
        }

    def update_info(self) -> dict[str, Any]:
        return {"names": self.names, "dtypes": ["bfloat16"], "shapes": [[4, 4]]}


@dataclass
class Fleet:
    url: str
    doubles: list[SglangDouble]
    model: ChatModel
    root: Path
    client: Client

    def trainer(self, timeout_s: float = 5.0) -> DoubleTrainerEngine:
        """The trainer's init: the world size from tokenkeep, its group, the engines'."""
        transfer = self.client.policy_transfer()
        group = NcclGroup("127.0.0.1", next(_ports), transfer.world_size(), timeout_s)
        return SglangTrainer.trainer_init(transfer, group)

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

    def streamed_turn(self, session: dict[str, Any]) -> Iterator[str]:
        """A streamed turn's content, piece by piece as tokenkeep relays it."""
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 16,
            "stream": True,
        }
        headers = {"authorization": f"Bearer {session['api_key']}"}
        url = session["openai_base_url"] + "/chat/completions"
        with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as response:
            assert response.status_code == 200, response.read()
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[len("data: ") :])["choices"]:
                        yield choice["delta"].get("content") or ""

    def turn(self, session: dict[str, Any]) -> httpx.Response:
        body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
        return httpx.post(
            session["openai_base_url"] + "/chat/completions",
            json=body,
            headers={"authorization": f"Bearer {session['api_key']}"},
            timeout=60,
        )

    def trajectory(self, session_id: str) -> dict[str, Any]:
        with self.admin() as http:
            return http.get(f"/sessions/{session_id}/trajectory").json()

    def versions(self, session_id: str) -> list[str]:
        return version_labels(self.trajectory(session_id))


@pytest.fixture
def fleet(qwen3_model: ChatModel, tmp_path: Path) -> Iterator[Fleet]:
    # A runs two tensor-parallel workers (two ranks in a transfer group), B one.
    doubles = [SglangDouble(tp_size=2).start(), SglangDouble().start()]
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
        with serving(create_app(settings)) as url, Client(url, api_key=ADMIN_KEY) as client:
            yield Fleet(url, doubles, qwen3_model, tmp_path, client)
    finally:
        for double in doubles:
            double.stop()
        NcclGroup.groups.clear()


def _wait_for(condition: Any, what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_an_abort_publish_moves_both_sglang_replicas(fleet: Fleet) -> None:
    """Pause (SGLang's `abort` mode: every request aborted), reload with the version in the
    same call, flush the radix cache, the version set without SGLang's default abort-all,
    resume; the next turns are sampled (and stored) under the new version."""
    path = fleet.checkpoint("step-1")
    published = fleet.publish(1, path, "abort")
    assert published.status_code == 200, published.text
    answer = published.json()
    assert answer["version"] == "1"
    assert answer["requests"] == {"aborted": 0}
    assert [r["state"] for r in answer["replicas"]] == ["serving", "serving"]
    assert {r["checksum"] for r in answer["replicas"]} == {None}  # SGLang has no checker
    for double in fleet.doubles:
        assert [p for p, _ in double.control] == FOLDER_PUBLISH_CALLS
        bodies = dict(double.control)
        assert bodies["/pause_generation"] == {"mode": "abort"}
        assert bodies["/continue_generation"] == {}  # 0.5.23 requires a body
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


def test_a_keep_publish_freezes_the_turn_in_flight_and_resumes_it_on_the_new_weights(
    fleet: Fleet,
) -> None:
    """`keep` is SGLang's `retract` pause: the turn in flight is frozen mid-stream (its KV
    freed), the weights and version change, and on continue its remaining tokens are sampled
    by the new weights; the stored turn carries both versions, the new one last, over all of
    its tokens, and the client's stream loses nothing."""
    answer = tokens(fleet.model, "Hello there, how are you", END)
    for double in fleet.doubles:
        double.default = lambda _prompt, _sampling: ScriptedCompletion(list(answer))
        double.chunk_delay_s = 0.3  # room for the publish to land between two tokens
    session = fleet.session()
    pieces = fleet.streamed_turn(session)
    text = next(pieces)  # the turn is sampling: one token out, the rest to come
    path = fleet.checkpoint("step-1")
    published = fleet.publish(1, path, "keep")
    assert published.status_code == 200, published.text
    assert published.json()["requests"]["kept"] == 1
    text += "".join(pieces)
    assert text == fleet.model.tokenizer.decode(answer, skip_special_tokens=True).rstrip()
    for double in fleet.doubles:
        assert [p for p, _ in double.control] == FOLDER_PUBLISH_CALLS
        assert dict(double.control)["/pause_generation"] == {"mode": "retract"}
        assert "*" not in double.aborted  # nothing on the engine was aborted
        assert (double.weight_version, double.paused) == ("1", False)
    [segment] = fleet.trajectory(session["id"])["branches"][0]["segments"]
    [stored] = segment["turns"]
    assert stored["finish_reason"] == "stop"
    start, end = stored["completion_span"]
    assert segment["token_ids"][start:end] == answer
    spans = stored["weight_versions"]
    assert [span["version"] for span in spans] == ["default", "1"]
    assert segment["mixed_versions"] is True
    # Contiguous over the whole completion: the frozen token boundary is where "1" begins.
    assert (spans[0]["start"], spans[0]["end"], spans[1]["end"]) == (start, spans[1]["start"], end)
    assert start < spans[1]["start"] < end


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


def test_a_transfer_moves_both_sglang_replicas_in_sglangs_order(fleet: Fleet) -> None:
    """One init (ranks: the trainer 0, A's two tensor-parallel workers 1-2, B's worker 3),
    then a publish per pause mode a transfer can honour: every replica paused in SGLang's
    mode, receiving while the trainer broadcasts, the version set while still paused,
    continued; later turns carry the version."""
    trainer = fleet.trainer()
    a, b = fleet.doubles
    inits = [dict(d.control)["/init_weights_update_group"] for d in fleet.doubles]
    assert [(i["rank_offset"], i["world_size"], i["group_name"]) for i in inits] == [
        (1, 4, "weight_update_group"),
        (3, 4, "weight_update_group"),
    ]
    assert fleet.policy()["transfer"] == {
        "world_size": 4,
        "ranks": {a.url: 1, b.url: 3},
        "broken": None,
    }
    for version, pause, sglang_mode in ((1, "keep", "retract"), (2, "abort", "abort")):
        for double in fleet.doubles:
            double.control.clear()
        trainer.weights = f"step-{version}"
        published = fleet.client.publish_policy(version, transfer=trainer, pause=pause)
        assert published.version == str(version)
        assert published.source == {"transfer": {"world_size": 4}}
        assert [r.state for r in published.replicas] == ["serving", "serving"]
        for double in fleet.doubles:
            assert [p for p, _ in double.control] == [
                "/pause_generation",
                "/update_weights_from_distributed",
                "/update_weight_version",
                "/continue_generation",
            ]
            calls = dict(double.control)
            assert calls["/pause_generation"] == {"mode": sglang_mode}
            assert calls["/update_weights_from_distributed"] == {
                "names": ["model.weight"],
                "dtypes": ["bfloat16"],
                "shapes": [[4, 4]],
                "group_name": "weight_update_group",
                "flush_cache": True,
                "abort_all_requests": False,
            }
            assert calls["/update_weight_version"] == {
                "new_version": str(version),
                "abort_all_requests": False,
            }
            assert (double.loaded, double.weight_version, double.paused) == (
                f"step-{version}",
                str(version),
                False,
            )
        session = fleet.session()
        assert fleet.turn(session).status_code == 200
        assert fleet.versions(session["id"]) == [str(version)]
    assert trainer.broadcasts == 2


def test_sglang_transfers_refuse_wait_and_bad_info_before_any_engine_is_touched(
    fleet: Fleet,
) -> None:
    """`wait` (an unpaused SGLang would sample between two chunks with half the weights) is
    501, and info SGLang cannot take is 400, each before any engine is called."""
    trainer = fleet.trainer()
    for double in fleet.doubles:
        double.control.clear()
    with pytest.raises(TokenkeepError) as refused:
        fleet.client.publish_policy(1, transfer=trainer, pause="wait")
    assert refused.value.status == 501 and "wait" in refused.value.message
    with fleet.admin() as http:
        bad_group = {**SglangTrainer.init_info(trainer.group), "group_name": "mine"}
        answer = http.post("/policy/transfer/init", json={"init_info": bad_group})
    assert answer.status_code == 400 and "group_name" in answer.text
    for double in fleet.doubles:
        assert double.control == []
    assert fleet.policy()["version"] is None


def test_an_sglang_replica_failing_mid_transfer_is_fenced_and_breaks_the_group(
    fleet: Fleet,
) -> None:
    """B's update fails while the trainer broadcasts: the trainer's update call gets a 502
    naming B, A (which received everything) is finished at the new version and serves, B is
    fenced (SGLang loads tensors as they come: its weights may be a mix), and the next
    publish is refused until the trainer forms a new group."""
    trainer = fleet.trainer(timeout_s=1.0)
    trainer.weights = "step-1"
    a, b = fleet.doubles
    b.fail["/update_weights_from_distributed"] = 400
    with pytest.raises(TimeoutError):  # the broadcast never reaches B's rank
        fleet.client.publish_policy(1, transfer=trainer)
    error = trainer.update_error
    assert isinstance(error, TokenkeepError) and error.status == 502
    assert b.url in error.message and "update" in error.message
    assert (a.loaded, a.weight_version) == ("step-1", "1")
    replicas = {r["engine"]: r for r in fleet.policy()["replicas"]}
    assert replicas[a.url]["state"] == "serving"
    assert replicas[b.url]["state"] == "fenced"
    assert fleet.policy()["version"] == "1"
    sessions = [fleet.session() for _ in range(4)]
    before = len(b.requests)
    for session in sessions:
        assert fleet.turn(session).status_code == 200
        assert fleet.versions(session["id"]) == ["1"]
    assert len(b.requests) == before  # no turn from B
    with pytest.raises(TokenkeepError) as refused:
        fleet.client.publish_policy(2, transfer=trainer)
    assert refused.value.status == 409 and "initialises a new one" in refused.value.message
