"""Conditions computed from observed children: what kubelet and scheduler report becomes a
reason a user can act on."""

from __future__ import annotations

from typing import Any

from tokenkeep_operator import status as st
from tokenkeep_operator.reconcile import event_for


def deployment(replicas: int, ready: int, generation: int = 1, **extra: Any) -> dict[str, Any]:
    return {
        "metadata": {"generation": generation, "annotations": {"tokenkeep.dev/generation": "4"}},
        "spec": {"replicas": replicas},
        "status": {
            "observedGeneration": generation,
            "replicas": replicas,
            "updatedReplicas": replicas,
            "readyReplicas": ready,
            **extra,
        },
    }


def pod(status: dict[str, Any], name: str = "p") -> dict[str, Any]:
    return {"metadata": {"name": name}, "status": status}


def waiting(reason: str, message: str) -> dict[str, Any]:
    return {
        "phase": "Pending",
        "containerStatuses": [
            {"name": "vllm", "state": {"waiting": {"reason": reason, "message": message}}}
        ],
    }


def conditions_of(workload: st.Workload, desired: int = 1) -> dict[str, tuple[str, str]]:
    found = st.workload_conditions(workload, desired, 4, what="vLLM", gpu_resource="nvidia.com/gpu")
    return {c["type"]: (c["status"], c["reason"]) for c in found}


def test_all_replicas_ready_is_available() -> None:
    assert conditions_of(st.Workload(deployment(2, 2)), desired=2) == {
        "Ready": ("True", "Available"),
        "Progressing": ("False", "RolloutComplete"),
        "Degraded": ("False", "AsExpected"),
    }


def test_reasons_come_from_pod_states() -> None:
    cases = {
        "SecretNotFound": waiting("CreateContainerConfigError", 'secret "hf-token" not found'),
        "ImagePullFailed": waiting("ImagePullBackOff", "Back-off pulling image"),
        "CrashLoop": waiting("CrashLoopBackOff", "back-off 5m0s"),
        "InsufficientGPU": {
            "phase": "Pending",
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
                }
            ],
        },
        "PVCPending": {
            "phase": "Pending",
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": "0/3 nodes are available: "
                    "pod has unbound immediate PersistentVolumeClaims.",
                }
            ],
        },
    }
    for reason, pod_status in cases.items():
        found = conditions_of(st.Workload(deployment(1, 0), [pod(pod_status)]))
        assert found["Ready"] == ("False", reason), reason
        assert found["Degraded"] == ("True", reason), reason


def test_an_image_missing_on_the_node_says_what_to_do() -> None:
    missing = waiting(
        "ErrImageNeverPull",
        'Container image "tokenkeep/vllm-cpu:x" is not present with pull policy of Never',
    )
    found = conditions_of(st.Workload(deployment(1, 0), [pod(missing, "engine-0")]))
    assert found["Degraded"] == ("True", "ImagePullFailed")
    [problem] = st.pod_problems([pod(missing, "engine-0")])
    assert '"tokenkeep/vllm-cpu:x" is not present' in problem.message
    assert "load the image into the node" in problem.message


def test_an_engine_crashing_at_start_quotes_its_last_log_line() -> None:
    """A wrong model path: vLLM exits at start, kubelet keeps the log's tail as the
    termination message (FallbackToLogsOnError), the condition quotes its last line and
    names the command that shows the rest."""
    crashed = {
        "phase": "Running",
        "containerStatuses": [
            {
                "name": "vllm",
                "restartCount": 2,
                "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 20s"}},
                "lastState": {
                    "terminated": {
                        "exitCode": 1,
                        "reason": "Error",
                        "message": "Traceback (most recent call last):\n  ...\n"
                        "OSError: /models/nope is not a local folder\n\n",
                    }
                },
            }
        ],
    }
    [problem] = st.pod_problems([pod(crashed, "tiny-engine-0")])
    assert problem.reason == "CrashLoop"
    assert "last exit 1 (Error)" in problem.message
    assert "its last log line: OSError: /models/nope is not a local folder" in problem.message
    assert "kubectl logs --previous tiny-engine-0 -c vllm" in problem.message


def test_a_fault_is_one_warning_and_its_fix_one_normal_event() -> None:
    """A SessionServer naming a ModelServer that does not exist: a Warning an admin can act
    on, once (no event while nothing changes); once the ModelServer exists, progress is
    Normal."""
    missing = st.blocked_conditions(
        "ModelServerNotFound", "ModelServer tiny does not exist in namespace rl", 1
    )
    assert event_for(missing, []) == (
        "Warning",
        "ModelServerNotFound",
        "ModelServer tiny does not exist in namespace rl",
    )
    assert event_for(missing, missing) is None
    starting = st.workload_conditions(st.Workload(deployment(1, 0)), 1, 1, what="session server")
    kind, reason, _ = event_for(starting, missing) or ("", "", "")
    assert (kind, reason) == ("Normal", "Starting")


