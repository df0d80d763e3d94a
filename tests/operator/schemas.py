"""Validation the API server would do, run offline: built-in kinds against the Kubernetes
OpenAPI schemas shipped in `kubernetes-validate`, custom resources against our CRDs'
`openAPIV3Schema` (structural defaulting, then JSON Schema, then the CEL rules, in the order
the API server applies them)."""

from __future__ import annotations

import copy
from functools import cache
from typing import Any

import celpy
import jsonschema
import kubernetes_validate

# The oldest Kubernetes the chart supports (CEL validation rules are GA in 1.29, the
# StatefulSet PVC retention policy in 1.32) and the newest that kubernetes-validate knows.
KUBERNETES_VERSIONS = ["1.32.0", kubernetes_validate.utils.latest_version()]


def validate_builtin(obj: dict[str, Any]) -> None:
    """Raise if `obj` is not a valid object of a built-in kind (unknown fields included)."""
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(obj, version, strict=True)


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Structural defaulting, as the API server does it before validation."""
    if isinstance(value, dict) and schema.get("type") == "object":
        value = dict(value)
        for name, prop in schema.get("properties", {}).items():
            if name not in value and "default" in prop:
                value[name] = copy.deepcopy(prop["default"])
            if name in value:
                value[name] = apply_defaults(prop, value[name])
        if "additionalProperties" in schema:
            value = {k: apply_defaults(schema["additionalProperties"], v) for k, v in value.items()}
    elif isinstance(value, list) and schema.get("type") == "array":
        value = [apply_defaults(schema["items"], item) for item in value]
    return value


@cache
def _cel_program(rule: str) -> Any:
    env = celpy.Environment()
    return env.program(env.compile(rule))


def _cel_errors(schema: dict[str, Any], value: Any, path: str) -> list[str]:
    errors = []
    for validation in schema.get("x-kubernetes-validations", []):
        result = _cel_program(validation["rule"]).evaluate({"self": celpy.json_to_cel(value)})
        if not bool(result):
            errors.append(f"{path or '<root>'}: {validation['message']}")
    if isinstance(value, dict):
        for name, prop in schema.get("properties", {}).items():
            if name in value:
                errors += _cel_errors(prop, value[name], f"{path}.{name}")
    elif isinstance(value, list) and "items" in schema:
        for index, item in enumerate(value):
            errors += _cel_errors(schema["items"], item, f"{path}[{index}]")
    return errors


def custom_resource_errors(crd: dict[str, Any], obj: dict[str, Any]) -> list[str]:
    """What the API server would reject in `obj`, a custom resource of `crd`'s kind."""
    names = crd["spec"]["names"]
    if obj.get("kind") != names["kind"]:
        return [f"kind {obj.get('kind')!r} is not {names['kind']}"]
    version = next(
        v
        for v in crd["spec"]["versions"]
        if obj["apiVersion"] == f"{crd['spec']['group']}/{v['name']}"
    )
    schema = version["schema"]["openAPIV3Schema"]
    defaulted = apply_defaults(schema, obj)
    # OpenAPI v3.0 keeps draft 4's boolean exclusiveMinimum.
    validator = jsonschema.Draft4Validator(schema)
    errors = [
        f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
        for e in validator.iter_errors(defaulted)
    ]
    if errors:
        return errors
    return _cel_errors(schema, defaulted, "")
