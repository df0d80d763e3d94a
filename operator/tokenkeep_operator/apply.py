"""Create-or-patch of rendered children, like `kubectl apply` with a JSON merge patch.

The patch sets every field whose live value differs from the rendered one (so hand edits
are undone), and nulls fields that the previous rendering had and this one dropped (recorded
in the LAST_APPLIED annotation), while fields other controllers own (status, defaults the API
server fills in, a Service's clusterIP) are left alone.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from tokenkeep_operator.kube import Kube
from tokenkeep_operator.models import GROUP

LAST_APPLIED = f"{GROUP}/last-applied"
# Fields the API server refuses to change after creation; a changed rendering of them
# (e.g. a new Redis storage size) needs the object recreated by hand.
IMMUTABLE = {
    "Deployment": [("spec", "selector")],
    "StatefulSet": [
        ("spec", "selector"),
        ("spec", "serviceName"),
        ("spec", "volumeClaimTemplates"),
    ],
    "PersistentVolumeClaim": [
        ("spec", "accessModes"),
        ("spec", "storageClassName"),
    ],
}

logger = logging.getLogger(__name__)


def contains(live: Any, desired: Any) -> bool:
    """Whether `live` already holds everything `desired` says (extra live fields allowed,
    such as defaults the API server filled in)."""
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(
            k in live and contains(live[k], v) for k, v in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(live, list)
            and len(live) == len(desired)
            and all(contains(lv, dv) for lv, dv in zip(live, desired, strict=True))
        )
    return live == desired


def merge_patch(desired: dict[str, Any], live: dict[str, Any], last: dict[str, Any]) -> dict:
    """A JSON merge patch (RFC 7386) turning `live` into something that `contains` `desired`
    and no longer has what `last` had but `desired` dropped. Empty when nothing changes."""
    patch: dict[str, Any] = {}
    for key, value in desired.items():
        live_value = live.get(key)
        if isinstance(value, dict) and isinstance(live_value, dict):
            last_value = last.get(key)
            nested = merge_patch(
                value, live_value, last_value if isinstance(last_value, dict) else {}
            )
            if nested:
                patch[key] = nested
        elif not contains(live_value, value):
            patch[key] = value
    for key in last:
        if key not in desired and key in live:
            patch[key] = None
    return patch


def _last_applied(live: dict[str, Any]) -> dict[str, Any]:
    text = live.get("metadata", {}).get("annotations", {}).get(LAST_APPLIED)
    return json.loads(text) if text else {}


def _drop_immutable(kind: str, patch: dict[str, Any], name: str) -> None:
    for parent, field in IMMUTABLE.get(kind, []):
        if field in patch.get(parent, {}):
            logger.warning(
                "%s %s: %s.%s cannot change in place; left as is", kind, name, parent, field
            )
            del patch[parent][field]
            if not patch[parent]:
                del patch[parent]


def with_last_applied(desired: dict[str, Any]) -> dict[str, Any]:
    meta = desired["metadata"]
    annotations = {**meta.get("annotations", {}), LAST_APPLIED: json.dumps(desired, sort_keys=True)}
    return {**desired, "metadata": {**meta, "annotations": annotations}}


def apply(kube: Kube, desired: dict[str, Any]) -> dict[str, Any]:
    """Create `desired`, or patch the live object towards it. Returns the live object."""
    meta = desired["metadata"]
    target = with_last_applied(desired)
    live = kube.get(desired["apiVersion"], desired["kind"], meta["namespace"], meta["name"])
    if live is None:
        return kube.create(target)
    patch = merge_patch(target, live, _last_applied(live))
    _drop_immutable(desired["kind"], patch, meta["name"])
    if not patch:
        return live
    return kube.patch(
        desired["apiVersion"], desired["kind"], meta["namespace"], meta["name"], patch
    )
