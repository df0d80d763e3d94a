"""The path every user takes, on a real node: `helm install`, `kubectl apply -f examples/cpu/`,
then a harness (the openai SDK) through the SessionServer's Service, to vLLM CPU engine pods;
then what happens to a running stack: the ModelServer scaled to two, a trainer Job publishing a
policy to both replicas, an engine pod replaced (caught up to the policy before it serves, the
session it served going on as one segment), `helm upgrade`, faults an admin must fix, and the
uninstall.

The ModelServer is examples/cpu/modelserver.yaml with one addition, `spec.policy.checkpoints`
naming a claim of the default StorageClass (what a trainer writes and the engines reload from):
set from the start, so that no later step rolls the engine pods to add it.

The tests share one stack (module fixture) and run in file order; each drives its own sessions.
What this node cannot show: GPU scheduling (the examples/cpu ModelServer asks for no GPU).
"""

from __future__ import annotations

import base64
import itertools
import json
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from tokenizers import Tokenizer

from session_server.devtools.demo import TOOLS, answer_grammar, tool_call_grammar, weather
from tests.cluster.conftest import Node, wait_for
from tests.operator.conftest import REPO_ROOT
from tests.operator.real_cluster import OPERATOR_NAMESPACE, RELEASE
from tests.real_tokenizers import qwen3_dir

NS = "rl"
EXAMPLES = REPO_ROOT / "examples" / "cpu"
ENGINE_PODS = "app.kubernetes.io/name=vllm,app.kubernetes.io/instance=tiny-qwen3"
SESSION_PODS = "app.kubernetes.io/name=tokenkeep,app.kubernetes.io/instance=rollouts"
CHECKPOINTS = "checkpoints"
OPERATOR_PODS = f"app.kubernetes.io/instance={RELEASE}"
# Two tool calls then an answer: grammar-constrained, as `tokenkeep demo` does, because the
# engine's weights are random.
SCRIPT = (("What is the weather in Paris?", "Paris"), (None, "Tokyo"), (None, None))


def model_server_manifests() -> str:
    """examples/cpu/modelserver.yaml with `spec.policy.checkpoints` naming a claim, and the
    claim: ReadWriteOnce is enough on one node (pods on several nodes need ReadWriteMany). On
    this node the default StorageClass is node-services.py's: a hostPath PersistentVolume, a
    0777 folder, so the trainer (uid 10001) writes where the engines and the session server
    read."""
    claim = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": CHECKPOINTS},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}},
    }
    model_server = yaml.safe_load((EXAMPLES / "modelserver.yaml").read_text())
    model_server["spec"]["policy"] = {"checkpoints": {"claimName": CHECKPOINTS}}
    return yaml.safe_dump_all([claim, model_server])


