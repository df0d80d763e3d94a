"""Generate the CustomResourceDefinitions from the Pydantic models.

`python -m tokenkeep_operator.crdgen` rewrites `crds/` and `charts/tokenkeep/crds/`;
`--check` only reports drift (exit 1), which is what the test suite runs.

Pydantic emits JSON Schema 2020-12; Kubernetes wants a *structural* OpenAPI v3.0 schema:
every node typed, no `$ref`, no `anyOf` over null, boolean `exclusiveMinimum`, free-form
objects marked `x-kubernetes-preserve-unknown-fields`, and `properties` never beside
`additionalProperties`. `to_structural` performs exactly that translation.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from tokenkeep_operator import models

_DROPPED_KEYS = {"title", "$defs"}


@dataclass(frozen=True)
class CRDKind:
    kind: str
    plural: str
    short_name: str
    spec: type[BaseModel]
    status: type[BaseModel]
    printer_columns: list[dict[str, Any]]
    scale: bool
    description: str
    spec_description: str


API_VERSION_DOC = f"{models.API_VERSION}."
KIND_DOC = "The kind of this resource."
STATUS_DOC = (
    "Written by the operator: observedGeneration, url, replica counts and the Ready, "
    "Progressing and Degraded conditions (always all three); a SessionServer's also the "
    "published policy (policy)."
)


def _ready_column(name: str, field: str) -> dict[str, Any]:
    return {
        "name": name,
        "type": "string",
        "jsonPath": f'.status.conditions[?(@.type=="Ready")].{field}',
    }


KINDS = [
    CRDKind(
        kind="ModelServer",
        plural="modelservers",
        short_name="msrv",
        spec=models.ModelServerSpec,
        status=models.ModelServerStatus,
        printer_columns=[
            {"name": "Model", "type": "string", "jsonPath": ".spec.model.uri"},
            {"name": "Engine", "type": "string", "jsonPath": ".spec.engine.kind"},
            {"name": "GPUs", "type": "integer", "jsonPath": ".spec.resources.gpus"},
            {"name": "Replicas", "type": "integer", "jsonPath": ".spec.replicas"},
            {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas"},
            _ready_column("Status", "status"),
            _ready_column("Reason", "reason"),
            {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        ],
        scale=True,
        description=(
            "A pool of vLLM replicas serving one model, with the token-in endpoint the "
            "session server uses."
        ),
        spec_description="What to serve and how: the model, its cache, the engine, GPUs.",
    ),
    CRDKind(
        kind="SessionServer",
        plural="sessionservers",
        short_name="ssrv",
        spec=models.SessionServerSpec,
        status=models.SessionServerStatus,
        printer_columns=[
            {"name": "ModelServer", "type": "string", "jsonPath": ".spec.modelServerRef.name"},
            {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas"},
            _ready_column("Status", "status"),
            _ready_column("Reason", "reason"),
            # The published policy version and the engine replicas serving it: `7 (2/2)`.
            {"name": "Policy", "type": "string", "jsonPath": ".status.policy.summary"},
            {"name": "URL", "type": "string", "jsonPath": ".status.url", "priority": 1},
            {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        ],
        scale=False,
        description=(
            "`tokenkeep serve` in front of one ModelServer: token-exact multi-turn sessions, "
            "stored in Redis."
        ),
        spec_description="The ModelServer to front, replicas, Redis and session settings.",
    ),
]


def _resolve(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_resolve(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[1]]
        merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return _resolve(merged, defs)
    return {k: _resolve(v, defs) for k, v in node.items() if k not in _DROPPED_KEYS}


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _structural(node: dict[str, Any]) -> dict[str, Any]:
    node = dict(node)
    if "default" in node:
        # A default may not hold null for a field that is not nullable: leave those unset.
        node["default"] = _without_nulls(node["default"])
    if "anyOf" in node:
        branches = [b for b in node.pop("anyOf") if b.get("type") != "null"]
        if len(branches) != 1:
            raise ValueError(f"cannot express a union in a structural schema: {branches}")
        if node.get("default", ...) is None:
            del node["default"]
        node = {**branches[0], **node}
    if isinstance(node.get("exclusiveMinimum"), int | float):
        node["minimum"] = node["exclusiveMinimum"]
        node["exclusiveMinimum"] = True
    if isinstance(node.get("exclusiveMaximum"), int | float):
        node["maximum"] = node["exclusiveMaximum"]
        node["exclusiveMaximum"] = True
    if node.get("type") == "object":
        extra = node.get("additionalProperties")
        if "properties" in node:
            node.pop("additionalProperties", None)
            node["properties"] = {k: _structural(v) for k, v in node["properties"].items()}
        elif extra is True or ("additionalProperties" not in node):
            node.pop("additionalProperties", None)
            node["x-kubernetes-preserve-unknown-fields"] = True
        else:
            node["additionalProperties"] = _structural(extra)
    if node.get("type") == "array":
        node["items"] = _structural(node["items"])
    if "type" not in node:
        raise ValueError(f"untyped schema node: {node}")
    return node


def to_structural(model: type[BaseModel]) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    return _structural(_resolve(raw, raw.get("$defs", {})))


def render_crd(kind: CRDKind) -> dict[str, Any]:
    spec_schema = to_structural(kind.spec)
    status_schema = to_structural(kind.status)
    # Children append suffixes to the name and Service names are DNS labels: the schema
    # states the limit (the operator checks it too, for servers that predate this).
    # (Kubernetes allows nothing else on metadata: `kubectl explain` shows ObjectMeta's docs.)
    metadata = {
        "type": "object",
        "properties": {
            "name": {
                "type": "string",
                "maxLength": models.MAX_NAME_LENGTH,
                "description": f"At most {models.MAX_NAME_LENGTH} characters.",
            }
        },
    }
    version: dict[str, Any] = {
        "name": models.VERSION,
        "served": True,
        "storage": True,
        "schema": {
            "openAPIV3Schema": {
                "type": "object",
                "description": kind.description,
                "required": ["spec"],
                "properties": {
                    "apiVersion": {"type": "string", "description": API_VERSION_DOC},
                    "kind": {"type": "string", "description": KIND_DOC},
                    "metadata": metadata,
                    "spec": {**spec_schema, "description": kind.spec_description},
                    "status": {**status_schema, "description": STATUS_DOC},
                },
            }
        },
        "subresources": {"status": {}},
        "additionalPrinterColumns": kind.printer_columns,
    }
    if kind.scale:
        version["subresources"]["scale"] = {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{kind.plural}.{models.GROUP}"},
        "spec": {
            "group": models.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": kind.kind,
                "listKind": f"{kind.kind}List",
                "plural": kind.plural,
                "singular": kind.kind.lower(),
                "shortNames": [kind.short_name],
                "categories": ["tokenkeep"],
            },
            "versions": [version],
        },
    }


def crd_filename(kind: CRDKind) -> str:
    return f"{models.GROUP}_{kind.plural}.yaml"


def render_crd_files() -> dict[str, str]:
    """File name -> YAML text, byte for byte what belongs in crds/."""
    header = (
        "# Generated by `python -m tokenkeep_operator.crdgen`"
        " from operator/tokenkeep_operator/models.py.\n"
    )
    return {
        crd_filename(kind): header + yaml.safe_dump(render_crd(kind), sort_keys=False, width=100)
        for kind in KINDS
    }


REPO_ROOT = Path(__file__).resolve().parents[2]
CRD_DIRS = [REPO_ROOT / "crds", REPO_ROOT / "charts" / "tokenkeep" / "crds"]


def drift(directories: list[Path]) -> list[str]:
    """Files that differ from, or are missing against, what the models generate."""
    expected = render_crd_files()
    problems = []
    for directory in directories:
        present = {p.name for p in directory.glob("*.yaml")} if directory.is_dir() else set()
        for name, text in expected.items():
            path = directory / name
            if not path.is_file() or path.read_text() != text:
                problems.append(str(path))
        problems.extend(str(directory / name) for name in sorted(present - expected.keys()))
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="report drift, write nothing")
    args = parser.parse_args(argv)
    if args.check:
        problems = drift(CRD_DIRS)
        for path in problems:
            print(f"out of date: {path}", file=sys.stderr)
        return 1 if problems else 0
    for directory in CRD_DIRS:
        directory.mkdir(parents=True, exist_ok=True)
        for stale in directory.glob("*.yaml"):
            stale.unlink()
        for name, text in render_crd_files().items():
            (directory / name).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
