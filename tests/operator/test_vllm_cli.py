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
        "tool_call_parser", "enable_auto_tool_choice", "reasoning_parser",
        "middleware", "worker_extension_cls")})
print(json.dumps({
    "parsed": parsed,
    "tool_parsers": list(ToolParserManager.list_registered()),
    "reasoning_parsers": list(ReasoningParserManager.list_registered()),
}))
"""


def _engine_commands() -> list[list[str]]:
    commands = []
    for render in SCENARIOS.values():
        for obj in render():
            if obj["kind"] == "Deployment" and obj["metadata"]["name"].endswith("-engine"):
                container = obj["spec"]["template"]["spec"]["containers"][0]
                commands.append(container["command"] + container["args"])
    return commands


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
    commands = _engine_commands()
    assert len(commands) == 4  # examples/ (GPU), a pvc:// model, examples/cpu/
    assert all(command[:2] == ["vllm", "serve"] for command in commands)
    # One malformed line alongside shows the check can fail (vLLM refuses unknown flags).
    result = _parse_with_vllm([*commands, MALFORMED])
    *parsed, malformed = result["parsed"]
    assert "--no-such-flag" in malformed["error"]
    for command, args in zip(commands, parsed, strict=True):
        assert "error" not in args, f"vllm serve rejected {command}: {args['error']}"
        assert args["enable_scale_out"]
        assert args["tensor_parallel_size"] * args["pipeline_parallel_size"] >= 1
        if args["tool_call_parser"]:
            assert args["enable_auto_tool_choice"]
            assert args["tool_call_parser"] in result["tool_parsers"]
        if args["reasoning_parser"]:
            assert args["reasoning_parser"] in result["reasoning_parsers"]
        # Publishing is on by default: the key middleware and the exact reload.
        assert args["middleware"] == [localengine.KEY_MIDDLEWARE]
        assert args["worker_extension_cls"] == localengine.WORKER_EXTENSION


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