def condition(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    found = (obj.get("status") or {}).get("conditions") or []
    return next((c for c in found if c["type"] == type_), {})


def ready(node: Node, kind: str, name: str) -> bool:
    obj = node.json("get", kind, name, "-n", NS)
    return condition(obj, "Ready").get("status") == "True"


def events(node: Node, name: str) -> list[tuple[str, str, str]]:
    """(type, reason, message) of the Events about `name`, oldest first."""
    listed = node.json("get", "events", "-n", NS, "--field-selector", f"involvedObject.name={name}")
    ordered = sorted(listed["items"], key=lambda e: e.get("lastTimestamp") or "")
    return [(e["type"], e["reason"], e["message"]) for e in ordered]


def pods_ready(node: Node, selector: str, count: int) -> bool:
    pods = node.json("get", "pods", "-n", NS, "-l", selector)["items"]
    live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    return len(live) == count and all(condition(p, "Ready").get("status") == "True" for p in live)


@dataclass
class Conversation:
    """A session driven turn by turn with the openai SDK (the script's tool loop); keeps, per
    turn, the engine's prompt ids and sampled ids as the served response reports them."""

    base: str
    key: str
    vocab: dict[str, int]
    session_id: str = field(default_factory=lambda: f"cluster-{uuid.uuid4().hex[:12]}")
    messages: list[dict[str, Any]] = field(
        default_factory=lambda: [{"role": "system", "content": "Use the tools."}]
    )
    turns: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        created = self.admin().post(
            "/sessions", json={"id": self.session_id, "sampling": {"seed": 7}}
        )
        assert created.status_code == 201, created.text
        body = created.json()
        self.client = openai.OpenAI(
            base_url=body["openai_base_url"], api_key=body["api_key"], timeout=300, max_retries=0
        )

    def admin(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.base, headers={"Authorization": f"Bearer {self.key}"}, timeout=300
        )

    def turn(self) -> dict[str, Any]:
        """The script's next turn. Messages are kept only once it is answered, so a failed
        attempt can be sent again as it was."""
        user, city = SCRIPT[len(self.turns) % len(SCRIPT)]
        messages = list(self.messages)
        if user:
            messages.append({"role": "user", "content": user})
        grammar = (
            tool_call_grammar(self.vocab, "get_weather", {"city": [city]})
            if city
            else answer_grammar(self.vocab)
        )
        started = time.monotonic()
        reply = self.client.chat.completions.create(
            model=self.session_id,
            messages=messages,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            max_tokens=128,
            extra_body={
                "structured_outputs": {"grammar": grammar},
                "reasoning_ended": True,
                "return_token_ids": True,
            },
        )
        message = reply.choices[0].message
        seen = {
            "prompt_ids": (reply.model_extra or {})["prompt_token_ids"],
            "sampled": reply.choices[0].model_extra["token_ids"],
            "seconds": time.monotonic() - started,
        }
        sent: dict[str, Any] = {"role": "assistant", "content": message.content}
        if message.tool_calls:
            sent["tool_calls"] = [c.model_dump() for c in message.tool_calls]
            assert [json.loads(c.function.arguments) for c in message.tool_calls] == [
                {"city": city}
            ]
        messages.append(sent)
        for call in message.tool_calls or ():
            messages.append({"role": "tool", "tool_call_id": call.id, "content": weather(city)})
        self.messages = messages
        self.turns.append(seen)
        return seen

    def turn_when_served(self, timeout: float = 300) -> dict[str, Any]:
        """A turn, retried while the stack has no path to an engine (503 until the session
        servers find a new one; refused connections while no session server is ready)."""

        def attempt() -> dict[str, Any]:
            try:
                return self.turn()
            except openai.APIStatusError as error:
                if error.status_code not in (502, 503):  # any other answer fails the test
                    raise
                raise AssertionError(str(error)) from error
            except openai.APIConnectionError as error:
                raise AssertionError(str(error)) from error

        return wait_for(attempt, timeout=timeout, interval=5)

    def summary(self) -> dict[str, Any]:
        with self.admin() as admin:
            return admin.get(f"/sessions/{self.session_id}").json()

    def trajectory(self) -> dict[str, Any]:
        with self.admin() as admin:
            return admin.get(f"/sessions/{self.session_id}/trajectory").json()

    def assert_one_contiguous_segment(self) -> None:
        """The engine's own prompt ids on every turn start with everything before (prompt +
        sampled tokens of the previous turn, unchanged), and the stored trajectory is one
        segment holding exactly those tokens."""
        for before, after in itertools.pairwise(self.turns):
            stored = before["prompt_ids"] + before["sampled"]
            assert after["prompt_ids"][: len(stored)] == stored
        summary = self.summary()
        assert (summary["turns"], summary["segments"], summary["breaks"]) == (
            len(self.turns),
            1,
            {},
        ), summary
        [branch] = self.trajectory()["branches"]
        [segment] = branch["segments"]
        last = self.turns[-1]
        assert segment["token_ids"] == last["prompt_ids"] + last["sampled"]
        assert sum(segment["loss_mask"]) == sum(len(t["sampled"]) for t in self.turns)


@dataclass
class Stack:
    node: Node
    chart: Path
    base: str
    key: str
    vocab: dict[str, int]

    def conversation(self) -> Conversation:
        return Conversation(self.base, self.key, self.vocab)


def diagnose(node: Node) -> None:
    """What an admin would look at, printed when a step fails."""
    for args in (
        ("get", "modelservers,sessionservers,pods", "-n", NS, "-o", "wide"),
        ("describe", "pods", "-n", NS),
        ("logs", "-n", NS, "-l", ENGINE_PODS, "--tail=40"),
        ("logs", "-n", NS, "-l", SESSION_PODS, "--tail=60"),
        ("logs", "-n", OPERATOR_NAMESPACE, "-l", OPERATOR_PODS, "--tail=60"),
        ("get", "events", "-n", NS, "--sort-by=.lastTimestamp"),
    ):  # fmt: skip
        print(f"$ kubectl {' '.join(args)}\n{node.kubectl(*args, check=False)}")


@pytest.fixture(autouse=True)
def _diagnose_failures(node: Node, request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        diagnose(node)


@pytest.fixture(scope="module")
def model_server(node: Node, release: Path) -> str:
    """`kubectl apply -f examples/cpu/modelserver.yaml`, Ready through real probes (the stack
    below adds the SessionServer in front of the same engine). Returns the namespace."""
    node.kubectl("create", "namespace", NS)
    started = time.monotonic()
    node.kubectl("apply", "-n", NS, "-f", "-", input=model_server_manifests())
    try:
        wait_for(lambda: ready(node, "modelserver", "tiny-qwen3"), timeout=900, interval=5)
    except BaseException:
        diagnose(node)
        raise
    node.timings["modelserver_ready_s"] = time.monotonic() - started
    return NS


@pytest.fixture(scope="module")
def stack(node: Node, release: Path, model_server: str) -> Stack:
    """`kubectl apply -f examples/cpu/` (the ModelServer with its checkpoint claim, as the
    fixture above applied it) and both resources Ready through real probes."""
    started = time.monotonic()
    node.kubectl("apply", "-n", NS, "-f", "-", input=model_server_manifests())
    node.kubectl("apply", "-n", NS, "-f", str(EXAMPLES / "sessionserver.yaml"))
    try:
        wait_for(lambda: ready(node, "modelserver", "tiny-qwen3"), timeout=900, interval=5)
        wait_for(lambda: ready(node, "sessionserver", "rollouts"), timeout=600, interval=5)
        node.timings["sessionserver_ready_s"] = time.monotonic() - started
    except BaseException:
        diagnose(node)
        raise
    service = node.json("get", "service", "rollouts-sessions", "-n", NS)
    base = f"http://{service['spec']['clusterIP']}:{service['spec']['ports'][0]['port']}"
    secret = node.json("get", "secret", "rollouts-admin-key", "-n", NS)
    key = base64.b64decode(secret["data"]["admin-key"]).decode()
    vocab = Tokenizer.from_file(str(qwen3_dir() / "tokenizer.json")).get_vocab()
    return Stack(node, release, base, key, vocab)


def test_the_operator_runs_as_a_pod_holding_the_charts_lease(node: Node, release: Path) -> None:
    lease = node.json("get", "lease", "tokenkeep-operator", "-n", OPERATOR_NAMESPACE)
    assert lease["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE
    holder = wait_for(
        lambda: node.json("get", "lease", "tokenkeep-operator", "-n", OPERATOR_NAMESPACE)[
            "spec"
        ].get("holderIdentity"),
        timeout=120,
    )
    [pod] = node.json("get", "pods", "-n", OPERATOR_NAMESPACE)["items"]
    assert pod["spec"]["serviceAccountName"].startswith(RELEASE)
    assert pod["metadata"]["name"] in holder


def test_engine_pods_refuse_publishing_endpoints_without_the_engine_key(
    node: Node, model_server: str
) -> None:
    """The engine pods run vLLM's development endpoints (what POST /policy drives) behind the
    engine key the operator generated: a request without it, or with a wrong one, to
    /collective_rpc (a weight reload) or /update_weight_version is refused with 401 and
    changes nothing, while the kubelet's /health answers 200 without it; the key opens them."""
    [pod] = node.json("get", "pods", "-n", model_server, "-l", ENGINE_PODS)["items"]
    base = f"http://{pod['status']['podIP']}:8000"
    secret = node.json("get", "secret", "tiny-qwen3-engine-key", "-n", model_server)
    key = base64.b64decode(secret["data"]["engine-key"]).decode()
    with httpx.Client(base_url=base, timeout=60) as engine:
        assert engine.get("/health").status_code == 200
        calls = (
            ("/collective_rpc", {"method": "reload_weights"}),
            ("/update_weight_version", {"new_version": "intruder"}),
        )
        for path, body in calls:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key}):
                refused = engine.post(path, json=body, headers=headers)
                assert refused.status_code == 401, (path, headers, refused.text)
        assert engine.get("/v1/models").status_code == 401
        # The key opens them, and the refused update changed nothing: the fresh engine's
        # version is vLLM's "default". (VLLM_SERVER_DEV_MODE is on: the endpoint exists.)
        opened = {"Authorization": f"Bearer {key}"}
        info = engine.get("/weight_info", headers=opened)
        assert info.status_code == 200, info.text
        assert info.json().get("weight_version") == "default", info.text
        assert engine.get("/v1/models", headers=opened).status_code == 200


def test_a_tool_loop_through_the_service_is_one_contiguous_segment(stack: Stack) -> None:
    node = stack.node
    # `kubectl get` columns say what the pods say.
    table = node.kubectl("get", "modelservers,sessionservers", "-n", NS)
    assert "tiny-qwen3" in table and "rollouts" in table
    conversation = stack.conversation()
    for _ in SCRIPT:
        conversation.turn()
    node.timings["turn_s"] = sorted(t["seconds"] for t in conversation.turns)[len(SCRIPT) // 2]
    conversation.assert_one_contiguous_segment()

    # The start-up check behind the operator's admin key says the model is token-exact, and a
    # normal start logs no traceback (session server, engine, operator).
    [pod] = node.json("get", "pods", "-n", NS, "-l", SESSION_PODS)["items"]
    logs = node.kubectl("logs", "-n", NS, pod["metadata"]["name"])
    assert "start-up check: token-exact" in logs or "start-up check (cached)" in logs, logs
    for namespace, selector in ((NS, SESSION_PODS), (OPERATOR_NAMESPACE, OPERATOR_PODS)):
        logs = node.kubectl("logs", "-n", namespace, "-l", selector, "--tail=-1")
        assert "Traceback" not in logs, logs


def engine_key(node: Node) -> str:
    """The engine key the operator generated (the engines ask for it on all but /health)."""
    secret = node.json("get", "secret", "tiny-qwen3-engine-key", "-n", NS)
    return base64.b64decode(secret["data"]["engine-key"]).decode()


def live_engine_pods(node: Node) -> list[dict[str, Any]]:
    pods = node.json("get", "pods", "-n", NS, "-l", ENGINE_PODS)["items"]
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def engine_requests(node: Node) -> dict[str, float]:
    """Finished requests per engine pod, from each vLLM's own /metrics (pod IPs are reachable
    from the node; /metrics needs no engine key, which is sent all the same)."""
    counted = {}
    headers = {"Authorization": f"Bearer {engine_key(node)}"}
    for pod in live_engine_pods(node):
        if not pod["status"].get("podIP"):
            continue
        url = f"http://{pod['status']['podIP']}:8000/metrics"
        counted[pod["metadata"]["name"]] = finished_requests(url, headers)
    return counted


def finished_requests(url: str, headers: dict[str, str]) -> float:
    text = httpx.get(url, headers=headers, timeout=30).text
    lines = [line for line in text.splitlines() if line.startswith("vllm:request_success_total")]
    assert lines, f"vLLM reports no vllm:request_success_total: {text[:200]}"
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


def turn_served_by(node: Node, conversation: Conversation) -> str:
    """One turn of `conversation`, and the engine pod that served it (the one whose finished
    requests grew)."""
    before = engine_requests(node)
    conversation.turn()
    # vLLM counts a request as it finishes, maybe just after answering.
    after = wait_for(
        lambda: (
            (now := engine_requests(node)) and sum(now.values()) >= sum(before.values()) + 1 and now
        ),
        timeout=30,
        interval=0.5,
    )
    moved = [name for name in after if after[name] > before.get(name, 0)]
    assert len(moved) == 1, (before, after)
    return moved[0]


def engines_discovered(stack: Stack, count: int) -> bool:
    with httpx.Client(base_url=stack.base, timeout=30) as client:
        text = client.get("/metrics", headers={"Authorization": f"Bearer {stack.key}"}).text
    up = [ln for ln in text.splitlines() if ln.startswith("tokenkeep_engine_replica_up{")]
    return len(up) == count and all(ln.endswith(" 1.0") for ln in up)


def scale_engines(stack: Stack, replicas: int) -> None:
    node = stack.node
    node.kubectl("patch", "modelserver", "tiny-qwen3", "-n", NS, "--type=merge",
                 "-p", json.dumps({"spec": {"replicas": replicas}}))  # fmt: skip
    wait_for(
        lambda: (
            node.json("get", "modelserver", "tiny-qwen3", "-n", NS)["status"].get("readyReplicas")
            == replicas
            and ready(node, "modelserver", "tiny-qwen3")
            and pods_ready(node, ENGINE_PODS, replicas)
        ),
        timeout=900,
        interval=5,
    )


class TestTwoEngineReplicas:
    """The ModelServer scaled to 2 (each engine requests 250m of the node's 2 CPUs) for the
    tests of this class, and back to 1 after them."""

    @pytest.fixture(scope="class", autouse=True)
    def two_engines(self, stack: Stack) -> Iterator[None]:
        started = time.monotonic()
        scale_engines(stack, 2)
        stack.node.timings["second_replica_ready_s"] = time.monotonic() - started
        # The session servers discover the new replica through the headless Service.
        wait_for(lambda: engines_discovered(stack, 2), timeout=300, interval=5)
        yield
        scale_engines(stack, 1)

    def test_two_engine_replicas_both_serve_sessions_with_affinity(self, stack: Stack) -> None:
        """The session servers discover the new replica, sessions spread over both, and every
        turn of a session goes to the engine that served its first (its prefix cache holds
        the conversation)."""
        node = stack.node
        served_by: dict[str, set[str]] = {}
        for _ in range(12):
            conversation = stack.conversation()
            engines = set()
            for _ in range(2):
                engines.add(turn_served_by(node, conversation))
            conversation.assert_one_contiguous_segment()
            assert len(engines) == 1, f"session {conversation.session_id} moved: {engines}"
            served_by[conversation.session_id] = engines
            if len(set().union(*served_by.values())) == 2 and len(served_by) >= 3:
                break
        assert len(set().union(*served_by.values())) == 2, served_by

    def test_a_trainer_job_publishes_a_policy_and_a_replaced_engine_catches_up(
        self, stack: Stack
    ) -> None:
        """The trainer's path in a cluster (docs/trainer.md, "In a cluster"): a Job of the
        tokenkeep image mounts the ModelServer's checkpoint claim read-write, writes
        /checkpoints/step-1 (a temporary name, then a rename) and publishes it as policy 1
        through the SessionServer's Service with the admin key. The checkpoint is the base
        model's config.json and safetensors (an init container of the engine image copies them
        out: the tokenkeep image has no torch to train with): the same weights under a new
        version, but the publish, the in-place reload, the version stamping and the catch-up
        are the real ones. Then both replicas serve "1" (GET /policy, the SessionServer's
        status.policy), a turn is stamped "1"; the engine pod that served it is deleted and
        comes back on its base weights ("default"), is fenced, reloaded from
        /checkpoints/step-1 by tokenkeep, and only then serves: no request reaches it before,
        every turn stored meanwhile carries version "1", and the session whose engine was
        replaced goes on as one segment (the only engine-pod replacement of the tier: each
        costs an engine start)."""
        node = stack.node
        started = time.monotonic()
        node.kubectl("apply", "-n", NS, "-f", "-", input=yaml.safe_dump(trainer_job(stack)))
        try:
            wait_for(lambda: job_done(node, "trainer-step-1"), timeout=300, interval=2)
        finally:
            print(node.kubectl("logs", "-n", NS, "job/trainer-step-1", "--all-containers",
                               check=False))  # fmt: skip
        node.timings["trainer_job_s"] = time.monotonic() - started
        [line] = [
            ln
            for ln in node.kubectl("logs", "-n", NS, "job/trainer-step-1").splitlines()
            if ln.startswith("{")
        ]
        published = json.loads(line)
        print(f"publish through the Service: {json.dumps(published)}")
        node.timings["publish_s"] = published["seconds"]
        assert published["version"] == "1", published
        assert len(published["replicas"]) == 2, published
        assert {(r["version"], r["state"]) for r in published["replicas"]} == {("1", "serving")}

        with stack.conversation().admin() as admin:
            policy = admin.get("/policy").json()
        assert policy["version"] == "1" and policy["source"] == {"path": "/checkpoints/step-1"}
        assert [(r["version"], r["state"]) for r in policy["replicas"]] == [("1", "serving")] * 2

        def policy_status() -> dict[str, Any]:
            status = node.json("get", "sessionserver", "rollouts", "-n", NS)["status"]
            assert status.get("policy", {}).get("summary") == "1 (2/2)", status.get("policy")
            return status["policy"]

        shown = wait_for(policy_status, timeout=120, interval=5)  # the operator polls every 30 s
        assert (shown["version"], shown["servingReplicas"]) == ("1", 2), shown
        assert "1 (2/2)" in node.kubectl("get", "sessionservers", "-n", NS)

        conversation = stack.conversation()
        conversation.turn()
        # The engine pod serving this session is replaced: its successor starts from the
        # image's model (base weights).
        victim = turn_served_by(node, conversation)
        assert weight_versions(conversation) == {"1"}
        old_pods = {p["metadata"]["name"] for p in live_engine_pods(node)}
        turns = TurnsMeanwhile(stack)
        turns.start()
        try:
            deleted_at = time.monotonic()
            node.kubectl("delete", "pod", "-n", NS, victim, "--wait=false")
            fresh = wait_for(lambda: ready_successor(node, old_pods), timeout=900, interval=0.5)
            ready_at = time.monotonic()
            node.timings["engine_replaced_s"] = ready_at - deleted_at
            ip = fresh["status"]["podIP"]
            metrics = f"http://{ip}:8000/metrics"
            headers = {"Authorization": f"Bearer {engine_key(node)}"}
            seen: list[tuple[float, str | None, str]] = []
            while True:
                # Requests it finished, read before the policy that says it is not serving
                # yet: any would have been served while it was behind.
                finished = finished_requests(metrics, headers)
                with conversation.admin() as admin:
                    replicas = admin.get("/policy").json()["replicas"]
                mine = [r for r in replicas if f"//{ip}:" in r["engine"]]
                if mine:
                    [replica] = mine
                    state = (replica["version"], replica["state"])
                    if not seen or seen[-1][1:] != state:
                        seen.append((round(time.monotonic() - ready_at, 2), *state))
                    if state == ("1", "serving"):
                        break
                    assert finished == 0, f"{ip} served {finished} requests while {state}"
                assert time.monotonic() - ready_at < 300, seen
                time.sleep(0.25)
            caught_up_s = time.monotonic() - ready_at
            node.timings["catch_up_after_ready_s"] = round(caught_up_s, 2)
            print(f"replaced engine {ip}: seen {seen}; serving 1 {caught_up_s:.2f}s after Ready")
            # Seen before it served: not serving "1" (it came back on "default").
            assert seen[0][1:] != ("1", "serving"), seen
            # Turns go on until one lands on the new replica.
            wait_for(lambda: finished_requests(metrics, headers) > 0, timeout=300, interval=2)
        finally:
            turns.stop()
        logs = node.kubectl("logs", "-n", NS, "-l", SESSION_PODS, "--tail=-1")
        assert f"engine http://{ip}:8000 fenced: behind: serves default, published 1" in logs
        assert f"engine http://{ip}:8000 caught up to policy 1" in logs
        assert turns.conversations and all(
            weight_versions(c) == {"1"} for c in turns.conversations if c.turns
        ), [(c.session_id, weight_versions(c)) for c in turns.conversations]
        print(f"turns meanwhile: {sum(len(c.turns) for c in turns.conversations)}")
        conversation.turn_when_served()
        conversation.assert_one_contiguous_segment()
        assert weight_versions(conversation) == {"1"}
        node.kubectl("delete", "job", "trainer-step-1", "-n", NS, "--cascade=foreground")


def trainer_job(stack: Stack) -> dict[str, Any]:
    """The trainer: writes /checkpoints/step-1 on the claim and publishes it (the client's
    `publish_policy`, admin key from the SessionServer's Secret). Labelled as a trainer of
    tiny-qwen3 (its NetworkPolicy lets it reach the engines)."""
    service = "http://rollouts-sessions.rl.svc.cluster.local:" + stack.base.rsplit(":", 1)[1]
    script = """
import json, os, shutil, time
from tokenkeep import Client
partial, final = "/checkpoints/.step-1.partial", "/checkpoints/step-1"
shutil.copytree("/base", partial)
os.rename(partial, final)  # a reader never sees half a checkpoint
started = time.monotonic()
policy = Client(os.environ["SESSIONS_URL"], api_key=os.environ["ADMIN_KEY"]).publish_policy(
    1, path=final, pause="keep"
)
print(json.dumps({
    "seconds": round(time.monotonic() - started, 3), "version": policy.version,
    "pause_seconds": policy.pause_seconds, "requests": policy.requests,
    "replicas": [{"version": r.version, "state": r.state, "seconds": r.seconds}
                 for r in policy.replicas],
}))
"""
    small = {"requests": {"cpu": "10m", "memory": "64Mi"}}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "trainer-step-1"},
        "spec": {
            "backoffLimit": 0,
            "template": {
                "metadata": {"labels": {"tokenkeep.dev/trainer": "tiny-qwen3"}},
                "spec": {
                    "restartPolicy": "Never",
                    "volumes": [
                        {
                            "name": "checkpoints",
                            "persistentVolumeClaim": {"claimName": CHECKPOINTS},
                        },
                        {"name": "base", "emptyDir": {}},
                    ],
                    "initContainers": [
                        {
                            "name": "base-weights",
                            "image": stack.node.images["engine"]["ref"],
                            "imagePullPolicy": "Never",
                            "command": [
                                "sh",
                                "-c",
                                "cp /models/tiny-qwen3/config.json "
                                "/models/tiny-qwen3/*.safetensors /base/ "
                                "&& chmod 0644 /base/*",
                            ],
                            "volumeMounts": [{"name": "base", "mountPath": "/base"}],
                            "resources": small,
                        }
                    ],
                    "containers": [
                        {
                            "name": "trainer",
                            "image": stack.node.images["tokenkeep"]["ref"],
                            "imagePullPolicy": "Never",
                            "command": ["python", "-c", script],
                            "env": [
                                {"name": "SESSIONS_URL", "value": service},
                                {
                                    "name": "ADMIN_KEY",
                                    "valueFrom": {
                                        "secretKeyRef": {
                                            "name": "rollouts-admin-key",
                                            "key": "admin-key",
                                        }
                                    },
                                },
                            ],
                            "volumeMounts": [
                                {"name": "checkpoints", "mountPath": "/checkpoints"},
                                {"name": "base", "mountPath": "/base", "readOnly": True},
                            ],
                            "resources": small,
                        }
                    ],
                },
            },
        },
    }


