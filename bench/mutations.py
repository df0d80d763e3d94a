"""Mutation check: does the suite catch deliberate bugs in the modules a trajectory passes?

Each mutant is a small hand-made edit (a bug that would corrupt training data or silence a
safety check) of the splice and turn logic, the export, the streamer, the lineage keys, each
API front-end, the store's record codec or the Redis Lua scripts; or (`--set lockdown`) one
of issue 33's security fixes undone. For each one the script copies the working tree to a
scratch directory, applies the edit there (the checkout is never touched), runs the targeted
test files (both stores: memory and Redis; a lockdown mutant runs the security tests named
with it) with that copy first on the import path, and records whether a test FAILED
("caught", with the first failing test), everything passed ("missed"), or the run ended
without a test failure (collection or import error, a fixture error, a timeout: "error",
never counted as caught).

    .venv/bin/python bench/mutations.py                  # the tests of the working tree
    .venv/bin/python bench/mutations.py --tests-from REV # the same mutants, REV's tests
    .venv/bin/python bench/mutations.py --only drop_tool_result
    .venv/bin/python bench/mutations.py --exclude "hanging_up or expired_session"
    .venv/bin/python bench/mutations.py --set lockdown   # issue 33's fixes, security tests

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
    tests: tuple[str, ...] = ()
    """Test files or node ids to run; empty: TARGETED (the trajectory's end-to-end tests)."""


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


# Issue 33 (lockdown): each fix of its five classes undone by a minimal edit, run against the
# security test(s) meant to catch it (live `tokenkeep serve` processes, both stores where the
# class is about stores). The tests are named per mutant: the whole targeted list above
# never exercises a hostile client.
SESSION_IDS = "session_server/api/session_ids.py"
SESSIONS_CACHE = "session_server/turns/sessions.py"
MEMORY_STORE = "session_server/store/memory.py"
MANAGEMENT = "session_server/management.py"
IMAGES = "session_server/images.py"
LIMITS = "session_server/api/limits.py"
ADMISSION = "session_server/admission.py"
CLI = "session_server/cli.py"
SSE = "session_server/api/sse.py"
SAMPLING = "session_server/sampling.py"
SESSIONS_API = "session_server/api/sessions.py"
APP = "session_server/app.py"
BINDING = "tests/security/test_session_binding.py"
STALLS = "tests/security/test_stalls.py"
INPUTS = "tests/security/test_inputs.py"
STORE_TESTS = "tests/store/test_store.py"
DISABLED = "if False:"

LOCKDOWN = [
    # --- class 1: credentials bound to the wrong session ---------------------------------
    Mutant(
        "repeated_header_first_copy_wins",
        "two differing copies of a credential header are read as the first, not refused",
        SESSION_IDS,
        (
            (
                "        if values.setdefault(name, value) != value:",
                "        if values.setdefault(name, value) != value and False:",
            ),
        ),
        (f"{BINDING}::test_repeated_credential_headers_are_refused_on_every_turn_api",),
    ),
    Mutant(
        "api_key_and_bearer_may_differ",
        "x-api-key and a Bearer token naming different keys are not refused",
        SESSION_IDS,
        (("    if api_key and bearer and api_key != bearer:", f"    {DISABLED}"),),
        (f"{BINDING}::test_repeated_credential_headers_are_refused_on_every_turn_api",),
    ),
    Mutant(
        "recreated_session_not_noticed",
        "a turn's lookup does not compare the session's incarnation with the cached metadata",
        PLANNING,
        (("        if found.incarnation != meta.incarnation:", f"        {DISABLED}"),),
        (
            f"{BINDING}::test_a_session_created_again_elsewhere_is_served_with_its_new_key_and_settings",
            f"{BINDING}::test_the_admin_gets_a_recreated_sessions_settings_on_a_server_that_cached_the_old",
        ),
    ),
    Mutant(
        "recreated_session_key_not_rechecked",
        "a re-created session is planned for a session key without checking it opens the new one",
        SESSIONS_CACHE,
        (("            if digest:\n", f"            {DISABLED}\n"),),
        (
            f"{BINDING}::test_a_session_created_again_elsewhere_is_served_with_its_new_key_and_settings",
        ),
    ),
    Mutant(
        "append_lua_ignores_incarnation",
        "append.lua stores a turn planned against a deleted and re-created session",
        APPEND_LUA,
        (
            (
                "if not state[2] or (ARGV[2] ~= '' and state[1] ~= ARGV[2]) then",
                "if not state[2] then",
            ),
        ),
        (f"{STORE_TESTS}::test_each_creation_of_an_id_has_its_own_incarnation",),
    ),
    Mutant(
        "memory_append_ignores_incarnation",
        "the embedded store stores a turn planned against a deleted and re-created session",
        MEMORY_STORE,
        (
            (
                "        if incarnation is not None and incarnation != session.incarnation:",
                f"        {DISABLED}",
            ),
        ),
        (f"{STORE_TESTS}::test_each_creation_of_an_id_has_its_own_incarnation",),
    ),
    # --- class 2: a finished rollout is final --------------------------------------------
    Mutant(
        "finished_session_planned",
        "a turn of a finished session is not refused at its lookup (it reaches the engine)",
        PLANNING,
        (("        if found.finished:", f"        {DISABLED}"),),
        (f"{BINDING}::test_a_finished_rollout_takes_no_more_turns",),
    ),
    Mutant(
        "append_lua_takes_finished",
        "append.lua stores a turn of a finished session",
        APPEND_LUA,
        (("if redis.call('HEXISTS', meta, 'fin') == 1 then", "if false then"),),
        (f"{STORE_TESTS}::test_a_finished_session_takes_no_turn",),
    ),
    Mutant(
        "memory_append_takes_finished",
        "the embedded store stores a turn of a finished session",
        MEMORY_STORE,
        (
            (
                "        if session.finish is not None:\n            raise SessionFinished",
                f"        {DISABLED}\n            raise SessionFinished",
            ),
        ),
        (f"{STORE_TESTS}::test_a_finished_session_takes_no_turn",),
    ),
    Mutant(
        "finish_leaves_in_flight_turns",
        "finish freezes the session but does not cut its generations in flight",
        SERVICE,
        (
            (
                "        await self.store.finish_session(session_id, finish)\n"
                "        return await self.abort(session_id)",
                "        await self.store.finish_session(session_id, finish)\n        return 0",
            ),
        ),
        (f"{BINDING}::test_a_turn_in_flight_at_finish_is_cut_and_not_stored",),
    ),
    Mutant(
        "finish_cuts_before_freezing",
        "finish cuts the turns in flight before it freezes (a cut turn is stored)",
        SERVICE,
        (
            (
                "        await self.store.finish_session(session_id, finish)\n"
                "        return await self.abort(session_id)",
                "        cut = await self.abort(session_id)\n"
                "        await self.store.finish_session(session_id, finish)\n"
                "        return cut",
            ),
        ),
        (f"{BINDING}::test_a_turn_in_flight_at_finish_is_cut_and_not_stored",),
    ),
    # --- class 3: one client stalls a replica --------------------------------------------
    Mutant(
        "tools_not_counted",
        "tool definitions are not counted by the text limit",
        CONVERSATION,
        (("    ) + sum(\n        len(t.name)", "    ) + 0 * sum(\n        len(t.name)"),),
        (f"{STALLS}::test_tools_count_against_the_text_limit",),
    ),
    Mutant(
        "image_pixels_not_read_from_header",
        "an image's declared size is not checked before its pixels are decoded",
        IMAGES,
        (("    if width * height > MAX_IMAGE_PIXELS:", f"    {DISABLED}"),),
        (f"{STALLS}::test_a_decompression_bomb_png_is_refused_from_its_header",),
    ),
    Mutant(
        "images_decoded_for_a_text_only_model",
        "images are decoded before a text-only model refuses them",
        IMAGES,
        (
            (
                "    if not takes_images:\n"
                '        raise ConversationError(TEXT_ONLY, param="messages")\n'
                "    await asyncio.to_thread(verify, images)",
                "    await asyncio.to_thread(verify, images)\n"
                "    if not takes_images:\n"
                '        raise ConversationError(TEXT_ONLY, param="messages")',
            ),
        ),
        (f"{STALLS}::test_many_images_for_a_text_only_model_are_refused_before_decoding",),
    ),
    Mutant(
        "body_strings_not_counted",
        "a body's JSON strings are not counted before it is parsed (one GIL-holding call)",
        LIMITS,
        (
            (
                '                if quotes.add(message.get("body", b"")) > 2 * self.max_strings:',
                f"                {DISABLED}",
            ),
        ),
        (
            "tests/security/test_event_loop.py::test_a_body_of_tiny_messages_is_refused_before_it_is_parsed",
        ),
    ),
    Mutant(
        "admission_before_the_body",
        "an admission slot is taken before the request's body is read",
        ADMISSION,
        (
            (
                "        chunks: list[bytes] = []\n"
                "        while True:\n"
                "            message = await receive()\n"
                '            if message["type"] != "http.request":\n'
                "                return  # gone before its request was all there: "
                "nothing to answer\n"
                '            chunks.append(message.get("body", b""))\n'
                '            if not message.get("more_body", False):\n'
                "                break\n"
                '        pending = [{"type": "http.request", "body": b"".join(chunks), '
                '"more_body": False}]\n',
                "        pending: list[Message] = []\n",
            ),
        ),
        (f"{STALLS}::test_slow_bodies_beyond_the_admission_bound_do_not_block_a_turn",),
    ),
    Mutant(
        "body_read_without_timeout",
        "a request body that stops arriving is waited for without a bound",
        LIMITS,
        (
            (
                "                async with asyncio.timeout_at(deadline):",
                "                async with asyncio.timeout_at(None):",
            ),
        ),
        (f"{STALLS}::test_a_body_that_stalls_midway_gets_a_timeout_answer",),
    ),
    Mutant(
        "idle_connections_kept",
        "the keep-alive setting is not passed to uvicorn (idle connections stay an hour)",
        CLI,
        (
            (
                "        timeout_keep_alive=settings.keep_alive_s,",
                "        timeout_keep_alive=3600,",
            ),
        ),
        (f"{STALLS}::test_idle_keep_alive_connections_are_closed",),
    ),
    Mutant(
        "unfinished_headers_kept",
        "uvicorn's own protocol, with no bound on a request's headers",
        CLI,
        (
            (
                "        http=TimedHttpProtocol.configured(settings.header_timeout_s, "
                "settings.max_header_bytes),",
                '        http="httptools",',
            ),
        ),
        (f"{STALLS}::test_connections_that_never_finish_their_headers_are_closed",),
    ),
    Mutant(
        "header_bytes_unbounded",
        "a request head is buffered however long it grows (till the header timeout)",
        LIMITS,
        (
            (
                "            if self._header_bytes > self.max_header_bytes:",
                f"            {DISABLED}",
            ),
        ),
        (f"{STALLS}::test_headers_past_the_bound_close_the_connection_at_once",),
    ),
    Mutant(
        "image_count_unchecked",
        "the number of images in one request is not bounded",
        IMAGES,
        (("    if count > MAX_IMAGES_PER_REQUEST:", f"    {DISABLED}"),),
        (f"{STALLS}::test_more_images_than_the_bound_are_refused_before_any_is_decoded",),
    ),
    Mutant(
        "hang_up_not_watched",
        "a client that hangs up does not cancel its turn (slot and engine request held)",
        SSE,
        (
            (
                "        if self.armed:\n            self.gone = True",
                "        if False:\n            self.gone = True",
            ),
        ),
        (
            f"{STALLS}::test_a_non_streamed_client_that_hangs_up_frees_its_slot_and_its_engine_request",
        ),
    ),
    Mutant(
        "memo_unbounded_in_bytes",
        "the argument and message memos evict nothing however many bytes they hold",
        CONVERSATION,
        (("            while self.bytes > self.max_bytes:", "            while False:"),),
        (
            "tests/test_conversation.py::test_a_memo_stays_within_its_bytes",
            "tests/test_conversation.py::test_memos_keep_digests_not_the_texts_clients_sent",
        ),
    ),
    Mutant(
        "memo_keeps_large_entries",
        "the memos keep entries of any size (a request's whole text)",
        CONVERSATION,
        (
            (
                "        if size > self.max_entry_bytes:\n            return",
                "        if False:\n            return",
            ),
        ),
        (
            "tests/test_conversation.py::test_a_memo_stays_within_its_bytes",
            "tests/test_conversation.py::test_memos_keep_digests_not_the_texts_clients_sent",
        ),
    ),
    # --- class 4: unclean answers ---------------------------------------------------------
    Mutant(
        "decompression_bomb_error_escapes",
        "PIL's DecompressionBombError at open is not caught (a 500)",
        IMAGES,
        (
            (
                "        Image.DecompressionBombError,\n        Image.DecompressionBombWarning,\n",
                "        Image.DecompressionBombWarning,\n",
            ),
        ),
        (f"{STALLS}::test_a_decompression_bomb_png_is_refused_from_its_header",),
    ),
    Mutant(
        "sampling_integers_past_64_bits",
        "seed and the other 64-bit sampling integers are not bounded",
        SAMPLING,
        (
            (
                "Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]",
                "Int64 = int",
            ),
        ),
        (f"{INPUTS}::test_sampling_beyond_the_engines_range_is_400_and_stores_nothing",),
    ),
    Mutant(
        "sampling_takes_infinity",
        "non-finite sampling floats are accepted (sent to the engine as null)",
        SAMPLING,
        (
            (
                'model_config = ConfigDict(extra="forbid", allow_inf_nan=False)',
                'model_config = ConfigDict(extra="forbid")',
            ),
        ),
        (
            f"{INPUTS}::test_a_huge_float_literal_is_refused_not_sent_as_null",
            f"{INPUTS}::test_sampling_beyond_the_engines_range_is_400_and_stores_nothing",
        ),
    ),
    Mutant(
        "session_sampling_unchecked",
        "a session's sampling overrides are stored unchecked",
        SESSIONS_API,
        (
            (
                "    sampling: SamplingParams | None = None\n",
                "    sampling: dict[str, Any] | None = None\n",
            ),
            ("body.sampling.model_dump(exclude_none=True)", "body.sampling"),
        ),
        (f"{INPUTS}::test_session_sampling_overrides_are_checked_at_creation",),
    ),
    Mutant(
        "server_sampling_overrides_unchecked",
        "the server-wide sampling overrides are not checked at start",
        APP,
        (
            (
                "        sampling_overrides=check_sampling(\n"
                '            settings.sampling_overrides, prefix="sampling_overrides."\n'
                "        ),",
                "        sampling_overrides=dict(settings.sampling_overrides),",
            ),
        ),
        (f"{INPUTS}::test_server_wide_sampling_overrides_are_checked_at_start",),
    ),
    Mutant(
        "ttl_unbounded",
        "ttl_seconds is not range-checked (each store answers its own way)",
        SESSIONS_API,
        (
            (
                "    ttl_seconds: int | None = Field(default=None, ge=1, le=MAX_TTL_SECONDS)",
                "    ttl_seconds: int | None = None",
            ),
        ),
        (f"{INPUTS}::test_ttl_out_of_range_is_400_on_both_stores",),
    ),
    Mutant(
        "list_filters_take_nan",
        "GET /sessions takes non-finite since / until",
        SESSIONS_API,
        (
            (
                "    since: float | None = Query(default=None, allow_inf_nan=False),\n"
                "    until: float | None = Query(default=None, allow_inf_nan=False),",
                "    since: float | None = Query(default=None),\n"
                "    until: float | None = Query(default=None),",
            ),
        ),
        (f"{INPUTS}::test_list_time_filters_must_be_finite",),
    ),
    Mutant(
        "export_filters_take_nan",
        "POST /sessions/export takes a non-finite since",
        SESSIONS_API,
        (
            (
                "    since: float | None = Field(default=None, allow_inf_nan=False)",
                "    since: float | None = None",
            ),
        ),
        (f"{INPUTS}::test_export_filters_must_be_finite",),
    ),
    Mutant(
        "tool_arguments_nest_unbounded",
        "a tool call's arguments are not checked for depth",
        CONVERSATION,
        (("            if too_deep(call.arguments):", f"            {DISABLED}"),),
        (f"{INPUTS}::test_deeply_nested_tool_call_arguments_are_400",),
    ),
    Mutant(
        "metadata_nests_unbounded",
        "session metadata is stored at any depth",
        SESSIONS_API,
        (("    if too_deep(value):\n", f"    {DISABLED}\n"),),
        (f"{INPUTS}::test_deeply_nested_metadata_is_refused_before_it_is_stored",),
    ),
    Mutant(
        "engine_negative_token_ids_kept",
        "an engine's negative token ids are not refused",
        SERVICE,
        (
            (
                "elif token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab):",
                "elif token_ids and max(token_ids) >= vocab:",
            ),
        ),
        (f"{INPUTS}::test_an_engine_reply_it_could_not_have_sampled_is_502_and_stores_nothing",),
    ),
    Mutant(
        "engine_token_ids_past_vocabulary_kept",
        "an engine's token ids past the model's output layer are stored",
        SERVICE,
        (
            (
                "elif token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab):",
                "elif token_ids and min(token_ids) < 0:",
            ),
        ),
        (f"{INPUTS}::test_an_engine_reply_it_could_not_have_sampled_is_502_and_stores_nothing",),
    ),
    Mutant(
        "engine_reply_past_max_tokens_kept",
        "an engine reply longer than max_tokens is accepted",
        SERVICE,
        (("        elif len(received[index]) + len(token_ids) > limit:", "        elif False:"),),
        (f"{INPUTS}::test_an_engine_reply_it_could_not_have_sampled_is_502_and_stores_nothing",),
    ),
    Mutant(
        "engine_stream_unchecked",
        "a streamed engine reply is relayed unchecked (past max_tokens without bound)",
        SERVICE,
        (("                        self._check_reply(plan, tokens, i, event.token_ids)\n", ""),),
        (f"{INPUTS}::test_a_stream_past_max_tokens_is_cut_and_stores_nothing",),
    ),
    # --- class 5: timing oracle, abort {finish} racing finish -----------------------------
    Mutant(
        "wrong_key_refused_from_cache",
        "a wrong key for a cached session is refused without a store read (a timing oracle)",
        SESSIONS_CACHE,
        (
            (
                "        if cached is not None and key_opens(cached.key_hash, digest):\n"
                "            return cached\n",
                "        if cached is not None:\n"
                "            return cached if key_opens(cached.key_hash, digest) else None\n",
            ),
        ),
        (f"{BINDING}::test_a_wrong_key_costs_one_store_read_whether_or_not_its_session_exists",),
    ),
    Mutant(
        "abort_finish_cuts_before_freezing",
        "abort {finish: true} cuts the turns in flight before it freezes the session",
        MANAGEMENT,
        (
            (
                "        if finish:\n            done, cut = await self.finish(",
                "        if finish:\n            await self.turns.abort(session_id)\n"
                "            done, cut = await self.finish(",
            ),
        ),
        (f"{BINDING}::test_abort_with_finish_freezes_before_it_cuts",),
    ),
]

MUTANT_SETS = {"trajectory": MUTANTS, "lockdown": LOCKDOWN, "all": MUTANTS + LOCKDOWN}


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


def tests_of(mutant: Mutant) -> tuple[str, ...]:
    return mutant.tests or tuple(TARGETED)


def run_tests(
    tree: Path, tests: list[str], timeout: int, exclude: str | None = None
) -> tuple[int, float, str]:
    present = [t for t in tests if (tree / t.partition("::")[0]).is_file()]
    select = SELECT + (f" and not ({exclude})" if exclude else "")
    # Wide: pytest drops the failure message from a summary line longer than the terminal.
    env = {**os.environ, "PYTHONPATH": str(tree), "COLUMNS": "400"}
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
    parser.add_argument(
        "--only", action="append", help="mutant name (repeatable; run in the order given)"
    )
    parser.add_argument(
        "--no-baseline",
        action="store_true",
        help="skip the unmutated run (only to resume a run cut short on the same tree)",
    )
    parser.add_argument("--timeout", type=int, default=600, help="seconds per test run")
    parser.add_argument("--exclude", help="-k expression of tests to leave out (e.g. flaky)")
    parser.add_argument(
        "--healthz-bound-s",
        type=float,
        help="the security tests' /healthz bound (100 ms) for a machine too loaded to hold it",
    )
    parser.add_argument(
        "--set",
        choices=sorted(MUTANT_SETS),
        default="all",
        help="trajectory: the modules a trajectory passes; lockdown: issue 33's fixes",
    )
    args = parser.parse_args()
    if args.healthz_bound_s is not None:
        os.environ["TOKENKEEP_HEALTHZ_BOUND_S"] = str(args.healthz_bound_s)
    by_name = {m.name: m for m in MUTANT_SETS[args.set]}
    chosen = [by_name[name] for name in args.only] if args.only else MUTANT_SETS[args.set]
    # The baseline runs every test a chosen mutant will run, once, unmutated.
    baseline = list(dict.fromkeys(t for m in chosen for t in tests_of(m)))
    with tempfile.TemporaryDirectory(prefix="tokenkeep-mutants-") as scratch:
        tree = Path(scratch)
        copy_tree(tree, args.tests_from)
        code, seconds, output = 0, 0.0, ""
        if not args.no_baseline:
            code, seconds, output = run_tests(tree, baseline, args.timeout, args.exclude)
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
                code, seconds, output = run_tests(
                    tree, list(tests_of(mutant)), args.timeout, args.exclude
                )
            finally:
                path.write_text(original)
            verdict, by = judge(code, output)
            rows.append((mutant, verdict, by))
            # What the failure said: a timing bound missed under load is not the mutant.
            said = next(
                (x.partition(" - ")[2] for x in output.splitlines() if x.startswith("FAILED ")), ""
            )
            print(f"{mutant.name}: {verdict} (exit {code}, {seconds:.0f}s) {by} {said[:300]}")
            sys.stdout.flush()
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
