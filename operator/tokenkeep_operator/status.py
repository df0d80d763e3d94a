"""Status of the custom resources, computed from the children the operator observes.

Pure functions: the observed objects (and the previous conditions, for transition times) in,
a status dict out. Because status is recomputed from reality every time a child changes, it
follows the cluster instead of freezing at whatever the last reconcile saw.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

READY, PROGRESSING, DEGRADED = "Ready", "Progressing", "Degraded"

# Reasons (CamelCase, as Kubernetes conditions use them).
AVAILABLE = "Available"
AS_EXPECTED = "AsExpected"
APPLY_FAILED = "ApplyFailed"
CRASH_LOOP = "CrashLoop"
IMAGE_PULL_FAILED = "ImagePullFailed"
INSUFFICIENT_GPU = "InsufficientGPU"
INVALID_SPEC = "InvalidSpec"
LEADER_WORKER_SET_MISSING = "LeaderWorkerSetMissing"
LOADING_MODEL = "LoadingModel"
MODEL_SERVER_NOT_FOUND = "ModelServerNotFound"
MODEL_SERVER_NOT_READY = "ModelServerNotReady"
PVC_PENDING = "PVCPending"
REDIS_NOT_READY = "RedisNotReady"
REPLICAS_UNAVAILABLE = "ReplicasUnavailable"
ROLLOUT_COMPLETE = "RolloutComplete"
ROLLOUT_STALLED = "RolloutStalled"
ROLLING_OUT = "RollingOut"
SCALED_TO_ZERO = "ScaledToZero"
SECRET_NOT_FOUND = "SecretNotFound"
STARTING = "Starting"
UNSCHEDULABLE = "Unschedulable"
WAITING_FOR_CHILDREN = "WaitingForChildren"
WAITING_FOR_VOLUME = "WaitingForVolume"


@dataclass(frozen=True)
class Problem:
    reason: str
    message: str


@dataclass(frozen=True)
class Workload:
    """A Deployment or StatefulSet with its pods and the claims its pods mount."""

    controller: dict[str, Any] | None
    pods: list[dict[str, Any]] = field(default_factory=list)
    claims: list[dict[str, Any]] = field(default_factory=list)


def leader_worker_set_as_workload(lws: dict[str, Any] | None) -> dict[str, Any] | None:
    """A LeaderWorkerSet read as the controller of a `Workload`: its status counts groups
    (replicas, readyReplicas, updatedReplicas, observedGeneration, as a Deployment's count
    pods), and a ready group is an available engine (LWS has no availableReplicas). An LWS
    whose controller never ran has no status: nothing is ready, nothing rolled out."""
    if lws is None:
        return None
    status = lws.get("status") or {}
    return {**lws, "status": {"availableReplicas": status.get("readyReplicas", 0), **status}}


def condition(type_: str, ok: bool, reason: str, message: str, generation: int) -> dict[str, Any]:
    return {
        "type": type_,
        "status": "True" if ok else "False",
        "reason": reason,
        "message": message,
        "observedGeneration": generation,
    }


def with_transition_times(
    conditions: list[dict[str, Any]], previous: Iterable[dict[str, Any]], now: str
) -> list[dict[str, Any]]:
    """lastTransitionTime changes only when a condition's status does."""
    before = {c.get("type"): c for c in previous}
    stamped = []
    for cond in conditions:
        old = before.get(cond["type"])
        unchanged = old is not None and old.get("status") == cond["status"]
        since = old.get("lastTransitionTime") if unchanged and old else None
        stamped.append({**cond, "lastTransitionTime": since or now})
    return stamped


