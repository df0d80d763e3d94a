"""Mutation check: does the suite catch deliberate bugs in the modules a trajectory passes?

Each mutant is a small hand-made edit (a bug that would corrupt training data or silence a
safety check) of the splice and turn logic, the export, the streamer, the lineage keys, each
API front-end, the store's record codec or the Redis Lua scripts. For each one the script
copies the working tree to a scratch directory, applies the edit there (the checkout is never
touched), runs the targeted test files (both stores: memory and Redis) with that copy first
on the import path, and records whether a test FAILED ("caught", with the first failing
test), everything passed ("missed"), or the run ended without a test failure (collection or
import error, a fixture error, a timeout: "error", never counted as caught).

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
SERVICE = "session_server/turns/service.py"
PLANNING = "session_server/turns/planning.py"
EXPORT = "session_server/export.py"
STREAMING = "session_server/reply_split.py"
CONVERSATION = "session_server/conversation.py"
CHAT = "session_server/api/chat.py"
MESSAGES = "session_server/api/messages.py"
RESPONSES = "session_server/api/responses.py"
COMPLETIONS = "session_server/api/completions.py"
CODEC = "session_server/store/codec.py"
APPEND_LUA = "session_server/store/append.lua"
LOOKUP_LUA = "session_server/store/lookup.lua"
# The tests that exercise those modules end to end, the quick ones first (`-x` stops at the
# first failure, so a caught mutant costs little). Both stores: the Lua scripts and the codec
# only run on Redis.
TARGETED = [
    "tests/store/test_codec.py",
    "tests/store/test_store.py",
    "tests/session/test_logprobs.py",
    "tests/session/test_contiguity.py",
    "tests/session/test_families.py",
    "tests/session/test_lineage.py",
    "tests/session/test_safety_checks.py",
    "tests/session/test_token_prompts.py",
    "tests/trainer/test_client.py",
    "tests/trainer/test_weight_versions.py",
    "tests/api/test_messages_e2e.py",
    "tests/api/test_responses_e2e.py",
    "tests/api/test_messages_cross_api.py",
    "tests/session/test_stream_equivalence.py",
]
PYTEST_ARGS = ["-x", "-q", "-rfE", "-p", "no:cacheprovider", "-p", "no:randomly"]
SELECT = "not vllm"


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
                "            to_renderer_messages(new_messages),\n",
                "            to_renderer_messages([m for m in new_messages"
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
        (
            (
                "        return Bridge(expanded, runs=runs)\n",
                "        return Bridge(expanded[:-3], runs=runs)\n",
            ),
        ),
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
        SERVICE,
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
        SERVICE,
        (("            self.metrics.proof_failures.inc()\n", ""),),
    ),
    Mutant(
        "break_reason_lost",
        "a refused bridge is recorded as `history_mismatch` instead of its own reason",
        PLANNING,
        (
            (
                '"rewrite", reason or "history_mismatch"',
                '"rewrite", "history_mismatch"',
            ),
        ),
    ),
    Mutant(
        "last_stored_token_dropped",
        "the spliced prompt loses the last stored token before the bridge",
        PLANNING,
        (
            (
                "prompt=stored + bridge.delta,",
                "prompt=stored[:-1] + bridge.delta,",
            ),
        ),
    ),
    Mutant(
        "fork_reported_as_extend",
        "extend and fork are swapped when a turn already has a continuation",
        PLANNING,
        (
            (
                '                kind = "fork" if found.parent_children else "extend"\n'
                "                plan = self._plan(",
                '                kind = "extend" if found.parent_children else "fork"\n'
                "                plan = self._plan(",
            ),
        ),
    ),
    Mutant(
        "export_logprobs_shifted",
        "exported logprobs are shifted by one position within each turn",
        EXPORT,
        (
            (
                "for lp in turn.logprobs)",
                "for lp in [*turn.logprobs[1:], *turn.logprobs[:1]])",
            ),
        ),
    ),
    Mutant(
        "export_prompt_in_loss",
        "the prompt delta is marked for the loss",
        EXPORT,
        (
            (
                'current["loss_mask"].extend([0] * len(turn.prompt_delta))',
                'current["loss_mask"].extend([1] * len(turn.prompt_delta))',
            ),
        ),
    ),
    Mutant(
        "export_versions_at_prompt",
        "policy-version spans are placed at the turn's prompt, not its sampled tokens",
        EXPORT,
        (
            (
                "spans = _shifted(turn.weight_versions, completion_start)",
                "spans = _shifted(turn.weight_versions, prompt_start)",
            ),
        ),
    ),
    Mutant(
        "stream_tool_call_text",
        "the text of a tool call streams as content",
        STREAMING,
        (
            (
                'elif token in self._holds and self._channel != "tool":',
                "elif False:",
            ),
        ),
    ),
    Mutant(
        "stream_split_character",
        "half a multibyte character is streamed",
        STREAMING,
        (("        if text.endswith(_REPLACEMENT) and not final:\n", "        if False:\n"),),
    ),
    Mutant(
        "lineage_ignores_tool_content",
        "lineage keys ignore a tool result's content",
        CONVERSATION,
        (
            (
                "    parts: list[str] = [message.role, canonical_text(message.content, rules)]",
                "    parts: list[str] = [message.role, '' if message.role == 'tool' "
                "else canonical_text(message.content, rules)]",
            ),
        ),
    ),
    Mutant(
        "lineage_ignores_tool_arguments",
        "lineage keys ignore a tool call's arguments",
        CONVERSATION,
        (("            parts.append(canonical_arguments(call.arguments))\n", ""),),
    ),
    Mutant(
        "chat_logprobs_shifted",
        "Chat Completions `logprobs` are shifted by one position",
        CHAT,
        (
            (
                "for token, lp in zip(token_ids, logprobs, strict=False):",
                "for token, lp in zip(token_ids, [*logprobs[1:], *logprobs[:1]], strict=False):",
            ),
        ),
    ),
    Mutant(
        "messages_tool_result_first_block",
        "an Anthropic tool_result keeps only its first block",
        MESSAGES,
        (
            (
                'result = _with_images(block.content, f"{param}.{j}.content")',
                'result = _with_images(block.content[:1], f"{param}.{j}.content")',
            ),
        ),
    ),
    Mutant(
        "responses_output_dropped",
        "a Responses function_call_output loses its output",
        RESPONSES,
        (
            (
                'Message(role="tool", content=text, images=images, tool_call_id=item.call_id)',
                'Message(role="tool", content="", images=images, tool_call_id=item.call_id)',
            ),
        ),
    ),
    Mutant(
        "completions_logprobs_shifted",
        "/v1/completions `token_logprobs` are shifted by one position",
        COMPLETIONS,
        (
            (
                '"token_logprobs": [None if math.isnan(v) else v for v in values],',
                '"token_logprobs": [None if math.isnan(v) else v for v in '
                "[*values[1:], *values[:1]]],",
            ),
        ),
    ),
    Mutant(
        "codec_logprobs_reversed",
        "the record codec stores a turn's logprobs in reverse order",
        CODEC,
        (
            (
                "logprobs = array(_F32, record.logprobs)",
                "logprobs = array(_F32, record.logprobs[::-1])",
            ),
        ),
    ),
    Mutant(
        "codec_segment_start_lost",
        "the record codec loses the segment-start flag",
        CODEC,
        (("(_SEGMENT_START if record.segment_start else 0)", "0"),),
    ),
    Mutant(
        "codec_versions_lost",
        "the record codec drops the policy-version spans",
        CODEC,
        (("    if record.weight_versions:\n", "    if False:\n"),),
    ),
    Mutant(
        "append_lua_parent_lost",
        "append.lua records every turn as a root in the parents hash",
        APPEND_LUA,
        (
            (
                "redis.call('HSET', parents, id, ARGV[pos])",
                "redis.call('HSET', parents, id, '0')",
            ),
        ),
    ),
    Mutant(
        "lookup_lua_children_ignored",
        "lookup.lua reports no children for the matched turn (a fork looks like an extend)",
        LOOKUP_LUA,
        (
            (
                "reply[5] = tonumber(redis.call('HGET', parents, 'c' .. id) or '0')",
                "reply[5] = 0",
            ),
        ),
    ),
    Mutant(
        "lookup_lua_shallowest_first",
        "lookup.lua matches the shallowest stored turn instead of the deepest",
        LOOKUP_LUA,
        (("for i = n, 1, -1 do", "for i = 1, n do"),),
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
            verdict, by = judge(code, output)
            rows.append((mutant, verdict, by))
            print(f"{mutant.name}: {verdict} (exit {code}, {seconds:.0f}s) {by}", flush=True)
    caught = sum(v == "caught" for _, v, _ in rows)
    print(f"\n{caught} of {len(rows)} caught\n")
    print("| mutant | file | what | result | caught by |")
    print("|---|---|---|---|---|")
    for mutant, verdict, by in rows:
        print(f"| `{mutant.name}` | {mutant.file} | {mutant.what} | {verdict} | {by} |")
    return 0


def judge(code: int, output: str) -> tuple[str, str]:
    """Only a test that ran and FAILED catches a mutant: pytest's exit 1 with a FAILED line.
    A collection or import error (exit 2), an error in a fixture (an ERROR line, no FAILED)
    or a timeout says the mutant broke something, not that a test noticed it."""
    failed = [line.split(" - ")[0] for line in output.splitlines() if line.startswith("FAILED ")]
    if code == 1 and failed:
        return "caught", failed[0].removeprefix("FAILED ")
    if code == 0:
        return "missed", ""
    errors = [line for line in output.splitlines() if line.startswith("ERROR ")]
    why = errors[0] if errors else (output.strip().splitlines() or [""])[-1]
    return "error", "timeout" if code == -1 else f"exit {code}, no test failed: {why}"


if __name__ == "__main__":
    sys.exit(main())
