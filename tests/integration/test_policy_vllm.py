"""Publishing a policy through tokenkeep to real vLLM CPU replicas (`POST /policy`).

Two replicas of the tiny Qwen3 (tied embeddings) started for publishing (dev mode, the
tokenkeep_vllm extension, an engine key) behind two session-server processes' worth of apps on
one real Redis of their own (the published policy lives in the store: another module's server
must not follow it), and a third engine started fresh from a checkpoint, the reference every
reload is compared with. Checkpoints are the tiny model's weights perturbed by the engine's
own torch, written as safetensors (what a trainer writes).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from session_server.app import create_app
from session_server.devtools import localengine
from session_server.settings import Settings
from tests.checkpoints import perturbed
from tests.live_server import serving
from tests.redis_server import start_redis_server, stop_redis_server
from tests.trajectory_values import version_labels
from tests.vllm_fixture import skip_if_asked

pytestmark = pytest.mark.vllm

ENGINE_KEY = "engine-key-for-tests"
ADMIN_KEY = "admin-key-for-tests"
PROBE = list(range(1000, 1160))


@dataclass
class Fleet:
    engines: list[localengine.LocalEngine]
    fresh: localengine.LocalEngine
    """Started from `checkpoints[0]`: what a replica must equal after publishing it."""
    checkpoints: list[Path]
    servers: list[str]
    model_dir: Path
    versions: list[int] = field(default_factory=lambda: [0])

    def admin(self, server: int = 0) -> httpx.Client:
        return httpx.Client(
            base_url=self.servers[server],
            headers={"authorization": f"Bearer {ADMIN_KEY}"},
            timeout=300,
        )

    def next_version(self) -> int:
        self.versions.append(self.versions[-1] + 1)
        return self.versions[-1]

    def publish(self, path: Path, pause: str = "keep", server: int = 0) -> httpx.Response:
        with self.admin(server) as http:
            body = {"version": self.next_version(), "source": {"path": str(path)}, "pause": pause}
            return http.post("/policy", json=body)


def prompt_logprobs(url: str, key: str | None = ENGINE_KEY) -> list[float]:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    body = {
        "model": localengine.served_name(localengine.TINY_MODEL_NAME),
        "prompt": PROBE,
        "max_tokens": 1,
        "prompt_logprobs": 0,
        "temperature": 0.0,
    }
    reply = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120)
    reply.raise_for_status()
    entries = reply.json()["choices"][0]["prompt_logprobs"][1:]
    return [float(e[str(t)]["logprob"]) for t, e in zip(PROBE[1:], entries, strict=True)]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    skip_if_asked()
    model_dir = localengine.build_model()
    root = tmp_path_factory.mktemp("checkpoints")
    checkpoints = [perturbed(model_dir, root / f"step-{n}", seed=n) for n in (1, 2)]
    name = localengine.served_name(localengine.TINY_MODEL_NAME)

    def replica() -> localengine.LocalEngine:
        # vLLM's transfer engine too (NCCL: constructed on the CPU, never joined here).
        transfer = ["--weight-transfer-config", json.dumps({"backend": "nccl"})]
        return localengine.start(dev_mode=True, engine_key=ENGINE_KEY, extra_args=transfer)

    # Started side by side; the pool's threads live as long as the engines: an engine is
    # signalled when the thread that started it ends (localengine's parent-death signal).
    pool = ThreadPoolExecutor(3)
    started = [pool.submit(replica), pool.submit(replica)]
    fresh_start = pool.submit(
        localengine.start, checkpoints[0], served_model_name=name, dev_mode=True
    )
    engines = [f.result() for f in started]
    fresh = fresh_start.result()
    proc, redis_url = start_redis_server(tmp_path_factory.mktemp("policy-redis"))
    settings = Settings(
        engine_urls=[e.url for e in engines],
        model=name,
        tokenizer=str(model_dir),
        context_length=engines[0].max_model_len,
        redis_url=redis_url,
        admin_key=ADMIN_KEY,
        engine_key=ENGINE_KEY,
        engine_health_interval_s=0.5,
    )
    try:
        with serving(create_app(settings)) as first, serving(create_app(settings)) as second:
            yield Fleet(engines, fresh, checkpoints, [first, second], model_dir)
    finally:
        for engine in [*engines, fresh]:
            engine.stop()
        pool.shutdown()
        stop_redis_server(proc)


@dataclass
class Rollout:
    """One session's streamed turn, run in a thread while a publish happens."""

    fleet: Fleet
    server: int = 0
    max_tokens: int = 120
    session: dict[str, Any] = field(default_factory=dict)
    text: str = ""
    thread: threading.Thread | None = None

    def start(self) -> Rollout:
        with self.fleet.admin(self.server) as http:
            self.session = http.post("/sessions", json={"sampling": {"seed": 7}}).json()
        self.thread = threading.Thread(target=self._run)
        self.thread.start()
        return self

    def _run(self) -> None:
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": self.max_tokens,
            "stream": True,
        }
        headers = {"authorization": f"Bearer {self.session['api_key']}"}
        url = self.session["openai_base_url"] + "/chat/completions"
        with httpx.stream("POST", url, json=body, headers=headers, timeout=300) as response:
            for text in response.iter_text():
                self.text += text

    def wait_until_sampling(self) -> None:
        """Until the engine has sampled some of it (the publish then finds it in flight)."""
        deadline = time.monotonic() + 120
        while '"content"' not in self.text and time.monotonic() < deadline:
            time.sleep(0.05)
            if self.thread is not None and not self.thread.is_alive():
                return

    def finish(self) -> list[dict[str, Any]]:
        assert self.thread is not None
        self.thread.join(300)
        with self.fleet.admin(self.server) as http:
            trajectory = http.get(f"/sessions/{self.session['id']}/trajectory").json()
        return [t for b in trajectory["branches"] for s in b["segments"] for t in s["turns"]]


