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

# One vLLM process for every check of this module (importing vLLM takes most of a minute):
# `parse` command lines through `vllm serve`'s parser; `launch` command lines through
# EngineArgs.create_engine_config, stopped where it has built the ParallelConfig (the
# model-shape checks that follow are the real model's, which the tiny stand-in `model` cannot
# pass): how vLLM 0.32 reads each pod's place in a multi-node group.
PARSE = """
import contextlib, io, json, sys
from vllm.engine import arg_utils
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.reasoning import ReasoningParserManager
from vllm.tool_parsers import ToolParserManager
from vllm.utils.argparse_utils import FlexibleArgumentParser

parser = FlexibleArgumentParser(prog="vllm")
ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))
request = json.load(sys.stdin)
parsed = []
for command in request["parse"]:
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

class Built(Exception):
    pass

def stop_at_vllm_config(**kwargs):
    raise Built(kwargs["parallel_config"])

arg_utils.VllmConfig = stop_at_vllm_config  # after the parser, which reads its fields
launched = []
for command in request["launch"]:
    args = parser.parse_args(command[1:])
    args.model = request["model"]
    try:
        arg_utils.EngineArgs.from_cli_args(args).create_engine_config(headless=args.headless)
    except Built as built:
        config = built.args[0]
    launched.append({
        "headless": args.headless,
        "world": config.world_size,
        "data_parallel_rank": config.data_parallel_rank,
        "data_parallel_size_local": config.data_parallel_size_local,
        "data_parallel_address": config.data_parallel_master_ip,
        "data_parallel_rpc_port": config.data_parallel_rpc_port,
        "master": f"{config.master_addr}:{config.master_port}",
        "nodes_per_rank": config.nnodes_within_dp,
        "node_in_rank": config.node_rank_within_dp,
    })
print(json.dumps({
    "parsed": parsed,
    "launched": launched,
    "tool_parsers": list(ToolParserManager.list_registered()),
    "reasoning_parsers": list(ReasoningParserManager.list_registered()),
}))
"""


def _engine_containers() -> list[dict[str, Any]]:
    containers = []
    for render in SCENARIOS.values():
        for obj in render():
            if obj["kind"] == "Deployment" and obj["metadata"]["name"].endswith("-engine"):
                container = obj["spec"]["template"]["spec"]["containers"][0]
                if container["name"] == "vllm":  # SGLang's: tests/operator/test_sglang.py
                    containers.append(container)
    return containers


def _engine_commands() -> list[list[str]]:
    return [c["command"] + c["args"] for c in _engine_containers()]


MALFORMED = ["vllm", "serve", "m", "--no-such-flag"]


LEADER_ADDRESS = "ds-engine-lws-0.ds-engine-lws.ns"
TWO_NODE_SCENARIOS = ("gpu-moe-two-nodes", "modelserver-two-node-pipeline")


def _group_commands(scenario: str) -> list[list[str]]:
    """The leader's and the worker's command lines of a two-node scenario, with the
    variables the LWS webhook injects expanded as the kubelet would (worker index 1)."""
    from tokenkeep_operator.manifests import engine

    (lws,) = [o for o in SCENARIOS[scenario]() if o["kind"] == "LeaderWorkerSet"]
    values = {engine.LEADER_ADDRESS_VARIABLE: LEADER_ADDRESS}
    commands = []
    for role, index in (("leaderTemplate", "0"), ("workerTemplate", "1")):
        container = lws["spec"]["leaderWorkerTemplate"][role]["spec"]["containers"][0]
        values[engine.WORKER_INDEX_VARIABLE] = index
        line = container["command"] + container["args"]
        for name, value in values.items():
            line = [part.replace(f"$({name})", value) for part in line]
        commands.append(line)
    return commands


@pytest.fixture(scope="module")
def vllm_read() -> dict[str, Any]:
    """What vLLM made of the rendered single-node lines (and one malformed line), and of the
    leader's and the worker's line of each two-node scenario."""
    skip_if_asked()
    request = {
        "parse": [*_engine_commands(), MALFORMED],
        "launch": [line for s in TWO_NODE_SCENARIOS for line in _group_commands(s)],
        "model": str(localengine.model_dir()),
    }
    python = localengine.install()  # cached: `make engine` installed it
    done = subprocess.run(
        [str(python), "-I", "-c", PARSE],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_vllm_accepts_the_rendered_command_lines(vllm_read: dict[str, Any]) -> None:
    containers = _engine_containers()
    commands = _engine_commands()
    # examples/ (GPU), a pvc:// model, examples/cpu/, examples/gpu/, a pod template
    assert len(commands) == 8
    assert all(command[:2] == ["vllm", "serve"] for command in commands)
    # One malformed line alongside shows the check can fail (vLLM refuses unknown flags).
    result = vllm_read
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


def test_vllm_reads_each_pod_of_a_two_node_group_as_the_launch_intends(
    vllm_read: dict[str, Any],
) -> None:
    """vLLM 0.32's own config code, given the rendered leader and worker lines: DP + EP
    (16 ranks, 8 per node) puts ranks 0-7 behind the leader's API and 8-15 on the headless
    worker, which hands-shakes at the leader's address; tensor 8 x pipeline 2 spans both
    nodes in one torch.distributed world at the leader's master address, the worker its
    second node (vLLM's headless multiproc executor)."""
    leader = LEADER_ADDRESS
    moe_leader, moe_worker, dense_leader, dense_worker = vllm_read["launched"]
    master = f"{leader}:29501"
    for pod, rank, headless in ((moe_leader, 0, False), (moe_worker, 8, True)):
        assert pod == {
            "headless": headless,
            "world": 1,  # each data-parallel rank: tensor 1 x pipeline 1
            "data_parallel_rank": rank,
            "data_parallel_size_local": 8,
            "data_parallel_address": leader,
            "data_parallel_rpc_port": 29550,
            "master": master,
            "nodes_per_rank": 1,
            "node_in_rank": 0,  # a worker node runs whole ranks (headless DP engines)
        }
    for pod, node, headless in ((dense_leader, 0, False), (dense_worker, 1, True)):
        assert {k: pod[k] for k in ("headless", "world", "master", "nodes_per_rank")} == {
            "headless": headless,
            "world": 16,
            "master": master,
            "nodes_per_rank": 2,
        }
        assert (pod["data_parallel_rank"], pod["node_in_rank"]) == (0, node)


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
