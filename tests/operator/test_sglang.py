"""`ModelServer.spec.engine.kind: sglang`: the SGLang server the operator renders, what its
session servers are told, and what is refused.

No SGLang runs here (no GPU; its CPU build is not on PyPI): the rendered flags are checked
against every flag SGLang 0.5.23's `launch_server` defines, read from its source
(tests/fixtures/sglang/launch_server_flags.txt, written by extract_from_wheel.py beside it)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from session_server.settings import Settings
from tests.operator.conftest import load_example
from tests.operator.schemas import custom_resource_errors, validate_builtin
from tests.operator.test_crds import crd
from tests.operator.test_manifests import (
    _engine_pod,
    _env,
    render_modelserver,
    render_sessionserver,
)
from tokenkeep_operator.models import DEFAULT_SGLANG_IMAGE, ModelServerSpec
from tokenkeep_operator.reconcile import validate

FLAGS_FILE = Path(__file__).parents[1] / "fixtures" / "sglang" / "launch_server_flags.txt"
SGLANG_FLAGS = frozenset(
    line for line in FLAGS_FILE.read_text().splitlines() if line and not line.startswith("#")
)
EXAMPLE = "gpu/sglang-moe-dp8-ep.yaml"


def _example(**spec: Any) -> dict[str, Any]:
    resource = load_example(EXAMPLE)
    resource["spec"] = copy.deepcopy(resource["spec"]) | spec
    return resource


def _container(resource: dict[str, Any]) -> dict[str, Any]:
    (container,) = _engine_pod(render_modelserver(resource))["containers"]
    return container


def _flag_values(args: list[str]) -> dict[str, str | None]:
    """`--flag value` pairs, and flags without a value as None."""
    values: dict[str, str | None] = {}
    for index, arg in enumerate(args):
        if arg.startswith("--"):
            following = args[index + 1] if index + 1 < len(args) else None
            values[arg] = None if following is None or following.startswith("--") else following
    return values


def test_the_sglang_example_runs_sglangs_server_with_its_own_parallel_flags() -> None:
    """The DeepSeek-V3 example (data 8 + expert on 8 GPUs) as SGLang's data-parallel
    attention, from SGLang's image, with metrics, incremental streams and the engine key; no
    vLLM extension, no vLLM variable."""
    objects = render_modelserver(_example())
    for obj in objects:
        validate_builtin(obj)
    pod = _engine_pod(objects)
    (container,) = pod["containers"]
    assert container["name"] == "sglang"
    assert container["image"] == DEFAULT_SGLANG_IMAGE == "lmsysorg/sglang:v0.5.23"
    assert container["command"] == ["python3", "-m", "sglang.launch_server"]
    flags = _flag_values(container["args"])
    assert flags["--model-path"] == "deepseek-ai/DeepSeek-V3"
    assert (flags["--host"], flags["--port"]) == ("0.0.0.0", "8000")
    assert flags["--served-model-name"] == "deepseek-ai/DeepSeek-V3"
    assert (flags["--tp-size"], flags["--attn-dp-size"], flags["--ep-size"]) == ("8", "8", "8")
    assert "--dp-size" not in flags  # SGLang refuses it beside --attn-dp-size
    assert flags["--context-length"] == "32768"
    assert flags["--tool-call-parser"] == "deepseekv3"
    assert "--enable-metrics" in flags and "--incremental-streaming-output" in flags
    # No mem fraction named: SGLang's own choice, not vLLM's 0.9.
    assert "--mem-fraction-static" not in flags
    assert flags["--api-key"] == "$(TOKENKEEP_ENGINE_KEY)"
    env = _env(container)
    key_ref = {"secretKeyRef": {"name": "deepseek-v3-sglang-engine-key", "key": "engine-key"}}
    assert env["TOKENKEEP_ENGINE_KEY"] == key_ref
    assert env["HF_HOME"] == "/cache/huggingface"
    assert env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "false"
    assert not [name for name in env if name.startswith("VLLM_")]
    assert "initContainers" not in pod
    assert {v["name"] for v in pod["volumes"]} == {"cache", "shm"}
    shm = next(v for v in pod["volumes"] if v["name"] == "shm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts == {"/cache": "cache", "/dev/shm": "shm"}
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    # 7200 s of loading allowed, as for vLLM.
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 7200


@pytest.mark.parametrize(
    ("parallelism", "gpus", "expected"),
    [
        ({}, 1, {"--tp-size": "1"}),
        ({"tensor": 4}, 4, {"--tp-size": "4"}),
        ({"tensor": 2, "data": 4}, 8, {"--tp-size": "2", "--dp-size": "4"}),
        ({"tensor": 4, "pipeline": 2}, 8, {"--tp-size": "4", "--pp-size": "2"}),
        ({"tensor": 4, "expert": True}, 4, {"--tp-size": "4", "--ep-size": "4"}),
        (
            {"tensor": 2, "data": 4, "expert": True},
            8,
            {"--tp-size": "8", "--attn-dp-size": "4", "--ep-size": "8"},
        ),
    ],
)
def test_parallelism_becomes_sglangs_flags_on_the_same_gpus(
    parallelism: dict[str, Any], gpus: int, expected: dict[str, str]
) -> None:
    """SGLang's world size is tp x pp x dp (its compute_world_size), so each shape asks for
    exactly the pod's GPUs; a flag that is not needed is not rendered."""
    resource = _example(parallelism=parallelism, resources={"gpus": gpus})
    flags = _flag_values(_container(resource)["args"])
    parallel = {"--tp-size", "--dp-size", "--pp-size", "--ep-size", "--attn-dp-size"}
    assert {f: v for f, v in flags.items() if f in parallel} == expected
    world = int(flags["--tp-size"] or 1) * int(flags.get("--pp-size") or 1)
    world *= int(flags.get("--dp-size") or 1)
    assert world == gpus