def turn(session: dict[str, Any], content: str = "Hello", max_tokens: int = 8) -> httpx.Response:
    body = {"model": "m", "messages": [{"role": "user", "content": content}]}
    return httpx.post(
        session["openai_base_url"] + "/chat/completions",
        json={**body, "max_tokens": max_tokens},
        headers={"authorization": f"Bearer {session['api_key']}"},
        timeout=300,
    )


def spans(session_id: str, fleet: Fleet) -> list[str]:
    with fleet.admin() as http:
        return version_labels(http.get(f"/sessions/{session_id}/trajectory").json())


def test_the_engines_refuse_every_control_path_without_the_key(fleet: Fleet) -> None:
    url = fleet.engines[0].url
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    for path, body in (
        ("/collective_rpc", {"method": "reload_weights_tied", "args": ["/tmp"]}),
        ("/update_weight_version", {"new_version": "stolen"}),
        ("/pause", None),
        ("/inference/v1/generate", {"token_ids": [1, 2]}),
    ):
        refused = httpx.post(f"{url}{path}", json=body, timeout=30)
        assert refused.status_code == 401, (path, refused.text)
        wrong = httpx.post(
            f"{url}{path}", json=body, headers={"authorization": "Bearer nope"}, timeout=30
        )
        assert wrong.status_code == 401, path
    info = httpx.get(
        f"{url}/weight_info", headers={"authorization": f"Bearer {ENGINE_KEY}"}, timeout=30
    )
    assert info.json()["weight_version"] != "stolen"


def test_a_keep_publish_moves_every_replica_and_resumes_the_turn_in_flight(fleet: Fleet) -> None:
    rollout = Rollout(fleet).start()
    rollout.wait_until_sampling()
    published = fleet.publish(fleet.checkpoints[0], "keep")
    assert published.status_code == 200, published.text
    answer = published.json()
    version = str(fleet.versions[-1])
    assert [r["state"] for r in answer["replicas"]] == ["serving", "serving"]
    assert {r["version"] for r in answer["replicas"]} == {version}
    assert len({r["checksum"] for r in answer["replicas"]}) == 1
    assert answer["requests"]["kept"] >= 1
    [stored] = rollout.finish()
    # Frozen mid-turn, resumed on the new weights: the turn carries both versions, the new
    # one last, and no token is lost (the stream's text is the stored turn's).
    versions = [span["version"] for span in stored["weight_versions"]]
    assert versions[-1] == version and len(versions) == 2, versions
    # The second server follows the store: same published version, every replica serving.
    with fleet.admin(1) as http:
        seen = http.get("/policy").json()
    assert seen["version"] == version
    assert {r["state"] for r in seen["replicas"]} == {"serving"}
    with fleet.admin(1) as http:
        session = http.post("/sessions", json={}).json()
    assert turn(session).status_code == 200
    assert set(spans(session["id"], fleet)) == {version}


