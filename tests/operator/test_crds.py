"""The CRDs: generated from the models without drift, valid CRD objects, and accepting
exactly the custom resources the operator can run."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml

from tests.operator.conftest import EXAMPLES, REPO_ROOT
from tests.operator.schemas import custom_resource_errors, validate_builtin
from tokenkeep_operator import crdgen
from tokenkeep_operator.models import ModelServerSpec, SessionServerSpec


def crd(kind: str) -> dict[str, Any]:
    path = REPO_ROOT / "crds" / f"tokenkeep.dev_{kind.lower()}s.yaml"
    return yaml.safe_load(path.read_text())


def test_committed_crds_match_the_models() -> None:
    assert crdgen.drift(crdgen.CRD_DIRS) == [], (
        "CRDs are out of date: run `python -m tokenkeep_operator.crdgen`"
    )


def test_chart_crds_are_byte_identical_to_top_level() -> None:
    top = {p.name: p.read_bytes() for p in (REPO_ROOT / "crds").glob("*.yaml")}
    chart = {p.name: p.read_bytes() for p in (REPO_ROOT / "charts/tokenkeep/crds").glob("*.yaml")}
    assert top and top == chart


def test_drift_check_notices_an_edited_crd(tmp_path) -> None:
    for name, text in crdgen.render_crd_files().items():
        (tmp_path / name).write_text(text)
    assert crdgen.drift([tmp_path]) == []
    victim = next(tmp_path.glob("*modelservers.yaml"))
    victim.write_text(victim.read_text().replace("minimum: 1", "minimum: 2", 1))
    assert crdgen.drift([tmp_path]) == [str(victim)]


@pytest.mark.parametrize("kind", ["ModelServer", "SessionServer"])
def test_crd_is_a_valid_kubernetes_object(kind: str) -> None:
    validate_builtin(crd(kind))


def _no_untyped_nodes(schema: dict[str, Any], path: str = "") -> list[str]:
    """Structural schemas type every node and never combine properties with
    additionalProperties."""
    problems = []
    if "type" not in schema:
        problems.append(path)
    if "properties" in schema and "additionalProperties" in schema:
        problems.append(path + " (properties + additionalProperties)")
    for name, prop in schema.get("properties", {}).items():
        problems += _no_untyped_nodes(prop, f"{path}.{name}")
    if isinstance(schema.get("additionalProperties"), dict):
        problems += _no_untyped_nodes(schema["additionalProperties"], path + ".*")
    if "items" in schema:
        problems += _no_untyped_nodes(schema["items"], path + "[]")
    return problems


@pytest.mark.parametrize("kind", ["ModelServer", "SessionServer"])
def test_crd_schema_is_structural(kind: str) -> None:
    schema = crd(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert _no_untyped_nodes(schema) == []
    assert "$ref" not in yaml.safe_dump(schema) and "anyOf" not in yaml.safe_dump(schema)


def test_modelserver_has_scale_subresource_status_and_short_name() -> None:
    definition = crd("ModelServer")
    version = definition["spec"]["versions"][0]
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    assert version["subresources"]["status"] == {}
    assert definition["spec"]["names"]["shortNames"] == ["msrv"]
    assert crd("SessionServer")["spec"]["names"]["shortNames"] == ["ssrv"]
    columns = {c["name"] for c in version["additionalPrinterColumns"]}
    assert {"Model", "Engine", "GPUs", "Replicas", "Ready", "Status", "Reason", "Age"} <= columns


EXAMPLE_FILES = sorted(p.name for p in EXAMPLES.glob("*.yaml"))


@pytest.mark.parametrize("name", EXAMPLE_FILES)
def test_examples_are_accepted_by_crd_and_operator(name: str) -> None:
    resource = yaml.safe_load((EXAMPLES / name).read_text())
    assert custom_resource_errors(crd(resource["kind"]), resource) == []
    model = ModelServerSpec if resource["kind"] == "ModelServer" else SessionServerSpec
    model.model_validate(resource["spec"])


def _modelserver(**spec_changes: Any) -> dict[str, Any]:
    resource = yaml.safe_load((EXAMPLES / "modelserver-qwen3-8b.yaml").read_text())
    spec = copy.deepcopy(resource["spec"])
    for dotted, value in spec_changes.items():
        *parents, leaf = dotted.split("__")
        node = spec
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = value
    resource["spec"] = spec
    return resource


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"resources__gpus": 2, "engine__tensorParallelSize": 4}, "tensor x pipeline x data"),
        ({"resources__gpus": 6, "engine__tensorParallelSize": 4}, "tensor x pipeline x data"),
        ({"resources__gpus": 8}, "set parallelism.data"),
        ({"parallelism__nodes": 2, "resources__gpus": 0}, "needs resources.gpus per pod"),
        (
            {"parallelism__nodes": 2, "parallelism__data": 3, "resources__gpus": 3},
            "a multiple of parallelism.nodes",
        ),
        ({"parallelism__data": 2, "parallelism__dataLocal": 1}, "leave dataLocal unset"),
        (
            {"parallelism__tensor": 4, "engine__tensorParallelSize": 2},
            "remove engine.tensorParallelSize",
        ),
        ({"model__uri": "s3://bucket/model"}, "hf://ORG/NAME, pvc://CLAIM/PATH or file:///PATH"),
        ({"model__uri": "hf://"}, "hf://ORG/NAME, pvc://CLAIM/PATH or file:///PATH"),
        ({"model__uri": "file://relative/path"}, "file:///PATH"),
        ({"resources__gpus": -1}, "minimum"),
        ({"replicas": -1}, "minimum"),
        ({"engine__gpuMemoryUtilization": 0}, "minimum"),
        ({"engine__gpuMemoryUtilization": 1.5}, "maximum"),
        ({"cache__accessMode": "ReadOnlyMany"}, "is not one of"),
        ({"cache__size": "lots"}, "does not match"),
        ({"startupTimeoutSeconds": 10}, "minimum"),
    ],
)
def test_invalid_modelservers_are_rejected(changes: dict[str, Any], expected: str) -> None:
    errors = custom_resource_errors(crd("ModelServer"), _modelserver(**changes))
    assert errors and expected in " ".join(errors), errors


def test_consistent_tensor_parallel_is_accepted() -> None:
    resource = _modelserver(resources__gpus=4, engine__tensorParallelSize=4)
    assert custom_resource_errors(crd("ModelServer"), resource) == []


def test_long_names_are_rejected() -> None:
    resource = _modelserver()
    resource["metadata"]["name"] = "m" * 49
    errors = custom_resource_errors(crd("ModelServer"), resource)
    assert len(errors) == 1 and errors[0].startswith("metadata.name:"), errors
    # The operator checks it too (API servers that predate the schema rule, or objects
    # stored before it), as a field path and alongside every spec error.
    from tokenkeep_operator.reconcile import validate

    spec, problems = validate(ModelServerSpec, {**resource, "spec": {"model": {"uri": "s3://x"}}})
    assert spec is None
    assert problems[0].startswith("metadata.name: 49 characters, at most 48"), problems
    assert problems[1] == (
        "spec.model.uri: must be hf://ORG/NAME, pvc://CLAIM/PATH or file:///PATH"
    ), problems


def test_every_error_at_once_in_field_paths_without_pydantic_noise() -> None:
    from tokenkeep_operator.reconcile import validate

    resource = _modelserver(replicas=-1, engine__gpuMemoryUtilization=2, cache__size="lots")
    _, problems = validate(ModelServerSpec, resource)
    assert [p.split(":")[0] for p in problems] == [
        "spec.cache.size",
        "spec.engine.gpuMemoryUtilization",
        "spec.replicas",
    ], problems
    assert not any("Value error" in p or "pydantic" in p for p in problems)
    _, problems = validate(
        ModelServerSpec, _modelserver(resources__gpus=3, engine__tensorParallelSize=2)
    )
    assert problems == [
        "spec.resources.gpus: 3 GPUs per pod, but tensor x pipeline x data = 2 x 1 x 1 = 2; "
        "set spec.parallelism.tensor: 3 or spec.resources.gpus: 2"
    ], problems


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        # gpus alone used to become pipeline stages; now the user says what they mean.
        (
            {"resources__gpus": 8},
            "spec.resources.gpus: 8 GPUs per pod, but tensor x pipeline x data = 1 x 1 x 1 = 1; "
            "set spec.parallelism.data: 8 (data-parallel engine ranks) or "
            "spec.parallelism.tensor: 8 or spec.parallelism.pipeline: 8 (what gpus alone "
            "rendered before) or spec.resources.gpus: 1",
        ),
        # gpus 8 with data 8 and tensor 8 asks for 64 ranks.
        (
            {"resources__gpus": 8, "parallelism__data": 8, "parallelism__tensor": 8},
            "spec.resources.gpus: 8 GPUs per pod, but tensor x pipeline x data = 8 x 1 x 8 = 64; "
            "set spec.parallelism.data: 1 (data-parallel engine ranks) or "
            "spec.parallelism.tensor: 1 or spec.resources.gpus: 64",
        ),
        # Two nodes of 16 GPUs hold 32 ranks, not 16.
        (
            {"resources__gpus": 16, "parallelism__data": 16, "parallelism__nodes": 2},
            "spec.resources.gpus: 16 GPUs per pod x 2 nodes = 32, but tensor x pipeline x data "
            "= 1 x 1 x 16 = 16; set spec.parallelism.data: 32 (data-parallel engine ranks) or "
            "spec.parallelism.tensor: 2 or spec.parallelism.pipeline: 2 or "
            "spec.resources.gpus: 8",
        ),
        # A multi-node engine of CPU pods: vLLM spreads GPU ranks.
        (
            {"resources__gpus": 0, "parallelism__nodes": 2},
            "spec.resources.gpus: a multi-node engine (parallelism.nodes > 1) needs "
            "resources.gpus per pod: vLLM spreads GPU ranks over the nodes",
        ),
        # 6 ranks over 4 nodes: a data-parallel rank would straddle two nodes.
        (
            {
                "resources__gpus": 3,
                "parallelism__data": 6,
                "parallelism__tensor": 2,
                "parallelism__nodes": 4,
            },
            "spec.parallelism.data: 6 data-parallel ranks cannot be spread over 4 nodes; set "
            "spec.parallelism.data to 1 (tensor x pipeline span the nodes) or a multiple of 4 "
            "(whole ranks on every node)",
        ),
        (
            {"resources__gpus": 4, "parallelism__tensor": 4, "engine__tensorParallelSize": 2},
            "spec.engine.tensorParallelSize: 2 disagrees with spec.parallelism.tensor (4): "
            "remove spec.engine.tensorParallelSize (spec.parallelism.tensor replaces it)",
        ),
    ],
)
def test_impossible_parallel_shapes_are_refused_naming_the_fields_to_change(
    changes: dict[str, Any], problem: str
) -> None:
    """The operator's own check (what an InvalidSpec condition says), and the API server's
    CEL rules refuse the same resources."""
    from tokenkeep_operator.reconcile import validate

    resource = _modelserver(**changes)
    assert validate(ModelServerSpec, resource) == (None, [problem])
    assert custom_resource_errors(crd("ModelServer"), resource) != []


@pytest.mark.parametrize(
    "changes",
    [
        {"resources__gpus": 8, "parallelism__data": 8, "parallelism__expert": True},
        {"resources__gpus": 8, "parallelism__tensor": 4, "parallelism__pipeline": 2},
        {"resources__gpus": 8, "parallelism__tensor": 2, "parallelism__data": 4},
        {"resources__gpus": 4, "engine__tensorParallelSize": 4},  # the older field
        {"resources__gpus": 4, "parallelism__tensor": 4, "engine__tensorParallelSize": 4},
        {"resources__gpus": 0, "parallelism__data": 2},  # a CPU engine: no GPU count
        # Two nodes: tensor x pipeline across them, or whole data-parallel ranks on each.
        {
            "resources__gpus": 8,
            "parallelism__tensor": 8,
            "parallelism__pipeline": 2,
            "parallelism__nodes": 2,
        },
        {"resources__gpus": 4, "parallelism__tensor": 8, "parallelism__nodes": 2},
        {
            "resources__gpus": 8,
            "parallelism__data": 16,
            "parallelism__expert": True,
            "parallelism__nodes": 2,
        },
        {
            "resources__gpus": 8,
            "parallelism__data": 8,
            "parallelism__dataLocal": 4,
            "parallelism__tensor": 2,
            "parallelism__nodes": 2,
        },
    ],
)
def test_consistent_parallel_shapes_are_accepted(changes: dict[str, Any]) -> None:
    from tokenkeep_operator.reconcile import validate

    resource = _modelserver(**changes)
    assert custom_resource_errors(crd("ModelServer"), resource) == []
    assert validate(ModelServerSpec, resource)[1] == []


GPU_EXAMPLES = sorted(p.name for p in (EXAMPLES / "gpu").glob("*.yaml"))


def test_gpu_examples_are_the_four_shapes() -> None:
    assert GPU_EXAMPLES == [
        "dense-70b-tp4.yaml",
        "dense-8b.yaml",
        "moe-dp8-ep.yaml",
        "moe-two-nodes.yaml",
        "sglang-moe-dp8-ep.yaml",
    ]


@pytest.mark.parametrize("name", GPU_EXAMPLES)
def test_gpu_examples_are_accepted(name: str) -> None:
    resource = yaml.safe_load((EXAMPLES / "gpu" / name).read_text())
    assert custom_resource_errors(crd(resource["kind"]), resource) == []
    ModelServerSpec.model_validate(resource["spec"])


def test_every_field_has_a_description() -> None:
    """What `kubectl explain` shows: nothing `<empty>`."""

    def undescribed(node: dict[str, Any], where: str) -> list[str]:
        # metadata may carry nothing but name rules: `kubectl explain` shows ObjectMeta's docs.
        found = [] if "description" in node or where.endswith(".metadata") else [where]
        for key, child in (node.get("properties") or {}).items():
            found += undescribed(child, f"{where}.{key}")
        if "items" in node and "properties" in node["items"]:
            found += [p for p in undescribed(node["items"], f"{where}[]") if not p.endswith("[]")]
        return found

    for kind in ("ModelServer", "SessionServer"):
        schema = crd(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        assert undescribed(schema, kind) == []


def test_external_redis_needs_a_url_secret() -> None:
    resource = yaml.safe_load((EXAMPLES / "sessionserver.yaml").read_text())
    resource["spec"]["redis"] = {"mode": "External"}
    assert custom_resource_errors(crd("SessionServer"), resource) == [
        ".spec.redis: redis.external.urlSecretRef is required when redis.mode is External"
    ]
    resource["spec"]["redis"]["external"] = {"urlSecretRef": {"name": "redis", "key": "url"}}
    assert custom_resource_errors(crd("SessionServer"), resource) == []


def test_unknown_fields_are_rejected_by_the_schema_and_the_model() -> None:
    resource = _modelserver(engine__tensorParalelSize=2)
    # The API server prunes (or, with strict field validation, refuses) unknown fields.
    schema = crd("ModelServer")["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert (
        "tensorParalelSize"
        not in schema["properties"]["spec"]["properties"]["engine"]["properties"]
    )
    with pytest.raises(ValueError, match="tensorParalelSize"):
        ModelServerSpec.model_validate(resource["spec"])


def test_api_server_defaults_match_the_models() -> None:
    """What the API server stores for a minimal resource is what the operator assumes."""
    from tests.operator.schemas import apply_defaults

    minimal = {"model": {"uri": "hf://Qwen/Qwen3-0.6B"}}
    schema = crd("ModelServer")["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    defaulted = apply_defaults(schema["properties"]["spec"], minimal)
    assert ModelServerSpec.model_validate(defaulted) == ModelServerSpec.model_validate(minimal)
    assert defaulted["engine"]["tensorParallelSize"] == 1 and defaulted["resources"]["gpus"] == 1

    minimal = {"modelServerRef": {"name": "m"}}
    schema = crd("SessionServer")["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    defaulted = apply_defaults(schema["properties"]["spec"], minimal)
    assert SessionServerSpec.model_validate(defaulted) == SessionServerSpec.model_validate(minimal)
    # No schema default: the operator picks the Redis resources from the ModelServer (routed
    # experts or not), which a default filled in by the API server would hide.
    assert (
        defaulted["redis"]["managed"]["image"] and "resources" not in defaulted["redis"]["managed"]
    )
