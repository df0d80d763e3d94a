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