def test_the_most_actionable_reason_wins() -> None:
    pods = [
        pod(waiting("CrashLoopBackOff", ""), "a"),
        pod(waiting("CreateContainerConfigError", 'secret "x" not found'), "b"),
    ]
    assert conditions_of(st.Workload(deployment(2, 0), pods), 2)["Degraded"] == (
        "True",
        "SecretNotFound",
    )


def test_loading_model_is_progress_not_degradation() -> None:
    loading = {
        "phase": "Running",
        "containerStatuses": [{"name": "vllm", "started": False, "state": {"running": {}}}],
    }
    found = conditions_of(st.Workload(deployment(1, 0), [pod(loading)]))
    assert found == {
        "Ready": ("False", "LoadingModel"),
        "Progressing": ("True", "LoadingModel"),
        "Degraded": ("False", "AsExpected"),
    }


def test_a_pending_claim_is_waited_for_not_a_fault() -> None:
    """A WaitForFirstConsumer claim is Pending until its pod is scheduled: Ready says why it
    waits, Degraded stays False. Only the scheduler saying the claim blocks is a fault."""
    claim = {"metadata": {"name": "cache"}, "status": {"phase": "Pending"}}
    assert conditions_of(st.Workload(deployment(1, 0), [], [claim]))["Degraded"][0] == "False"
    found = conditions_of(st.Workload(deployment(1, 0), [pod({"phase": "Pending"})], [claim]))
    assert found["Ready"] == ("False", "WaitingForVolume")
    assert found["Degraded"] == ("False", "AsExpected")
    blocked = {
        "phase": "Pending",
        "conditions": [
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": "0/3 nodes are available: 3 pod has unbound immediate "
                "PersistentVolumeClaims.",
            }
        ],
    }
    found = conditions_of(st.Workload(deployment(1, 0), [pod(blocked)], [claim]))
    assert found["Degraded"] == ("True", "PVCPending")


def test_counts_say_what_pods_do() -> None:
    workload = st.Workload(
        deployment(3, 1), [pod({"phase": "Running"}), pod({"phase": "Pending"}), pod({})]
    )
    assert (
        st.progress(workload, 3) == "1 of 3 replicas ready, 0 available; pods: 1 running, 2 pending"
    )


