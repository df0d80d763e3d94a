"""The vLLM command lines the operator renders, parsed by vLLM's own `vllm serve` parser.

vLLM lives in the engine's own virtualenv (`session_server.devtools.localengine`, cached under
~/.cache/tokenkeep), not in the test environment, so the parser runs there: the rendered
command lines go in as JSON, the parsed arguments and vLLM's registered parsers come back.
Tier 2 (`vllm`): `TOKENKEEP_SKIP_VLLM=1` skips it, and in CI a skip is a failure."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from session_server.devtools import localengine
from tests.operator.test_manifests import SCENARIOS
from tests.vllm_fixture import skip_if_asked

pytestmark = pytest.mark.vllm

PARSE = """
import contextlib, io, json, sys
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.reasoning import ReasoningParserManager
from vllm.tool_parsers import ToolParserManager
from vllm.utils.argparse_utils import FlexibleArgumentParser

parser = FlexibleArgumentParser(prog="vllm")
ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))
parsed = []
for command in json.load(sys.stdin):
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            args = parser.parse_args(command[1:])
    except SystemExit:  # argparse's answer to an unknown or malformed flag
        parsed.append({"error": errors.getvalue()})
        continue
    parsed.append({key: getattr(args, key) for key in (
        "enable_scale_out", "tensor_parallel_size", "pipeline_parallel_size",
        "data_parallel_size", "data_parallel_size_local", "enable_expert_parallel",
        "tool_call_parser", "enable_auto_tool_choice", "reasoning_parser",
        "middleware", "worker_extension_cls")})
print(json.dumps({
    "parsed": parsed,
    "tool_parsers": list(ToolParserManager.list_registered()),
    "reasoning_parsers": list(ReasoningParserManager.list_registered()),
}))
"""


def _engine_containers() -> list[dict[str, Any]]:
    containers = []
    for render in SCENARIOS.values():
        for obj in render():
            if obj["kind"] == "Deployment" and obj["metadata"]["name"].endswith("-engine"):
                containers.append(obj["spec"]["template"]["spec"]["containers"][0])
    return containers


def _engine_commands() -> list[list[str]]:
    return [c["command"] + c["args"] for c in _engine_containers()]


MALFORMED = ["vllm", "serve", "m", "--no-such-flag"]


def _parse_with_vllm(commands: list[list[str]]) -> dict[str, Any]:
    python = localengine.install()  # cached: `make engine` installed it
    done = subprocess.run(
        [str(python), "-I", "-c", PARSE],
        input=json.dumps(commands),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_vllm_accepts_the_rendered_command_lines() -> None:
    skip_if_asked()
    containers = _engine_containers()
    commands = _engine_commands()
    # examples/ (GPU), a pvc:// model, examples/cpu/, examples/gpu/, a pod template
    assert len(commands) == 8
    assert all(command[:2] == ["vllm", "serve"] for command in commands)
    # One malformed line alongside shows the check can fail (vLLM refuses unknown flags).
    result = _parse_with_vllm([*commands, MALFORMED])
    *parsed, malformed = result["parsed"]
    assert "--no-such-flag" in malformed["error"]
    shapes = set()
    for command, args, container in zip(commands, parsed, containers, strict=True):
        assert "error" not in args, f"vllm serve rejected {command}: {args['error']}"
        assert args["enable_scale_out"]
        # vLLM's world: tensor x pipeline GPUs per data-parallel rank, every GPU of the pod.
        ranks = (
            args["tensor_parallel_size"]
            * args["pipeline_parallel_size"]
            * args["data_parallel_size"]
        )
        gpus = int(container["resources"]["limits"].get("nvidia.com/gpu", "0"))
        assert ranks == gpus or gpus == 0, (command, gpus)
        # One node: vLLM infers the local ranks (dataLocal is for multi-node engines).
        assert args["data_parallel_size_local"] is None
        shapes.add(
            (
                args["tensor_parallel_size"],
                args["pipeline_parallel_size"],
                args["data_parallel_size"],
                args["enable_expert_parallel"],
            )
        )
        if args["tool_call_parser"]:
            assert args["enable_auto_tool_choice"]
            assert args["tool_call_parser"] in result["tool_parsers"]
        if args["reasoning_parser"]:
            assert args["reasoning_parser"] in result["reasoning_parsers"]
        # Publishing is on by default: the key middleware and the exact reload.
        assert args["middleware"] == [localengine.KEY_MIDDLEWARE]
        assert args["worker_extension_cls"] == localengine.WORKER_EXTENSION
    # The shapes vLLM read: tensor 4 (70B), pipeline 2 (pvc://), data 8 + expert (MoE).
    assert {(4, 1, 1, False), (1, 2, 1, False), (1, 1, 8, True)} <= shapes


def test_vllm_knows_the_multi_node_flags_parallelism_nodes_will_need() -> None:
    """Multi-node engines are not rendered yet (parallelism.nodes must be 1); the flags the
    LeaderWorkerSet engine will pass exist in this vLLM (0.32) and mean what the design
    assumes: 16 data-parallel ranks, 8 on this node, starting at rank 8, a headless worker."""
    skip_if_asked()
    worker = [
        "vllm", "serve", "m",
        "--data-parallel-size", "16",
        "--data-parallel-size-local", "8",
        "--data-parallel-start-rank", "8",
        "--data-parallel-address", "leader.example",
        "--data-parallel-rpc-port", "13345",
        "--enable-expert-parallel",
        "--headless",
    ]  # fmt: skip
    (args,) = _parse_with_vllm([worker])["parsed"]
    assert "error" not in args, args
    assert (args["data_parallel_size"], args["data_parallel_size_local"]) == (16, 8)
    assert args["enable_expert_parallel"] is True


def test_the_engines_python_imports_what_the_pod_names_from_its_pythonpath(
    tmp_path: Path,
) -> None:
    """The engine pod's init container writes tokenkeep_vllm.py into the folder on the vLLM
    container's PYTHONPATH; vLLM's own Python (with vLLM's packages, not tokenkeep's) then
    imports the middleware and the worker extension the command line names."""
    skip_if_asked()
    from tests.operator.test_manifests import _cpu_pair, _engine_pod, _env, _flag

    pod = _engine_pod(_cpu_pair()[0])
    (init,) = pod["initContainers"]
    (vllm,) = pod["containers"]
    folder = _env(vllm)["PYTHONPATH"]
    exec(init["command"][2].replace(folder, str(tmp_path)), {})
    names = [_flag(vllm["args"], "--middleware"), _flag(vllm["args"], "--worker-extension-cls")]
    check = (
        "import importlib, sys\n"
        "for name in sys.argv[1:]:\n"
        "    module, _, obj = name.rpartition('.')\n"
        "    getattr(importlib.import_module(module), obj)\n"
        "import vllm; print(importlib.import_module('tokenkeep_vllm').__file__)\n"
    )
    done = subprocess.run(
        [str(localengine.install()), "-c", check, *names],
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == str(tmp_path / "tokenkeep_vllm.py")
