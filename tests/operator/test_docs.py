"""The operator's README documents every CRD field and every condition reason."""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.operator.conftest import REPO_ROOT
from tokenkeep_operator import crdgen, status

README = (REPO_ROOT / "operator" / "README.md").read_text()


def leaf_paths(schema: dict[str, Any], prefix: str) -> list[str]:
    properties = schema.get("properties")
    if not properties:
        items = schema.get("items", {})
        if items.get("properties"):
            return leaf_paths(items, prefix + "[]")
        return [prefix]
    return [p for name, prop in properties.items() for p in leaf_paths(prop, f"{prefix}.{name}")]


@pytest.mark.parametrize("kind", crdgen.KINDS, ids=lambda k: k.kind)
def test_every_field_is_documented(kind: crdgen.CRDKind) -> None:
    schema = crdgen.render_crd(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    missing = []
    for top in ("spec", "status"):
        for path in leaf_paths(schema["properties"][top], top):
            plain = path.replace("[]", "")
            parent, _, leaf = plain.rpartition(".")
            # Written out in full, or grouped as `parent.{a,b}` / `parent[].{a,b}` / `parent.*`.
            grouped = rf"`{re.escape(parent)}(\[\])?\.(\{{[^}}]*\b{leaf}\b[^}}]*\}}|\*)`"
            documented = f"`{plain}`" in README or re.search(grouped, README)
            # Several fields in one cell: `status.replicas`, `status.readyReplicas`.
            documented = documented or re.search(rf"`{re.escape(plain)}`", README)
            if not documented and not plain.startswith("status.conditions."):
                missing.append(path)
    assert missing == []


def test_every_reason_is_documented() -> None:
    reasons = [
        value
        for name, value in vars(status).items()
        if name.isupper()
        and isinstance(value, str)
        and value.isidentifier()
        and name not in ("READY", "PROGRESSING", "DEGRADED")
    ]
    assert len(reasons) > 15
    assert [r for r in reasons if f"`{r}`" not in README] == []