def test_stalled_rollout_and_lost_replicas_degrade() -> None:
    deadline = {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded"}
    found = conditions_of(st.Workload(deployment(1, 0, conditions=[deadline])))
    assert found["Progressing"] == ("False", "RolloutStalled")
    assert found["Degraded"] == ("True", "RolloutStalled")
    unready = {
        "phase": "Running",
        "containerStatuses": [
            {"name": "vllm", "started": True, "ready": False, "state": {"running": {}}}
        ],
    }
    found = conditions_of(st.Workload(deployment(3, 2), [pod(unready, "p-2")]), 3)
    assert found["Degraded"] == ("True", "ReplicasUnavailable")
    assert found["Ready"] == ("False", "ReplicasUnavailable")


def test_scaled_to_zero_and_missing_children() -> None:
    assert conditions_of(st.Workload(deployment(0, 0)), 0)["Ready"] == ("False", "ScaledToZero")
    assert conditions_of(st.Workload(None))["Ready"] == ("False", "WaitingForChildren")


def test_transition_time_moves_only_when_status_does() -> None:
    before = [{"type": "Ready", "status": "False", "reason": "A", "lastTransitionTime": "t0"}]
    same = [{"type": "Ready", "status": "False", "reason": "B", "message": ""}]
    assert st.with_transition_times(same, before, "t1")[0]["lastTransitionTime"] == "t0"
    flipped = [{"type": "Ready", "status": "True", "reason": "B", "message": ""}]
    assert st.with_transition_times(flipped, before, "t1")[0]["lastTransitionTime"] == "t1"
    assert st.changed_conditions(same, before) == same
    assert st.changed_conditions(before, before) == []


# --- the published policy: SessionServer status.policy from GET /policy ---------------------

POLICY = {
    "version": "12",
    "source": {"path": "/checkpoints/step-12"},
    "published_at": 1764288000.5,
    "replicas": [
        {"engine": "http://10.0.0.1:8000", "version": "12", "state": "serving", "reason": None,
         "checksum": "ab"},
        {"engine": "http://10.0.0.2:8000", "version": "11", "state": "fenced",
         "reason": "reload failed: 500", "checksum": None},
    ],
}  # fmt: skip


def test_policy_status_counts_the_replicas_serving_the_published_version() -> None:
    found = st.policy_status(POLICY)
    assert found["summary"] == "12 (1/2)"
    assert (found["version"], found["engineReplicas"], found["servingReplicas"]) == ("12", 2, 1)
    assert found["publishedAt"] == "2025-11-28T00:00:00Z"
    assert found["message"] == "http://10.0.0.2:8000 fenced at 11: reload failed: 500"
    # Serving, but at another version, does not count as serving this one.
    stale = {**POLICY, "replicas": [{**POLICY["replicas"][0], "version": "11"}]}
    assert st.policy_status(stale)["summary"] == "12 (0/1)"


def test_policy_status_before_any_publish_and_for_odd_answers() -> None:
    base = {"version": None, "source": None, "published_at": None, "replicas": [
        {"engine": "e1", "version": "default", "state": "serving"},
        {"engine": "e2", "version": None, "state": "serving"},
    ]}  # fmt: skip
    found = st.policy_status(base)
    assert found["summary"] == "base (2/2)" and found["version"] is None
    assert found["message"] is None and found["publishedAt"] is None
    assert st.policy_status({"version": 7, "replicas": []})["summary"] == "7 (0/0)"
    assert st.policy_status(None)["summary"] == "unknown"
    assert st.policy_status({"replicas": "x"})["summary"] == "unknown"
    # Every field is always there (null where unknown): a merge patch then deletes what an
    # earlier status said.
    for status in (found, st.policy_unknown("x"), st.policy_unsupported("u"), st.policy_status(1)):
        assert set(status) == {"summary", *st.POLICY_FIELDS}


class FakeKube:
    """What Reconciler.published_policy and _write_status use of the API server."""

    def __init__(self, secret: dict[str, Any] | Exception | None) -> None:
        self.secret = secret
        self.patches: list[dict[str, Any]] = []
        self.events: list[tuple[str, ...]] = []

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> Any:
        assert (api_version, kind, namespace) == ("v1", "Secret", "rl")
        if isinstance(self.secret, Exception):
            raise self.secret
        return self.secret if self.secret and self.secret["metadata"]["name"] == name else None

    def patch_status(self, kind: str, namespace: str, name: str, status: dict[str, Any]) -> None:
        self.patches.append(status)

    def post_event(self, body: dict[str, Any], *event: str) -> None:
        self.events.append(event)


def _secret(name: str, key: str, value: str) -> dict[str, Any]:
    import base64

    return {"metadata": {"name": name}, "data": {key: base64.b64encode(value.encode()).decode()}}


def _reconciler(kube: Any, answer: Any) -> tuple[Any, list[tuple[str, str]]]:
    from tokenkeep_operator.reconcile import Reconciler

    asked: list[tuple[str, str]] = []

    def asker(url: str, key: str) -> tuple[int, Any]:
        asked.append((url, key))
        if isinstance(answer, Exception):
            raise answer
        return answer

    return Reconciler(kube, "img", clock=lambda: "t", policy_asker=asker), asked


def test_the_operator_asks_the_session_servers_service_with_the_admin_key() -> None:
    from kubernetes.client import ApiException

    from tokenkeep_operator.models import SessionServerSpec

    spec = SessionServerSpec.model_validate({"modelServerRef": {"name": "m"}})
    kube = FakeKube(_secret("rollouts-admin-key", "admin-key", "s3cret"))
    reconciler, asked = _reconciler(kube, (200, POLICY))
    assert reconciler.published_policy("rl", "rollouts", spec, ready=1) == (
        st.policy_status(POLICY),
        POLICY,
    )
    assert st.policy_status(POLICY)["summary"] == "12 (1/2)"
    assert asked == [("http://rollouts-sessions.rl.svc:8000/policy", "s3cret")]
    # A named admin key Secret is the one read.
    named = SessionServerSpec.model_validate(
        {"modelServerRef": {"name": "m"}, "apiKeySecretRef": {"name": "mine", "key": "k"}}
    )
    reconciler, asked = _reconciler(FakeKube(_secret("mine", "k", "other")), (200, POLICY))
    reconciler.published_policy("rl", "rollouts", named, ready=1)
    assert asked[0][1] == "other"

    def policy(kube: Any, answer: Any, ready: int = 1) -> dict[str, Any]:
        status, answered = _reconciler(kube, answer)[0].published_policy(
            "rl", "rollouts", spec, ready
        )
        assert answered is None  # no conditions are read from an answer that is not one
        return status

    # Nothing asked of a server with no ready replica.
    assert policy(kube, AssertionError("asked"), ready=0)["summary"] == "unknown"
    # An older image (404), a server down, a refusal, a key that cannot be read: no failure.
    assert policy(kube, (404, None))["summary"] == "unsupported"
    down = policy(kube, OSError("connection refused"))
    assert down["summary"] == "unknown" and "connection refused" in down["message"]
    assert "401" in policy(kube, (401, None))["message"]
    forbidden = FakeKube(ApiException(status=403, reason="Forbidden"))
    assert "not readable" in policy(forbidden, (200, POLICY))["message"]
    assert "has no key" in policy(FakeKube(None), (200, POLICY))["message"]


def test_a_policy_status_unchanged_is_not_written_and_a_lost_version_is_deleted() -> None:
    """Status is merge-patched, so the server never stores the nulls the operator sends:
    the same policy compared with the stored one is no write (an idle cluster sees none),
    and a policy that became unknown sends version null, which deletes the stale one."""
    kube = FakeKube(None)
    reconciler, _ = _reconciler(kube, None)
    stored_unknown = {k: v for k, v in st.policy_unknown("m").items() if v is not None}
    body = {
        "kind": "SessionServer",
        "metadata": {"name": "s", "namespace": "rl", "uid": "u"},
        "status": {"policy": stored_unknown, "conditions": []},
    }
    reconciler._write_status(body, {"policy": st.policy_unknown("m"), "conditions": []})
    assert kube.patches == []
    body["status"]["policy"] = {k: v for k, v in st.policy_status(POLICY).items() if v}
    reconciler._write_status(body, {"policy": st.policy_unknown("m"), "conditions": []})
    (patch,) = kube.patches
    assert patch["policy"]["version"] is None and patch["policy"]["summary"] == "unknown"


def test_ask_policy_over_http() -> None:
    import http.server
    import json
    import socket
    import threading

    import pytest

    from tokenkeep_operator.reconcile import ask_policy

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path != "/policy":
                self.send_response(404)
                self.end_headers()
                return
            ok = self.headers.get("Authorization") == "Bearer k"
            body = json.dumps(POLICY if ok else {"error": "no"}).encode()
            self.send_response(200 if ok else 401)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert ask_policy(f"{url}/policy", "k") == (200, POLICY)
        assert ask_policy(f"{url}/policy", "wrong") == (401, None)
        assert ask_policy(f"{url}/older", "k") == (404, None)
    finally:
        server.shutdown()
        server.server_close()
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    with pytest.raises(OSError):
        ask_policy(f"http://127.0.0.1:{port}/policy", "k")


def test_tokenizer_and_store_conditions_from_the_servers_answer() -> None:
    """What the session server's GET /policy says of its engines' tokenizers and its store
    becomes the SessionServer's TokenizerMismatch and StoreFull conditions (status.policy
    no longer counts a replica whose tokenizer differs as serving)."""
    mismatch = "mismatch: the engine's tokenizer gives 156 ids for the probe text, ..."
    answer = {
        **POLICY,
        "replicas": [
            {**POLICY["replicas"][0], "tokenizer": None},
            {**POLICY["replicas"][0], "engine": "http://10.0.0.3:8000", "tokenizer": mismatch},
        ],
        "store": {"used_bytes": 1_000_000_000, "max_bytes": 1_040_000_000, "full_refusals": 3},
    }
    tokenizer, store = st.server_conditions(answer, 4)
    assert (tokenizer["type"], tokenizer["status"], tokenizer["reason"]) == (
        "TokenizerMismatch",
        "True",
        "TokenizerMismatch",
    )
    assert tokenizer["message"] == f"http://10.0.0.3:8000: {mismatch}"
    assert (store["type"], store["status"], store["reason"]) == ("StoreFull", "True", "StoreFull")
    assert store["message"].startswith(
        "Redis uses 1000000000 of its maxmemory 1040000000 bytes (96%); 3 writes refused"
    )
    assert "redis.managed.maxMemory" in store["message"] and store["observedGeneration"] == 4
    assert st.policy_status(answer)["summary"] == "12 (1/2)"
    assert "tokenizer mismatch" in st.policy_status(answer)["message"]

    answer["replicas"][1]["tokenizer"] = None
    answer["store"] = {"used_bytes": 10, "max_bytes": 1000, "full_refusals": 0}
    tokenizer, store = st.server_conditions(answer, 4)
    assert (tokenizer["status"], tokenizer["reason"]) == ("False", "TokenizerMatches")
    assert (store["status"], store["reason"]) == ("False", "StoreHasRoom")
    # An older server (no tokenizer field), an unbounded or embedded store: no condition.
    assert st.server_conditions(POLICY, 4) == []
    assert st.server_conditions({**POLICY, "store": {"used_bytes": 5, "max_bytes": 0}}, 4) == []
    assert st.server_conditions({**POLICY, "store": None}, 4) == []
    assert st.server_conditions(None, 4) == []