def test_after_every_publish_the_replicas_equal_a_fresh_engine_bit_for_bit(fleet: Fleet) -> None:
    """Twelve publishes alternating two checkpoints, every pause mode, under traffic: each
    time the first checkpoint is back, both replicas' logprobs equal those of an engine
    started fresh from it, exactly (the reload of a tied output layer included)."""
    reference = prompt_logprobs(fleet.fresh.url, key=None)
    stop = threading.Event()

    def traffic() -> None:
        with fleet.admin() as http:
            while not stop.is_set():
                session = http.post("/sessions", json={}).json()
                turn(session, max_tokens=24)

    workers = [threading.Thread(target=traffic) for _ in range(3)]
    for worker in workers:
        worker.start()
    try:
        checksums = set()
        for round_ in range(6):
            for path in (fleet.checkpoints[1], fleet.checkpoints[0]):
                published = fleet.publish(path, ("keep", "wait", "abort")[round_ % 3])
                assert published.status_code == 200, published.text
            checksums |= {r["checksum"] for r in published.json()["replicas"]}
            for engine in fleet.engines:
                assert prompt_logprobs(engine.url) == reference, (round_, engine.url)
        assert len(checksums) == 1
    finally:
        stop.set()
        for worker in workers:
            worker.join(300)


def test_a_wait_publish_lets_the_turn_finish_on_the_old_weights(fleet: Fleet) -> None:
    old = str(fleet.versions[-1])
    rollout = Rollout(fleet, max_tokens=60).start()
    rollout.wait_until_sampling()
    published = fleet.publish(fleet.checkpoints[1], "wait")
    assert published.status_code == 200, published.text
    assert published.json()["requests"]["waited"] >= 1
    [stored] = rollout.finish()
    assert [span["version"] for span in stored["weight_versions"]] == [old]


def test_an_abort_publish_ends_the_turn_and_the_session_goes_on(fleet: Fleet) -> None:
    rollout = Rollout(fleet, max_tokens=400).start()
    rollout.wait_until_sampling()
    published = fleet.publish(fleet.checkpoints[0], "abort")
    assert published.status_code == 200, published.text
    assert published.json()["requests"]["aborted"] >= 1
    [stored] = rollout.finish()
    assert stored["finish_reason"] == "abort"
    again = turn(rollout.session, "Tell me a long story.")
    assert again.status_code == 200, again.text
    assert spans(rollout.session["id"], fleet)[-1] == str(fleet.versions[-1])


