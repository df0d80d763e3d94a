"""`spec.podTemplate`: a user's partial pod merged into the pod the operator renders.

The merge follows Kubernetes' strategic merge for the fields a pod has: lists of named things
(containers, volumes, env, ...) merge item by item on their key, maps merge key by key,
tolerations are appended; anything else the operator renders keeps the operator's value. Every
place where the user asked for a value other than the operator's is returned as a conflict
(`spec.podTemplate.<path>: ...`), which the reconciler reports as an Event: the rendered pod
is what the operator needs to run the engine or the session server, so it always wins.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from tokenkeep_operator.models import PodTemplate

# Lists merged item by item: the key that identifies an item.
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "volumes": "name",
    "imagePullSecrets": "name",
    "env": "name",
    "volumeMounts": "mountPath",
    "volumeDevices": "devicePath",
    "ports": "containerPort",
}
# Keyed lists whose items merge field by field (a container); in the others an item the
# operator renders is kept whole (a volume with two sources, or an env var with both a value
# and a valueFrom, would be invalid).
MERGED_ITEMS = {"containers", "initContainers", "ephemeralContainers"}
# Lists whose items are added to the operator's (set union, order kept).
UNION_LISTS = {"tolerations", "add", "drop", "topologySpreadConstraints", "envFrom"}


def merge_pod(
    rendered: dict[str, Any], override: PodTemplate, path: str = "spec.podTemplate"
) -> tuple[dict[str, Any], list[str]]:
    """(the pod template `rendered` with `override` merged in, the conflicts). `rendered` is a
    Deployment's `spec.template` ({"metadata": ..., "spec": ...}); it is not modified."""
    conflicts: list[str] = []
    meta = copy.deepcopy(rendered.get("metadata") or {})
    for field in ("labels", "annotations"):
        extra = getattr(override.metadata, field)
        if extra:
            meta[field] = _merge(meta.get(field, {}), extra, f"{path}.metadata.{field}", conflicts)
    spec = _merge(rendered["spec"], override.spec, f"{path}.spec", conflicts)
    return {**rendered, "metadata": meta, "spec": spec}, conflicts


def _merge(ours: Any, theirs: Any, path: str, conflicts: list[str], field: str = "") -> Any:
    if isinstance(ours, dict) and isinstance(theirs, dict):
        merged = copy.deepcopy(ours)
        for key, value in theirs.items():
            if key in ours:
                merged[key] = _merge(ours[key], value, f"{path}.{key}", conflicts, key)
            else:
                merged[key] = copy.deepcopy(value)
        return merged
    if isinstance(ours, list) and isinstance(theirs, list):
        if field in MERGE_KEYS:
            return _merge_keyed(ours, theirs, path, conflicts, field)
        if field in UNION_LISTS:
            return copy.deepcopy(ours) + [copy.deepcopy(t) for t in theirs if t not in ours]
    if ours != theirs:
        conflicts.append(f"{path}: {_short(theirs)} ignored, the operator sets {_short(ours)}")
    return copy.deepcopy(ours)


def _merge_keyed(
    ours: list[Any], theirs: list[Any], path: str, conflicts: list[str], field: str
) -> list[Any]:
    key = MERGE_KEYS[field]
    merged = copy.deepcopy(ours)
    index = {item.get(key): i for i, item in enumerate(ours) if isinstance(item, dict)}
    for item in theirs:
        name = item.get(key) if isinstance(item, dict) else None
        if name is None or name not in index:
            merged.append(copy.deepcopy(item))
            continue
        where = f"{path}[{key}={name}]"
        mine = ours[index[name]]
        if field in MERGED_ITEMS:
            merged[index[name]] = _merge(mine, item, where, conflicts)
        elif item != mine:
            conflicts.append(f"{where}: ignored, the operator renders {_short(mine)}")
    return merged


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def conflicts(render: Callable[[Any], list[dict[str, Any]]], spec: Any) -> list[str]:
    """The fields of `spec.pod_template` that the operator's own values override, for a
    `render(spec)` whose last Deployment (or LeaderWorkerSet: its leader's pod, whose
    conflicts its workers share) carries the pod: it is rendered without the override and
    the override merged into that again (renderings are pure and cheap)."""
    if spec.pod_template == PodTemplate():
        return []
    bare = render(spec.model_copy(update={"pod_template": PodTemplate()}))
    workload = next(o for o in reversed(bare) if o["kind"] in {"Deployment", "LeaderWorkerSet"})
    if workload["kind"] == "LeaderWorkerSet":
        pod = workload["spec"]["leaderWorkerTemplate"]["leaderTemplate"]
    else:
        pod = workload["spec"]["template"]
    return merge_pod(pod, spec.pod_template)[1]