def job_done(node: Node, name: str) -> bool:
    status = node.json("get", "job", name, "-n", NS).get("status") or {}
    assert not status.get("failed"), f"job {name} failed: {status}"
    return bool(status.get("succeeded"))


def ready_successor(node: Node, old: set[str]) -> dict[str, Any] | None:
    """The engine pod not among `old`, once Ready."""
    for pod in live_engine_pods(node):
        if pod["metadata"]["name"] not in old and condition(pod, "Ready").get("status") == "True":
            return pod
    return None


def weight_versions(conversation: Conversation) -> set[str]:
    """The policy versions the stored turns of a session were sampled with."""
    return {
        span["version"]
        for branch in conversation.trajectory()["branches"]
        for segment in branch["segments"]
        for span in segment["weight_versions"]
    }


class TurnsMeanwhile:
    """Turns through the Service in a thread, two per session, new sessions all along (so
    that some land on a replica that comes back), until stopped."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.conversations: list[Conversation] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="turns-meanwhile", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                conversation = self.stack.conversation()
                self.conversations.append(conversation)
                for _ in range(2):
                    if self._stop.is_set():
                        break
                    conversation.turn_when_served()
        except BaseException as error:  # reported by stop()
            self.errors.append(error)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=600)
        assert not self._thread.is_alive(), "turns still running"
        assert not self.errors, self.errors


def test_helm_upgrade_rolls_the_session_servers_without_losing_a_session(stack: Stack) -> None:
    """`helm upgrade` to a new tokenkeep image tag (the same image under a second tag here):
    the operator pod rolls, the new one takes the Lease and renders the session servers with
    its image, their Deployment rolls, and a session begun before goes on from Redis."""
    node = stack.node
    conversation = stack.conversation()
    conversation.turn()
    conversation.turn()
    current = stack.node.images["tokenkeep"]["ref"]
    upgraded = current + "-upgrade"
    node.tag_image(current, upgraded)
    started = time.monotonic()
    node.helm(
        "upgrade", RELEASE, str(stack.chart), "-n", OPERATOR_NAMESPACE, "--reuse-values",
        "--set", f"image.tag={upgraded.split(':', 1)[1]}", "--wait", "--timeout", "5m",
    )  # fmt: skip

    def rolled() -> bool:
        deployment = node.json("get", "deployment", "rollouts-sessions", "-n", NS)
        [container] = deployment["spec"]["template"]["spec"]["containers"]
        status = deployment["status"]
        return (
            container["image"] == upgraded
            and status.get("updatedReplicas") == status.get("replicas") == 1
            and status.get("readyReplicas") == 1
            and pods_ready(node, SESSION_PODS, 1)
        )

    wait_for(rolled, timeout=600, interval=5)
    node.timings["helm_upgrade_rolled_s"] = time.monotonic() - started
    wait_for(lambda: ready(node, "sessionserver", "rollouts"), timeout=300, interval=5)
    conversation.turn_when_served()
    conversation.assert_one_contiguous_segment()


def test_faults_are_conditions_with_warnings_and_recover_once_fixed(stack: Stack) -> None:
    """A SessionServer naming a ModelServer that does not exist, then images missing on the
    node (ErrImageNeverPull) for its session server and its Redis (Redis down at start): each
    a condition and a Warning event saying what to do; once the cause is fixed (the reference
    corrected, the images imported) it becomes Ready with no edit of the resource. Meanwhile a
    ModelServer with a wrong model path crash-loops and says why. A SessionServer in front of a
    ModelServer scaled to 0 (no engine up) keeps its session API: its pods are Ready, a
    session is created, finished and exported, and a turn is a clean, retryable 503 in the
    API's own shape. The operator never restarts."""
    node = stack.node
    session_image = stack.node.images["tokenkeep"]["ref"] + "-fault"
    redis_image = stack.node.images["redis"]["ref"] + "-fault"
    faulty = {
        "apiVersion": "tokenkeep.dev/v1alpha1",
        "kind": "SessionServer",
        "metadata": {"name": "faulty"},
        "spec": {
            "modelServerRef": {"name": "absent"},
            "image": session_image,
            "imagePullPolicy": "Never",
            "resources": {"requests": {"cpu": "10m", "memory": "128Mi"}},
            "redis": {
                "mode": "Managed",
                "managed": {
                    "image": redis_image,
                    "storageSize": "64Mi",
                    "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}},
                },
            },
        },
    }
    broken = yaml.safe_load((EXAMPLES / "modelserver.yaml").read_text())
    broken["metadata"]["name"] = "wrong-path"
    broken["spec"]["model"]["uri"] = "file:///models/not-there"
    broken["spec"]["resources"] |= {"cpu": "10m", "memory": "2Gi"}
    stranded = {
        **faulty,
        "metadata": {"name": "stranded"},
        "spec": {
            **faulty["spec"],
            "modelServerRef": {"name": "idle"},
            "image": stack.node.images["tokenkeep"]["ref"],
            "redis": {
                "mode": "Managed",
                "managed": {
                    **faulty["spec"]["redis"]["managed"],
                    "image": stack.node.images["redis"]["ref"],
                },
            },
        },
    }
    idle = yaml.safe_load((EXAMPLES / "modelserver.yaml").read_text())
    idle["metadata"]["name"] = "idle"
    idle["spec"]["replicas"] = 0  # its engines are all gone: none is ever up
    objects = [faulty, broken, idle, stranded]
    node.kubectl("apply", "-n", NS, "-f", "-", input=yaml.safe_dump_all(objects))

    def fault(kind: str, name: str, reason: str) -> dict[str, Any]:
        obj = node.json("get", kind, name, "-n", NS)
        degraded = condition(obj, "Degraded")
        assert (degraded.get("status"), degraded.get("reason")) == ("True", reason), degraded
        assert condition(obj, "Ready")["status"] == "False"
        warnings = [e for e in events(node, name) if e[:2] == ("Warning", reason)]
        assert warnings, events(node, name)
        return degraded

    missing = wait_for(lambda: fault("sessionserver", "faulty", "ModelServerNotFound"), 120)
    assert "ModelServer absent does not exist" in missing["message"]

    node.kubectl("patch", "sessionserver", "faulty", "-n", NS, "--type=merge",
                 "-p", '{"spec": {"modelServerRef": {"name": "tiny-qwen3"}}}')  # fmt: skip
    pulled = wait_for(lambda: fault("sessionserver", "faulty", "ImagePullFailed"), 300, 5)
    assert "not present with pull policy of Never" in pulled["message"], pulled
    assert "load the image into the node" in pulled["message"], pulled

    crashed = wait_for(lambda: fault("modelserver", "wrong-path", "CrashLoop"), 600, 5)
    assert "its last log line:" in crashed["message"], crashed
    assert "not-there" in crashed["message"], crashed
    node.kubectl("delete", "modelserver", "wrong-path", "-n", NS, "--wait=false")
    session_api_without_engines(node, "stranded")
    node.kubectl("delete", "sessionserver", "stranded", "-n", NS, "--wait=false")
    node.kubectl("delete", "modelserver", "idle", "-n", NS, "--wait=false")

    # The fix: the images the resource names are put on the node. Nothing else is touched.
    node.tag_image(stack.node.images["tokenkeep"]["ref"], session_image)
    node.tag_image(stack.node.images["redis"]["ref"], redis_image)
    wait_for(lambda: ready(node, "sessionserver", "faulty"), timeout=600, interval=5)
    assert ("Normal", "Available") in [e[:2] for e in events(node, "faulty")]
    node.kubectl("delete", "sessionserver", "faulty", "-n", NS, "--timeout=300s")

    for operator in node.json("get", "pods", "-n", OPERATOR_NAMESPACE)["items"]:
        assert all(c["restartCount"] == 0 for c in operator["status"]["containerStatuses"])