def changed_conditions(
    new: list[dict[str, Any]], previous: Iterable[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Conditions whose status or reason differ from before: each deserves an event."""
    before = {c.get("type"): (c.get("status"), c.get("reason")) for c in previous}
    return [c for c in new if before.get(c["type"]) != (c["status"], c["reason"])]


def pod_problems(pods: list[dict[str, Any]], gpu_resource: str | None = None) -> list[Problem]:
    """Why pods cannot run, as kubelet and scheduler report it, most actionable first."""
    found: dict[str, Problem] = {}
    for pod in pods:
        name = pod["metadata"]["name"]
        status = pod.get("status", {})
        for cond in status.get("conditions", []):
            if cond.get("type") == "PodScheduled" and cond.get("reason") == "Unschedulable":
                message = cond.get("message", "")
                if gpu_resource and f"Insufficient {gpu_resource}" in message:
                    reason = INSUFFICIENT_GPU
                elif "unbound" in message and "PersistentVolumeClaim" in message:
                    reason = PVC_PENDING
                else:
                    reason = UNSCHEDULABLE
                found.setdefault(reason, Problem(reason, f"pod {name}: {message}"))
        statuses = status.get("initContainerStatuses", []) + status.get("containerStatuses", [])
        for container in statuses:
            waiting = container.get("state", {}).get("waiting") or {}
            why, message = waiting.get("reason", ""), waiting.get("message", "")
            if why == "CreateContainerConfigError" and "secret" in message.lower():
                reason = SECRET_NOT_FOUND
            elif why in {"ErrImagePull", "ImagePullBackOff", "InvalidImageName"}:
                reason = IMAGE_PULL_FAILED
            elif why == "ErrImageNeverPull":
                reason = IMAGE_PULL_FAILED
                message += (
                    " (imagePullPolicy Never: load the image into the node's container runtime,"
                    " or let it be pulled from a registry)"
                )
            elif why == "CrashLoopBackOff":
                reason = CRASH_LOOP
                message = crash_message(name, container)
            else:
                continue
            text = f"pod {name}, container {container.get('name')}: {why}: {message}"
            found.setdefault(reason, Problem(reason, text.rstrip(": ")))
    order = [
        SECRET_NOT_FOUND,
        IMAGE_PULL_FAILED,
        INSUFFICIENT_GPU,
        PVC_PENDING,
        UNSCHEDULABLE,
        CRASH_LOOP,
    ]
    return [found[r] for r in order if r in found]


def crash_message(pod_name: str, container: dict[str, Any]) -> str:
    """How a crash-looping container last ended: its exit code and the last line it wrote
    (kubelet keeps the log's tail as the termination message under FallbackToLogsOnError),
    e.g. vLLM's `... is not a valid model path` when the model path is wrong."""
    last = container.get("lastState", {}).get("terminated") or {}
    if not last:
        return ""
    message = f"last exit {last.get('exitCode')} ({last.get('reason', '')})"
    lines = [line.strip() for line in (last.get("message") or "").splitlines() if line.strip()]
    if lines:
        message += f", its last log line: {lines[-1][:300]}"
    shown = f"kubectl logs --previous {pod_name} -c {container.get('name', '')}"
    return f"{message}; `{shown}` shows the rest"


def claim_waits(claims: list[dict[str, Any]], pods: list[dict[str, Any]]) -> list[Problem]:
    """Pending claims that pods wait for. Not a fault by itself: a WaitForFirstConsumer claim
    stays Pending until its pod is scheduled, and provisioning takes a while. A claim that
    really blocks is a fault the scheduler reports on the pod (see `pod_problems`)."""
    if not any(p.get("status", {}).get("phase", "Pending") == "Pending" for p in pods):
        return []
    return [
        Problem(
            WAITING_FOR_VOLUME,
            f"PersistentVolumeClaim {c['metadata']['name']} is Pending "
            "(a WaitForFirstConsumer claim binds once its pod is scheduled)",
        )
        for c in claims
        if c.get("status", {}).get("phase", "Pending") == "Pending"
    ]


def _is_loading(pods: list[dict[str, Any]]) -> bool:
    """Some container runs but has not passed its startup probe: the model is loading."""
    return any(
        "running" in c.get("state", {}) and not c.get("started", False)
        for pod in pods
        for c in pod.get("status", {}).get("containerStatuses", [])
    )


def _lost_replicas(pods: list[dict[str, Any]]) -> list[Problem]:
    """Replicas that had started (loaded the model) and then stopped passing readiness:
    unlike one still loading, this is a failure."""
    lost = [
        pod["metadata"]["name"]
        for pod in pods
        for c in pod.get("status", {}).get("containerStatuses", [])
        if c.get("started") and not c.get("ready")
    ]
    if not lost:
        return []
    return [Problem(REPLICAS_UNAVAILABLE, f"started but not ready: {', '.join(sorted(lost))}")]


def pod_phases(pods: list[dict[str, Any]]) -> tuple[int, int]:
    """(running, pending) pods, by phase: a pod is running once the kubelet started it."""
    phases = [p.get("status", {}).get("phase", "Pending") for p in pods]
    return phases.count("Running"), phases.count("Pending")


def counts(workload: Workload) -> dict[str, int]:
    """The status counts: replicas (pods the controller made), readyReplicas (passing
    readiness), availableReplicas (ready for minReadySeconds), as the controller reports."""
    status = (workload.controller or {}).get("status", {})
    return {
        "replicas": status.get("replicas", 0),
        "readyReplicas": status.get("readyReplicas", 0),
        "availableReplicas": status.get("availableReplicas", 0),
    }


def progress(workload: Workload, desired: int) -> str:
    """E.g. `0 of 3 replicas ready, 0 available; pods: 1 running, 2 pending`."""
    found = counts(workload)
    running, pending = pod_phases(workload.pods)
    return (
        f"{found['readyReplicas']} of {desired} replicas ready, "
        f"{found['availableReplicas']} available; pods: {running} running, {pending} pending"
    )


@dataclass(frozen=True)
class Rollout:
    desired: int
    ready: int
    rolled_out: bool
    stalled: bool


def rollout(controller: dict[str, Any], desired: int) -> Rollout:
    meta, status = controller.get("metadata", {}), controller.get("status", {})
    generation = meta.get("generation", 1)
    replicas = status.get("replicas", 0)
    rolled_out = (
        status.get("observedGeneration", 0) >= generation
        and status.get("updatedReplicas", 0) == desired
        and replicas == desired
    )
    stalled = any(
        c.get("type") == "Progressing" and c.get("reason") == "ProgressDeadlineExceeded"
        for c in status.get("conditions", [])
    )
    return Rollout(
        desired=desired,
        ready=status.get("readyReplicas", 0),
        rolled_out=rolled_out,
        stalled=stalled,
    )


def workload_conditions(
    workload: Workload,
    desired: int,
    generation: int,
    *,
    what: str,
    gpu_resource: str | None = None,
    waiting: Problem | None = None,
) -> list[dict[str, Any]]:
    """Ready / Progressing / Degraded of one workload. `waiting` names an outside reason
    (e.g. the ModelServer is not ready) that explains unready pods better than they do."""
    if workload.controller is None:
        message = f"{what} not created yet"
        return [
            condition(READY, False, WAITING_FOR_CHILDREN, message, generation),
            condition(PROGRESSING, True, WAITING_FOR_CHILDREN, message, generation),
            condition(DEGRADED, False, AS_EXPECTED, "", generation),
        ]
    state = rollout(workload.controller, desired)
    problems = pod_problems(workload.pods, gpu_resource)
    volume_waits = claim_waits(workload.claims, workload.pods)
    if state.stalled and not problems:
        problems.append(Problem(ROLLOUT_STALLED, f"{what} rollout exceeded its deadline"))
    if not problems:
        problems += _lost_replicas(workload.pods)
    all_ready = state.ready >= desired
    if desired == 0:
        ready = condition(READY, False, SCALED_TO_ZERO, f"{what} has 0 replicas", generation)
    elif all_ready and state.rolled_out:
        message = f"{state.ready} of {desired} replicas ready"
        ready = condition(READY, True, AVAILABLE, message, generation)
    else:
        if problems:
            reason, message = problems[0].reason, problems[0].message
        elif waiting is not None:
            reason, message = waiting.reason, waiting.message
        elif volume_waits:
            reason, message = volume_waits[0].reason, volume_waits[0].message
        elif gpu_resource and _is_loading(workload.pods):
            reason, message = LOADING_MODEL, "vLLM is loading the model (startup probe pending)"
        else:
            reason, message = STARTING, progress(workload, desired)
        ready = condition(READY, False, reason, message, generation)
    if state.rolled_out and all_ready:
        message = f"{what} rollout complete"
        progressing = condition(PROGRESSING, False, ROLLOUT_COMPLETE, message, generation)
    elif state.stalled:
        progressing = condition(
            PROGRESSING, False, ROLLOUT_STALLED, problems[0].message, generation
        )
    else:
        reason = LOADING_MODEL if gpu_resource and _is_loading(workload.pods) else ROLLING_OUT
        progressing = condition(PROGRESSING, True, reason, progress(workload, desired), generation)
    if problems:
        degraded = condition(DEGRADED, True, problems[0].reason, problems[0].message, generation)
    else:
        degraded = condition(DEGRADED, False, AS_EXPECTED, "", generation)
    return [ready, progressing, degraded]


def blocked_conditions(reason: str, message: str, generation: int) -> list[dict[str, Any]]:
    """The resource cannot be acted on until the user changes something."""
    return [
        condition(READY, False, reason, message, generation),
        condition(PROGRESSING, False, reason, message, generation),
        condition(DEGRADED, True, reason, message, generation),
    ]


def get_condition(conditions: Iterable[dict[str, Any]], type_: str) -> dict[str, Any] | None:
    return next((c for c in conditions if c.get("type") == type_), None)


# --- the published policy (SessionServer status.policy) ----------------------------------

POLICY_UNKNOWN = "unknown"
POLICY_UNSUPPORTED = "unsupported"
# Shown instead of a version before the first publish: the engines serve spec.model.uri.
POLICY_BASE = "base"
MAX_POLICY_MESSAGE = 1024


# Every field, null where unknown: status is merge-patched, and null deletes what an earlier
# write put there (a version no longer known must not stay behind).
POLICY_FIELDS = ("version", "publishedAt", "engineReplicas", "servingReplicas", "message")


def _policy(summary: str, **fields: Any) -> dict[str, Any]:
    return {"summary": summary, **dict.fromkeys(POLICY_FIELDS), **fields}


def policy_unknown(message: str) -> dict[str, Any]:
    return _policy(POLICY_UNKNOWN, message=message)


def policy_unsupported(url: str) -> dict[str, Any]:
    message = f"{url} answers 404: the session server's image predates policy publishing"
    return _policy(POLICY_UNSUPPORTED, message=message)


def _timestamp(seconds: Any) -> str | None:
    if not isinstance(seconds, int | float) or isinstance(seconds, bool):
        return None
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def policy_status(answer: Any) -> dict[str, Any]:
    """status.policy from the body of the session server's GET /policy: the published
    version, when, how many engine replicas the server knows and how many serve turns with
    that version (`state: serving` at the published version), and which do not, and why."""
    if not isinstance(answer, dict) or not isinstance(answer.get("replicas", []), list):
        return policy_unknown("GET /policy answered something other than a policy")
    version = answer.get("version")
    version = None if version is None else str(version)
    replicas = [r for r in answer.get("replicas") or [] if isinstance(r, dict)]

    def serves(replica: dict[str, Any]) -> bool:
        if replica.get("state") != "serving" or replica.get("tokenizer"):
            return False
        return version is None or str(replica.get("version")) == version

    serving = sum(1 for r in replicas if serves(r))
    shown = version if version is not None else POLICY_BASE
    status = _policy(
        f"{shown} ({serving}/{len(replicas)})",
        version=version,
        publishedAt=_timestamp(answer.get("published_at")),
        engineReplicas=len(replicas),
        servingReplicas=serving,
    )
    behind = [
        f"{r.get('engine')} {r.get('state')}"
        + (f" at {r.get('version')}" if r.get("version") is not None else "")
        + (f": {r.get('reason')}" if r.get("reason") else "")
        + (f": tokenizer {r.get('tokenizer')}" if r.get("tokenizer") else "")
        for r in replicas
        if not serves(r)
    ]
    if behind:
        status["message"] = "; ".join(behind)[:MAX_POLICY_MESSAGE]
    return status


# --- what the session server says of its engines and its store (SessionServer conditions) ---

TOKENIZER_MISMATCH = "TokenizerMismatch"
TOKENIZER_MATCHES = "TokenizerMatches"
STORE_FULL = "StoreFull"
STORE_HAS_ROOM = "StoreHasRoom"
STORE_FULL_FRACTION = 0.95
"""Used memory over this share of maxmemory counts as full: with noeviction Redis refuses any
write that would pass maxmemory, so a store this close already refuses long turns."""


def server_conditions(answer: Any, generation: int) -> list[dict[str, Any]]:
    """`TokenizerMismatch` and `StoreFull` from the session server's GET /policy answer (its
    replicas' tokenizer comparison, its store's memory); none where the answer does not say
    (an older image, a store without a memory bound)."""
    if not isinstance(answer, dict):
        return []
    conditions = []
    replicas = [r for r in answer.get("replicas") or [] if isinstance(r, dict)]
    if replicas and all("tokenizer" in r for r in replicas):
        differ = [r for r in replicas if str(r.get("tokenizer") or "").startswith("mismatch")]
        message = (
            "; ".join(f"{r.get('engine')}: {r.get('tokenizer')}" for r in differ)
            if differ
            else f"{len(replicas)} engine replicas compared with the session server's tokenizer"
        )
        conditions.append(
            condition(
                TOKENIZER_MISMATCH,
                bool(differ),
                TOKENIZER_MISMATCH if differ else TOKENIZER_MATCHES,
                message[:MAX_POLICY_MESSAGE],
                generation,
            )
        )
    store = answer.get("store")
    if isinstance(store, dict):
        used, most = store.get("used_bytes"), store.get("max_bytes")
        if isinstance(used, int) and isinstance(most, int) and most > 0:
            full = used >= STORE_FULL_FRACTION * most
            message = (
                f"Redis uses {used} of its maxmemory {most} bytes ({100 * used // most}%); "
                f"{store.get('full_refusals', 0)} writes refused as full since the server started"
            )
            if full:
                message += (
                    "; turns get a retryable 503: finish and export sessions, or raise "
                    "redis.managed.maxMemory"
                )
            reason = STORE_FULL if full else STORE_HAS_ROOM
            conditions.append(condition(STORE_FULL, full, reason, message, generation))
    return conditions