def test_every_rendered_flag_is_one_sglang_defines() -> None:
    """Every optional field given at once (and the CEL-free operator check passes it)."""
    resource = _example(
        model={
            "uri": "hf://deepseek-ai/DeepSeek-V3",
            "revision": "86518964eaef84e3fdd98e9861759a1384f9c29d",
            "servedName": "dsv3",
        },
        engine={
            "kind": "sglang",
            "maxModelLen": 16384,
            "gpuMemoryUtilization": 0.85,
            "toolCallParser": "deepseekv3",
            "reasoningParser": "deepseek-r1",
        },
        parallelism={"tensor": 4, "pipeline": 2},
    )
    assert validate(ModelServerSpec, resource)[1] == []
    flags = _flag_values(_container(resource)["args"])
    assert set(flags) - SGLANG_FLAGS == set()
    assert flags["--mem-fraction-static"] == "0.85"
    assert flags["--revision"] == "86518964eaef84e3fdd98e9861759a1384f9c29d"
    # The flags file is SGLang's, not a list that would accept anything.
    assert {"--enable-scale-out", "--shutdown-timeout", "--max-model-len"} & SGLANG_FLAGS == set()


def test_the_session_server_speaks_the_engine_kind_its_model_server_runs() -> None:
    sessions = render_sessionserver(
        load_example("sessionserver.yaml") | {"spec": {"modelServerRef": {"name": "dsv3"}}},
        _example(),
    )
    (config,) = [o for o in sessions if o["kind"] == "ConfigMap"]
    assert config["data"]["TOKENKEEP_ENGINE_KIND"] == "sglang"
    assert Settings(engine_kind=config["data"]["TOKENKEEP_ENGINE_KIND"]).engine_kind == "sglang"
    (container,) = _engine_pod(sessions)["containers"]
    key_ref = {"secretKeyRef": {"name": "deepseek-v3-sglang-engine-key", "key": "engine-key"}}
    assert _env(container)["TOKENKEEP_ENGINE_KEY"] == key_ref
    vllm_sessions = render_sessionserver(
        load_example("sessionserver.yaml"), load_example("modelserver-qwen3-8b.yaml")
    )
    (vllm_config,) = [o for o in vllm_sessions if o["kind"] == "ConfigMap"]
    assert vllm_config["data"]["TOKENKEEP_ENGINE_KIND"] == "vllm"


def test_publishing_off_gives_sglang_no_key() -> None:
    container = _container(_example(policy={"publishing": False}))
    assert "--api-key" not in container["args"]
    assert "TOKENKEEP_ENGINE_KEY" not in _env(container)


def test_switching_kinds_keeps_the_deployment_selector() -> None:
    """A Deployment's selector cannot change: a ModelServer switched between vllm and sglang
    in place keeps it, and the new pods still match it."""
    selectors = []
    for kind in ("vllm", "sglang"):
        resource = _example()
        resource["spec"]["engine"] = resource["spec"]["engine"] | {"kind": kind}
        (deployment,) = [o for o in render_modelserver(resource) if o["kind"] == "Deployment"]
        selector = deployment["spec"]["selector"]["matchLabels"]
        assert selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
        selectors.append(selector)
    assert selectors[0] == selectors[1]


@pytest.mark.parametrize(
    ("changes", "problem", "rule"),
    [
        (
            {"parallelism": {"data": 8, "nodes": 2}, "resources": {"gpus": 4}},
            "spec.parallelism.nodes: 2 with engine.kind sglang: a multi-node SGLang engine "
            "(--nnodes, --node-rank, --dist-init-addr) is not built: set parallelism.nodes to 1",
            "engine.kind sglang: a multi-node SGLang engine",
        ),
        (
            {"resources": {"gpus": 0}},
            "spec.resources.gpus: 0 with engine.kind sglang: resources.gpus 0 (a CPU engine) is "
            "vLLM's CPU build only; SGLang's CPU backend needs its own image and is not built: "
            "give the engine GPUs or use engine.kind vllm",
            "engine.kind sglang: resources.gpus 0",
        ),
        (
            {"engine": {"kind": "sglang", "returnRoutedExperts": True}},
            "spec.engine.returnRoutedExperts: true with engine.kind sglang: the session server "
            "cannot read SGLang's routed experts (raw bytes without a shape), so sessions would "
            "store none: set engine.returnRoutedExperts to false or use engine.kind vllm",
            "engine.kind sglang: the session server cannot read SGLang's routed experts",
        ),
    ],
)
def test_what_sglang_cannot_honour_is_refused_with_what_to_change(
    changes: dict[str, Any], problem: str, rule: str
) -> None:
    """The operator's own check (the InvalidSpec message) and the CRD's CEL rule."""
    resource = _example(**changes)
    problems = validate(ModelServerSpec, resource)[1]
    assert problem in problems
    errors = custom_resource_errors(crd("ModelServer"), resource)
    assert any(rule in error for error in errors), errors
    # The same shapes are the vLLM ones' business, not refused for SGLang's reasons.
    resource["spec"]["engine"]["kind"] = "vllm"
    assert not [p for p in validate(ModelServerSpec, resource)[1] if "sglang" in p]


def test_an_engine_kind_other_than_vllm_or_sglang_is_refused() -> None:
    resource = _example(engine={"kind": "tgi"})
    errors = custom_resource_errors(crd("ModelServer"), resource)
    assert any("engine.kind" in e and "is not one of" in e for e in errors), errors
    (problem,) = validate(ModelServerSpec, resource)[1]
    assert problem.startswith("spec.engine.kind: "), problem