def session_api_without_engines(node: Node, name: str) -> None:
    """SessionServer `name`, whose ModelServer never has an engine up: its pods and the
    resource are Ready (readiness needs Redis only); through its Service a
    session is created, a turn is refused at once with a retryable 503 in the OpenAI shape,
    and the session is finished and exported (issue 35: the session API stays up while
    engines restart)."""
    pods = f"app.kubernetes.io/name=tokenkeep,app.kubernetes.io/instance={name}"
    wait_for(lambda: pods_ready(node, pods, 1), timeout=600, interval=5)
    wait_for(lambda: ready(node, "sessionserver", name), timeout=300, interval=5)
    service = node.json("get", "service", f"{name}-sessions", "-n", NS)
    base = f"http://{service['spec']['clusterIP']}:{service['spec']['ports'][0]['port']}"
    secret = node.json("get", "secret", f"{name}-admin-key", "-n", NS)
    key = base64.b64decode(secret["data"]["admin-key"]).decode()
    session_id = f"stranded-{uuid.uuid4().hex[:8]}"
    with httpx.Client(
        base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=60
    ) as admin:
        assert admin.get("/readyz").status_code == 200
        created = admin.post("/sessions", json={"id": session_id})
        assert created.status_code == 201, created.text
        body = created.json()
        client = openai.OpenAI(
            base_url=body["openai_base_url"], api_key=body["api_key"], timeout=60, max_retries=0
        )
        with pytest.raises(openai.APIStatusError) as refused:
            client.chat.completions.create(
                model=session_id, messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
        assert refused.value.status_code == 503, refused.value
        assert "no engine replica is ready" in refused.value.message, refused.value.message
        assert refused.value.response.headers.get("retry-after"), refused.value.response.headers
        finished = admin.post(f"/sessions/{session_id}/finish", json={"reward": 0.0})
        assert finished.status_code == 200, finished.text
        exported = admin.post("/sessions/export", json={"session_ids": [session_id]})
        assert exported.status_code == 200, exported.text
        assert admin.get(f"/sessions/{session_id}").json()["id"] == session_id


def test_deleting_the_resources_and_uninstalling_leaves_nothing(stack: Stack) -> None:
    node = stack.node
    node.kubectl("delete", "-n", NS, "-f", str(EXAMPLES), "--timeout=300s")
    assert node.kubectl("get", "modelservers,sessionservers", "-n", NS, "-o", "name") == ""
    node.kubectl("delete", "pvc", CHECKPOINTS, "-n", NS, "--timeout=300s")
    node.helm("uninstall", RELEASE, "-n", OPERATOR_NAMESPACE, "--wait", "--timeout", "5m")
    # The Lease and the Deployment go with the release; the operator pod after its grace.
    assert node.kubectl("get", "lease,deployment", "-n", OPERATOR_NAMESPACE, "-o", "name") == ""
    wait_for(
        lambda: node.kubectl("get", "pods", "-n", OPERATOR_NAMESPACE, "-o", "name") == "",
        timeout=120,
    )