def test_refused_publishes_touch_no_engine(fleet: Fleet, tmp_path: Path) -> None:
    if fleet.versions == [0]:  # run alone: something to refuse to replace
        assert fleet.publish(fleet.checkpoints[0]).status_code == 200
    with fleet.admin() as http:
        before = http.get("/policy").json()
        version = int(before["version"]) + 1
        source = {"path": str(fleet.checkpoints[0])}
        misfit = tmp_path / "misfit"
        misfit.mkdir()
        for f in fleet.checkpoints[0].iterdir():
            (misfit / f.name).write_bytes(f.read_bytes())
        config = json.loads((misfit / "config.json").read_text())
        (misfit / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
        refusals = {
            "missing folder": ({"version": version, "source": {"path": "/no/such/dir"}}, 400),
            "misfit": ({"version": version, "source": {"path": str(misfit)}}, 422),
            "not newer": ({"version": int(before["version"]), "source": source}, 409),
            "transfer, no group": ({"version": version, "source": {"transfer": {}}}, 409),
            "bad pause": ({"version": version, "source": source, "pause": "later"}, 400),
        }
        for name, (body, status) in refusals.items():
            refused = http.post("/policy", json=body)
            assert refused.status_code == status, (name, refused.text)
            assert refused.json()["error"]["message"], name
        assert httpx.post(f"{fleet.servers[0]}/policy", json=refusals["misfit"][0]).status_code == (
            401
        )
        # vLLM's own /get_world_size: the trainer's rank 0 and each replica's one CPU worker.
        group = http.get("/policy/transfer").json()
        assert (group["world_size"], group["group"]) == (3, None), group
        session = http.post("/sessions", json={}).json()
        as_session = httpx.post(
            f"{fleet.servers[0]}/policy",
            json={"version": version, "source": source},
            headers={"authorization": f"Bearer {session['api_key']}"},
        )
        assert as_session.status_code == 403
        after = http.get("/policy").json()
    assert after["version"] == before["version"]
    assert after["published_at"] == before["published_at"]
    assert [r["version"] for r in after["replicas"]] == [before["version"]] * 2


def test_a_weight_update_finished_without_weights_keeps_the_old_ones_exactly(
    fleet: Fleet,
) -> None:
    """What a transfer publish's rollback relies on (policy/transfer.py::_put_back: a replica
    started, then no broadcast): vLLM's finish with no update in between puts the old weights
    back, bit for bit. The real engine's answers to the calls the transfer double mimics."""
    engine = fleet.engines[1]
    before = prompt_logprobs(engine.url)
    headers = {"authorization": f"Bearer {ENGINE_KEY}"}
    # Its own connection: vLLM's server closes it after a worker error's 500.
    early = httpx.post(
        engine.url + "/update_weights", json={"update_info": {"names": []}}, headers=headers
    )
    assert early.status_code == 500
    assert "start_weight_update must be called before" in early.json()["error"]["message"]
    with httpx.Client(base_url=engine.url, headers=headers, timeout=120) as http:
        assert http.post("/pause", params={"mode": "keep"}).status_code == 200
        for path in ("/start_weight_update", "/finish_weight_update", "/resume"):
            answer = http.post(path)
            assert answer.status_code == 200, (path, answer.text)
    assert prompt_logprobs(engine.url) == before


def test_a_replica_restarted_on_base_weights_gets_no_turn_until_caught_up(
    fleet: Fleet,
) -> None:
    """Replica B dies; a publish reaches only A (502 naming B); B comes back on the base
    weights at the same address and is reloaded from the published folder before any turn:
    every turn stored meanwhile carries the published version."""
    down = fleet.engines[1]
    down.stop()
    published = fleet.publish(fleet.checkpoints[0], "keep")
    assert published.status_code == 502, published.text
    assert down.url in published.json()["error"]["message"]
    states = {r["engine"]: r["state"] for r in published.json()["replicas"]}
    assert states == {fleet.engines[0].url: "serving", down.url: "fenced"}
    version = str(fleet.versions[-1])
    stop = threading.Event()
    sessions: list[str] = []
    failures: list[str] = []

    def traffic() -> None:
        with fleet.admin() as http:
            while not stop.is_set():
                session = http.post("/sessions", json={}).json()
                sessions.append(session["id"])
                answer = turn(session)
                if answer.status_code != 200:
                    failures.append(answer.text)

    worker = threading.Thread(target=traffic)
    worker.start()
    try:
        port = int(down.url.rsplit(":", 1)[1])
        restarted = localengine.start(port=port, dev_mode=True, engine_key=ENGINE_KEY)
        fleet.engines[1] = restarted
        back = time.monotonic()
        with fleet.admin() as http:
            while True:
                replicas = {r["engine"]: r for r in http.get("/policy").json()["replicas"]}
                if replicas[down.url]["state"] == "serving":
                    break
                assert time.monotonic() - back < 120, replicas
                time.sleep(0.2)
        caught_up_s = time.monotonic() - back
        assert replicas[down.url]["version"] == version
        time.sleep(2)  # turns now reach it too
    finally:
        stop.set()
        worker.join(300)
    print(f"restarted replica caught up {caught_up_s:.2f}s after its engine was ready")
    assert not failures, failures[:3]
    assert sessions
    for session_id in sessions:
        assert set(spans(session_id, fleet)) == {version}, session_id
    assert prompt_logprobs(restarted.url) == prompt_logprobs(fleet.fresh.url, key=None)
