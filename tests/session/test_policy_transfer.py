"""Publishing a policy the trainer sends itself (`{"source": {"transfer": {}}}`: vLLM 0.32's
weight transfer), through a real `tokenkeep serve` app, tokenkeep's client and the trainer's
sequence of vLLM's `NCCLTrainerWeightTransferEngine`, to two vLLM replicas.

Against a double (`tests/engine_double_transfer.py`): every transfer backend vLLM 0.32 has
needs CUDA, so the CPU engine cannot take a transfer here. The double speaks vLLM's exact
endpoint shapes and blocks where NCCL blocks (the rendezvous, the broadcast); the pause modes
and the reload's exactness on real engines are tests/integration/test_policy_vllm.py's (folder
sources share the pause, cache and checksum steps).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import count
from typing import Any

import httpx
import pytest

from session_server.app import build_service, create_app
from session_server.policy import transfer as transfer_module
from session_server.settings import Settings
from session_server.splice import ChatModel
from tests.engine_double import ScriptedCompletion
from tests.engine_double_transfer import DoubleTrainerEngine, NcclGroup, TransferEngineDouble
from tests.live_server import serving
from tests.session.adversarial import END, tokens
from tests.trajectory_values import version_labels
from tokenkeep import AsyncClient, Client, TokenkeepError

ADMIN_KEY = "admin-key-for-tests"
_ports = count(29500)


@dataclass
class Fleet:
    url: str
    a: TransferEngineDouble
    b: TransferEngineDouble
    client: Client

    def admin(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=60
        )

    def trainer(self, timeout_s: float = 5.0) -> DoubleTrainerEngine:
        """The trainer's init, as vLLM's `trainer_init`: the world size from tokenkeep."""
        transfer = self.client.policy_transfer()
        group = NcclGroup("127.0.0.1", next(_ports), transfer.world_size(), timeout_s)
        return DoubleTrainerEngine.trainer_init(transfer, group)

    def policy(self) -> dict[str, Any]:
        with self.admin() as http:
            return http.get("/policy").json()

    def replicas(self) -> dict[str, dict[str, Any]]:
        return {r["engine"]: r for r in self.policy()["replicas"]}

    def turns(self, n: int) -> list[str]:
        """Versions of `n` new sessions' first turns."""
        versions = []
        with self.admin() as http:
            for _ in range(n):
                session = http.post("/sessions", json={}).json()
                body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}
                answer = httpx.post(
                    session["openai_base_url"] + "/chat/completions",
                    json={**body, "max_tokens": 8},
                    headers={"authorization": f"Bearer {session['api_key']}"},
                    timeout=60,
                )
                assert answer.status_code == 200, answer.text
                trajectory = http.get(f"/sessions/{session['id']}/trajectory").json()
                versions += version_labels(trajectory)
        return versions


@pytest.fixture
def fleet(qwen3_model: ChatModel) -> Iterator[Fleet]:
    a, b = TransferEngineDouble(world_size=2).start(), TransferEngineDouble().start()
    answer = tokens(qwen3_model, "Hello", END)
    for double in (a, b):
        double.default = lambda _prompt, _sampling: ScriptedCompletion(list(answer))
    settings = Settings(
        engine_urls=[a.url, b.url],
        model=a.model,
        tokenizer=str(qwen3_model.tokenizer.name_or_path),
        context_length=a.max_model_len,
        admin_key=ADMIN_KEY,
        engine_health_interval_s=0.1,
    )
    try:
        app = create_app(settings, build_service(settings, model=qwen3_model))
        with serving(app) as url, Client(url, api_key=ADMIN_KEY) as client:
            yield Fleet(url, a, b, client)
    finally:
        a.stop()
        b.stop()
        NcclGroup.groups.clear()


