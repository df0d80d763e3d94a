"""The vLLM command lines the operator renders, parsed by vLLM's own `vllm serve` parser
(tier 2: runs where the vLLM CPU build is installed, skipped elsewhere)."""

from __future__ import annotations

import pytest

from tests.operator.test_manifests import SCENARIOS

pytestmark = pytest.mark.vllm


def _engine_commands() -> list[list[str]]:
    commands = []
    for render in SCENARIOS.values():
        for obj in render():
            if obj["kind"] == "Deployment" and obj["metadata"]["name"].endswith("-engine"):
                container = obj["spec"]["template"]["spec"]["containers"][0]
                commands.append(container["command"] + container["args"])
    return commands


def test_vllm_accepts_the_rendered_command_lines() -> None:
    pytest.importorskip("vllm")
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm")
    ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))
    commands = _engine_commands()
    assert len(commands) == 3
    for command in commands:
        assert command[:2] == ["vllm", "serve"]
        args = parser.parse_args(command[1:])
        assert args.enable_scale_out
        assert args.tensor_parallel_size * args.pipeline_parallel_size >= 1
        if args.tool_call_parser:
            assert args.enable_auto_tool_choice
            assert args.tool_call_parser in ToolParserManager.list_registered()
        if args.reasoning_parser:
            assert args.reasoning_parser in ReasoningParserManager.list_registered()
