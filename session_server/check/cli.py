"""`tokenkeep check` on the command line."""

from __future__ import annotations

import asyncio
import json
import logging
import sys

from session_server.check.report import format_report
from session_server.check.run import CheckInputError, load_model, run_check
from tokenkeep.cli import Parser, fail

PROG = "tokenkeep check"


def main(argv: list[str] | None = None) -> int:
    import time

    parser = Parser(
        prog=PROG,
        description="Will this model's multi-turn rollouts stay token-exact through tokenkeep?",
    )
    parser.add_argument(
        "--tokenizer", required=True, help="tokenizer directory, as for serve (required)"
    )
    parser.add_argument("--renderer", default="auto", help="auto or a renderer name")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    try:
        model = load_model(args.tokenizer, args.renderer)
    except CheckInputError as exc:
        return fail(PROG, str(exc))
    interactive = sys.stderr.isatty()

    def progress(line: str) -> None:
        if interactive:
            print(f"\r\033[Kchecking {line}", end="", file=sys.stderr, flush=True)
        else:
            print(f"checking {line}", file=sys.stderr, flush=True)

    tokenkeep_log = logging.getLogger("tokenkeep")
    level = tokenkeep_log.level
    tokenkeep_log.setLevel(logging.ERROR)  # the report says it all
    try:
        report = asyncio.run(run_check(model, name=args.tokenizer, progress=progress))
    finally:
        # main() also runs in-process (tests): a level left at ERROR silenced every later
        # server's access log there.
        tokenkeep_log.setLevel(level)
    if interactive:
        print("\r\033[K", end="", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(report.as_json(), indent=1))
    else:
        print(format_report(report, time.perf_counter() - started))
    if model.path.syntax_unlearned:
        print(
            f"tokenkeep check: TOOL-CALL SYNTAX NOT LEARNED: {model.path.syntax_unlearned}; "
            "tool calls reach the harness as text (serve runs on the generic path)",
            file=sys.stderr,
        )
        return 2
    return 0 if report.ok else 1