def _wait_for(condition: Any, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_transfer_moves_every_replica_in_vllms_order_with_each_pause_mode(
    fleet: Fleet,
) -> None:
    """One init (ranks: the trainer 0, A's two workers 1-2, B's worker 3), then a publish per
    pause mode: every replica paused in that mode, started, receiving while the trainer
    broadcasts, finished with the version, its cache dropped (running requests too under
    keep), checksummed, resumed; later turns carry the version."""
    trainer = fleet.trainer()
    assert [(d.rank_offset, d.world_size) for d in (fleet.a, fleet.b)] == [(1, 2), (3, 1)]
    assert fleet.policy()["transfer"] == {
        "world_size": 4,
        "ranks": {fleet.a.url: 1, fleet.b.url: 3},
        "broken": None,
    }
    for version, pause in ((1, "keep"), (2, "wait"), (3, "abort")):
        for double in (fleet.a, fleet.b):
            double.control.clear()
        trainer.weights = f"step-{version}"
        if version == 2:  # the async client drives the same engine
            published = asyncio.run(_publish_async(fleet.url, trainer, version, pause))
        else:
            published = fleet.client.publish_policy(version, transfer=trainer, pause=pause)
        assert published.version == str(version)
        assert published.source == {"transfer": {"world_size": 4}}
        assert published.requests == {{"keep": "kept", "wait": "waited"}.get(pause, "aborted"): 0}
        assert [r.state for r in published.replicas] == ["serving", "serving"]
        checksums = {r.checksum for r in published.replicas}
        assert len(checksums) == 1 and None not in checksums
        for double in (fleet.a, fleet.b):
            paths = double.paths()
            assert paths[:4] == [
                "/pause",
                "/start_weight_update",
                "/update_weights",
                "/finish_weight_update",
            ]
            assert set(paths[4:6]) == {"/reset_prefix_cache", "/weight_checker"}
            assert paths[6:] == ["/resume"]
            calls = dict(double.control)
            assert calls["/pause"] == {"mode": pause}
            running = {"reset_running_requests": "true" if pause == "keep" else "false"}
            assert calls["/reset_prefix_cache"] == running
            assert calls["/finish_weight_update"] == {"weight_version": str(version)}
            assert calls["/update_weights"]["update_info"]["names"] == ["model.weight"]
            assert (double.weights, double.weight_version) == (f"step-{version}", str(version))
            assert double.paused is None
        assert set(fleet.turns(4)) == {str(version)}
    assert trainer.broadcasts == 3
    assert "/init_weight_transfer_engine" not in fleet.a.paths()  # once per group


async def _publish_async(url: str, trainer: DoubleTrainerEngine, version: int, pause: Any) -> Any:
    async with AsyncClient(url, api_key=ADMIN_KEY) as client:
        return await client.publish_policy(version, transfer=trainer, pause=pause)


def test_a_replica_that_cannot_start_means_no_broadcast_and_nothing_published(
    fleet: Fleet,
) -> None:
    """B's start fails: the trainer is told before it sends anything (502 naming B); A puts
    its old weights back (finish with no version) and resumes; B is fenced."""
    trainer = fleet.trainer()
    fleet.b.fail["/start_weight_update"] = 500
    with pytest.raises(TokenkeepError) as refused:
        fleet.client.publish_policy(1, transfer=trainer)
    assert refused.value.status == 502
    assert fleet.b.url in refused.value.message and "start update" in refused.value.message
    assert trainer.broadcasts == 0 and trainer.group.round == 0
    assert fleet.a.paths()[-3:] == ["/start_weight_update", "/finish_weight_update", "/resume"]
    assert dict(fleet.a.control)["/finish_weight_update"] == {}  # no version: weights back
    assert (fleet.a.weights, fleet.a.weight_version, fleet.a.paused) == ("base", "default", None)
    assert fleet.policy()["version"] is None
    replicas = fleet.replicas()
    assert replicas[fleet.a.url]["state"] == "serving"
    assert replicas[fleet.b.url]["state"] == "fenced"
    assert fleet.turns(3) == ["default"] * 3  # A alone serves, on its old weights


def test_a_replica_failing_mid_transfer_is_fenced_named_and_breaks_the_group(
    fleet: Fleet,
) -> None:
    """B's update fails while the trainer broadcasts: the trainer's update call gets a 502
    naming B, A (which received everything) is finished at the new version and serves, B is
    fenced, and the next publish is refused until the trainer forms a new group."""
    trainer = fleet.trainer(timeout_s=1.0)
    trainer.weights = "step-1"
    fleet.b.fail["/update_weights"] = 500
    with pytest.raises(TimeoutError):  # the broadcast never reaches B's ranks
        fleet.client.publish_policy(1, transfer=trainer)
    error = trainer.update_error
    assert isinstance(error, TokenkeepError) and error.status == 502
    assert fleet.b.url in error.message and "update" in error.message
    assert "published to 1 of 2 replicas" in error.message
    assert (fleet.a.weights, fleet.a.weight_version) == ("step-1", "1")
    replicas = fleet.replicas()
    assert replicas[fleet.a.url]["state"] == "serving"
    assert replicas[fleet.b.url]["state"] == "fenced"
    assert replicas[fleet.b.url]["reason"].startswith(("update_failed", "awaiting_transfer"))
    assert fleet.policy()["version"] == "1"
    assert set(fleet.turns(4)) == {"1"}  # no turn from B
    with pytest.raises(TokenkeepError) as refused:
        fleet.client.publish_policy(2, transfer=trainer)
    assert refused.value.status == 409 and "initialises a new one" in refused.value.message


def test_a_reappearing_replica_stays_fenced_until_the_trainer_publishes_again(
    fleet: Fleet,
) -> None:
    """B restarts on its base weights: tokenkeep cannot reload a transfer, so B stays fenced
    (GET /policy and the metric say `awaiting_transfer`) and gets no turn; its group is
    broken, so the trainer forms a new one and publishes: B serves the new version."""
    trainer = fleet.trainer()
    trainer.weights = "step-1"
    fleet.client.publish_policy(1, transfer=trainer)
    fleet.b.healthy = False
    _wait_for(lambda: not fleet.replicas()[fleet.b.url]["healthy"], "B seen down")
    fleet.b.restart()
    fleet.b.control.clear()
    fleet.b.healthy = True
    _wait_for(
        lambda: (fleet.replicas()[fleet.b.url]["reason"] or "").startswith("awaiting_transfer"),
        "B fenced as awaiting a transfer",
    )
    time.sleep(0.3)  # more follow rounds: still fenced, and no catch-up was tried
    assert fleet.replicas()[fleet.b.url]["state"] == "fenced"
    assert fleet.b.paths() == []
    metrics = httpx.get(fleet.url + "/metrics").text
    assert (
        f'tokenkeep_engine_replica_fenced{{reason="awaiting_transfer",replica="{fleet.b.url}"}} 1.0'
        in metrics
    )
    before = len(fleet.b.requests)
    assert set(fleet.turns(4)) == {"1"}
    assert len(fleet.b.requests) == before
    with pytest.raises(TokenkeepError) as refused:
        fleet.client.publish_policy(2, transfer=trainer)
    assert refused.value.status == 409 and fleet.b.url in refused.value.message
    again = fleet.trainer()  # a new group: B joins at its ranks again
    again.weights = "step-2"
    published = fleet.client.publish_policy(2, transfer=again)
    assert [r.state for r in published.replicas] == ["serving", "serving"]
    assert (fleet.b.weights, fleet.b.weight_version) == ("step-2", "2")
    assert fleet.replicas()[fleet.b.url]["state"] == "serving"


def test_a_transfer_the_trainer_abandons_puts_the_old_weights_back(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Started, then no update: after the idle limit every replica gets its old weights back
    and resumes, nothing is published, and the fleet takes the next publish."""
    monkeypatch.setattr(transfer_module, "TRANSFER_IDLE_S", 0.3)
    trainer = fleet.trainer()
    with fleet.admin() as http:
        body = {"version": 1, "source": {"transfer": {}}, "pause": "wait"}
        started = http.post("/policy", json=body)
        assert started.status_code == 200, started.text
        assert started.json()["state"] == "receiving"
        assert http.post("/policy", json=body | {"version": 2}).status_code == 409
        assert http.post("/policy/transfer/finish").status_code == 409  # no update yet
    _wait_for(lambda: fleet.a.paused is None and fleet.b.paused is None, "resumed")
    for double in (fleet.a, fleet.b):
        assert double.paths()[-2:] == ["/finish_weight_update", "/resume"]
        assert (double.weights, double.weight_version, double.update_active) == (
            "base",
            "default",
            False,
        )
    assert fleet.policy()["version"] is None
    trainer.weights = "step-1"
    assert fleet.client.publish_policy(1, transfer=trainer).version == "1"


def test_bad_transfer_calls_are_refused_without_touching_an_engine(fleet: Fleet) -> None:
    """A group of the wrong size (400, the size needed named), an update or finish with no
    transfer started, a publish before any group (409), an unknown source field (400), a
    session key (403), an engine that cannot say its world size (the status answers, the
    client refuses): no engine gets a transfer call."""
    with fleet.admin() as http:
        init = {"master_address": "127.0.0.1", "master_port": 1, "world_size": 3}
        wrong = http.post("/policy/transfer/init", json={"init_info": init})
        assert wrong.status_code == 400 and "needs 4" in wrong.text
        update = {"update_info": {"names": [], "dtype_names": [], "shapes": []}}
        assert http.post("/policy/transfer/update", json=update).status_code == 409
        assert http.post("/policy/transfer/finish").status_code == 409
        body = {"version": 1, "source": {"transfer": {}}}
        assert http.post("/policy", json=body).json()["error"]["type"] == "no_transfer_group"
        odd = {"version": 1, "source": {"transfer": {"world_size": 4}}}
        assert http.post("/policy", json=odd).status_code == 400
        session = http.post("/sessions", json={}).json()
    as_session = {"authorization": f"Bearer {session['api_key']}"}
    refused = httpx.post(
        fleet.url + "/policy/transfer/init", json={"init_info": init}, headers=as_session
    )
    assert refused.status_code in {401, 403}
    fleet.b.fail["/get_world_size"] = 404  # an engine not started for publishing
    with fleet.admin() as http:
        unknown = http.get("/policy/transfer")
    assert unknown.status_code == 200 and unknown.json()["world_size"] is None
    assert fleet.b.url in unknown.json()["replicas"][1]["reason"]
    fleet.b.fail["/get_world_size"] = 404
    with pytest.raises(TokenkeepError) as no_size:
        fleet.client.policy_transfer().world_size()
    assert no_size.value.status == 409
    for double in (fleet.a, fleet.b):
        assert set(double.paths()) <= {"/get_world_size"}
    assert fleet.policy()["version"] is None
