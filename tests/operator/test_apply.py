"""The create-or-patch logic: patches undo drift, drop removed fields, and leave what other
controllers own alone."""

from __future__ import annotations

import json

from tokenkeep_operator.apply import LAST_APPLIED, contains, merge_patch, with_last_applied


def test_nothing_to_do_when_live_holds_the_rendering_plus_server_defaults() -> None:
    desired = {"spec": {"replicas": 1, "template": {"containers": [{"name": "a", "image": "x"}]}}}
    live = {
        "spec": {
            "replicas": 1,
            "progressDeadlineSeconds": 600,
            "template": {"containers": [{"name": "a", "image": "x", "imagePullPolicy": "Always"}]},
        },
        "status": {"readyReplicas": 1},
    }
    assert contains(live, desired)
    assert merge_patch(desired, live, desired) == {}


def test_hand_edits_are_undone_and_lists_replaced_whole() -> None:
    desired = {"spec": {"replicas": 2, "args": ["--a", "--b"]}}
    live = {"spec": {"replicas": 5, "args": ["--a"]}}
    assert merge_patch(desired, live, desired) == {"spec": {"replicas": 2, "args": ["--a", "--b"]}}


def test_fields_dropped_from_the_rendering_are_removed() -> None:
    last = {"data": {"TOKENKEEP_MAX_SESSIONS": "10", "TOKENKEEP_MODEL": "m"}}
    desired = {"data": {"TOKENKEEP_MODEL": "m"}}
    live = {"data": {"TOKENKEEP_MAX_SESSIONS": "10", "TOKENKEEP_MODEL": "m"}}
    assert merge_patch(desired, live, last) == {"data": {"TOKENKEEP_MAX_SESSIONS": None}}


def test_fields_someone_else_added_are_kept() -> None:
    desired = {"metadata": {"annotations": {"a": "1"}}}
    live = {"metadata": {"annotations": {"a": "1", "deployment.kubernetes.io/revision": "3"}}}
    assert merge_patch(desired, live, desired) == {}


def test_last_applied_records_the_rendering_itself() -> None:
    desired = {"metadata": {"name": "x", "annotations": {"a": "1"}}, "spec": {"k": 1}}
    stamped = with_last_applied(desired)
    assert json.loads(stamped["metadata"]["annotations"][LAST_APPLIED]) == desired
    assert stamped["metadata"]["annotations"]["a"] == "1"
    assert LAST_APPLIED not in desired["metadata"]["annotations"]
