"""Mutation check of the splice and turn modules: does the suite catch deliberate bugs?

Each mutant is a small hand-made edit of `session_server/splice.py` or
`session_server/turns.py` (a bug that would corrupt training data or silence a safety check).
For each one the script copies the working tree to a scratch directory, applies the edit
there (the checkout is never touched), runs the targeted test files with that copy first on
the import path, and records whether the tests fail ("caught") or pass ("missed").

    .venv/bin/python bench/mutations.py                  # the tests of the working tree
    .venv/bin/python bench/mutations.py --tests-from REV # the same mutants, REV's tests
    .venv/bin/python bench/mutations.py --only drop_tool_result
    .venv/bin/python bench/mutations.py --exclude "hanging_up or expired_session"

Results: bench/results/mutations.md (written by hand from this script's table).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SPLICE = "session_server/splice.py"
TURNS = "session_server/turns.py"
# The test files that exercise the splice and the turn logic: contiguity per mismatch class,
# the second family and the generic splice, the safety checks (where the tree has them).
# Only their in-memory-store cases: the mutated code is the same on either store, and the
# Redis cases would double a run that is already minutes per mutant on two cores.
TARGETED = [
    "tests/session/test_contiguity.py",
    "tests/session/test_families.py",
    "tests/session/test_lineage.py",
    "tests/session/test_safety_checks.py",
]
PYTEST_ARGS = ["-x", "-q", "-p", "no:cacheprovider", "-p", "no:randomly"]
SELECT = "not redis"


@dataclass(frozen=True)
class Mutant:
    name: str
    what: str
    file: str
    edits: tuple[tuple[str, str], ...]


MUTANTS = [
    Mutant(
        "drop_tool_result",
        "the family bridge leaves tool results out of the new messages",
        SPLICE,
        (
            (
                "                to_renderer_messages(new_messages),\n",
                "                to_renderer_messages([m for m in new_messages"
                " if m.role != 'tool']),\n",
            ),
        ),
    ),
    Mutant(
        "drop_tool_result_generic",
        "the generic splice renders the request without its tool results",
        SPLICE,
        (
            (
                "        after = self._apply_template(history + new_messages, tools, "
                "add_generation_prompt=True)",
                "        after = self._apply_template(history + [m for m in new_messages if "
                "m.role != 'tool'], tools, add_generation_prompt=True)",
            ),
        ),
    ),
    Mutant(
        "skip_generation_prompt",
        "the bridge drops its last 3 tokens (Qwen3's `<|im_start|>assistant\\n`)",
        SPLICE,
        (("        return Bridge(delta)\n", "        return Bridge(delta[:-3])\n"),),
    ),
    Mutant(
        "skip_generation_prompt_generic",
        "the generic splice renders the request without the generation prompt",
        SPLICE,
        (
            (
                "        after = self._apply_template(history + new_messages, tools, "
                "add_generation_prompt=True)",
                "        after = self._apply_template(history + new_messages, tools, "
                "add_generation_prompt=False)",
            ),
        ),
    ),
    Mutant(
        "truncated_turn_not_closed",
        "the generic splice does not close a turn cut by max_tokens",
        SPLICE,
        (("            closing = [close]", "            closing = []"),),
    ),
    Mutant(
        "disable_splice_proof",
        "the family bridge's output is used without checking it kept the stored tokens",
        SPLICE,
        (
            (
                "    if len(tokens) < cut or tokens[: len(prompt_ids)] != prompt_ids:\n"
                "        return None\n"
                "    if tokens[len(prompt_ids) : cut] != completion_ids:\n"
                "        return None\n",
                "",
            ),
        ),
    ),
    Mutant(
        "disable_generic_message_check",
        "the generic splice does not check that each new message is in its tokens",
        SPLICE,
        (("        if not _carries_messages(", "        if False and not _carries_messages("),),
    ),
    Mutant(
        "disable_engine_prompt_check",
        "the engine's report of the prompt it received is not compared with what was sent",
        TURNS,
        (
            (
                "        if reported is not None and reported != plan.prompt_ids:",
                "        if False:",
            ),
        ),
    ),
    Mutant(
        "proof_failure_not_counted",
        "a refused engine report is not counted in tokenkeep_proof_failures",
        TURNS,
        (("            self.metrics.proof_failures.inc()\n", ""),),
    ),
    Mutant(
        "break_reason_lost",
        "a refused bridge is recorded as `history_mismatch` instead of its own reason",
        TURNS,
        (
            (
                '            reason or "history_mismatch",\n',
                '            "history_mismatch",\n',
            ),
        ),
    ),
    Mutant(
        "last_stored_token_dropped",
        "the spliced prompt loses the last stored token before the bridge",
        TURNS,
        (
            (
                "                    stored + bridge.delta,",
                "                    stored[:-1] + bridge.delta,",
            ),
        ),
    ),
    Mutant(
        "fork_reported_as_extend",
        "extend and fork are swapped when a turn already has a continuation",
        TURNS,
        (
            (
                '                kind = "fork" if found.parent_children else "extend"\n'
                "                return self._plan(",
                '                kind = "extend" if found.parent_children else "fork"\n'
                "                return self._plan(",
            ),
        ),
    ),
]


def copy_tree(target: Path, tests_from: str | None) -> None:
    """The working tree's tracked and unignored files; with `tests_from`, tests/ as it was
    at that revision (the mutants always apply to the working tree's sources)."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.splitlines()
    for name in listed:
        source = REPO / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    cache = REPO / ".cache"
    if cache.is_dir():  # downloaded tokenizers and templates
        shutil.copytree(cache, target / ".cache", symlinks=True)
    if tests_from:
        shutil.rmtree(target / "tests")
        archive = subprocess.run(
            ["git", "archive", tests_from, "tests"], cwd=REPO, check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)


def run_tests(tree: Path, timeout: int, exclude: str | None = None) -> tuple[int, float, str]:
    present = [t for t in TARGETED if (tree / t).is_file()]
    select = SELECT + (f" and not ({exclude})" if exclude else "")
    env = {**os.environ, "PYTHONPATH": str(tree)}
    started = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pytest", *PYTEST_ARGS, "-k", select, *present],
            cwd=tree,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        code, output = done.returncode, done.stdout
    except subprocess.TimeoutExpired:
        code, output = -1, ""
    return code, time.monotonic() - started, output


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests-from", help="git revision whose tests/ to run")
    parser.add_argument("--only", action="append", help="mutant name (repeatable)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per test run")
    parser.add_argument("--exclude", help="-k expression of tests to leave out (e.g. flaky)")
    args = parser.parse_args()
    chosen = [m for m in MUTANTS if not args.only or m.name in args.only]
    with tempfile.TemporaryDirectory(prefix="tokenkeep-mutants-") as scratch:
        tree = Path(scratch)
        copy_tree(tree, args.tests_from)
        code, seconds, output = run_tests(tree, args.timeout, args.exclude)
        print(f"baseline (no mutant): exit {code} in {seconds:.0f}s", flush=True)
        if code != 0:
            print(output[-3000:], "the unmutated tree must pass first", file=sys.stderr)
            return 2
        rows = []
        for mutant in chosen:
            path = tree / mutant.file
            original = path.read_text()
            mutated = original
            for old, new in mutant.edits:
                if mutated.count(old) != 1:
                    raise SystemExit(f"{mutant.name}: edit does not apply once: {old!r}")
                mutated = mutated.replace(old, new)
            path.write_text(mutated)
            try:
                code, seconds, output = run_tests(tree, args.timeout, args.exclude)
            finally:
                path.write_text(original)
            verdict = "caught" if code not in (0, -1) else "missed" if code == 0 else "timeout"
            rows.append((mutant, verdict, seconds))
            failed = [line for line in output.splitlines() if line.startswith("FAILED")]
            print(
                f"{mutant.name}: {verdict} (exit {code}, {seconds:.0f}s) {failed[:1]}", flush=True
            )
    caught = sum(v == "caught" for _, v, _ in rows)
    print(f"\n{caught} of {len(rows)} caught\n")
    print("| mutant | file | what | result |")
    print("|---|---|---|---|")
    for mutant, verdict, _ in rows:
        print(f"| `{mutant.name}` | {mutant.file} | {mutant.what} | {verdict} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
