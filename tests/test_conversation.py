"""Fingerprints: equal for what harnesses rewrite without meaning to, different otherwise."""

from __future__ import annotations

import gc
import json
import tracemalloc

import pytest

from session_server.conversation import (
    Conversation,
    ConversationError,
    Memo,
    Message,
    Tool,
    ToolCall,
    canonical_arguments,
    compile_rules,
    lineage,
    message_digest,
    message_fingerprint,
)


def _assistant(arguments: str, content: str | None = "", reasoning: str | None = None) -> Message:
    return Message(
        "assistant",
        content or "",
        reasoning=reasoning,
        tool_calls=[ToolCall("call_1", "f", arguments)],
    )


@pytest.mark.parametrize(
    ("sampled", "echoed"),
    [
        ('{"a":1,"b":"x"}', '{"b": "x", "a": 1}'),
        ('{"city": "Z\\u00fcrich"}', '{"city": "Zürich"}'),
        ('{"x": 1e3}', '{"x": 1000.0}'),
        ('{"x": 1000}', '{"x": 1000.0}'),
        ('{"ok": false, "v": null}', "{'ok': False, 'v': None}"),
        ('  {"a": [1, 2]}  ', '{"a":[1,2]}'),
    ],
)
def test_reserialized_arguments_match(sampled: str, echoed: str) -> None:
    assert message_fingerprint(_assistant(sampled)) == message_fingerprint(_assistant(echoed))


def test_different_arguments_differ() -> None:
    assert message_fingerprint(_assistant('{"a": 1}')) != message_fingerprint(
        _assistant('{"a": 2}')
    )
    assert canonical_arguments('{"a": "1"}') != canonical_arguments('{"a": 1}')


def test_reasoning_whitespace_and_none_content_are_ignored() -> None:
    sampled = Message("assistant", "  Hello\r\n", reasoning="thinking")
    assert message_fingerprint(sampled) == message_fingerprint(Message("assistant", "Hello"))
    assert message_fingerprint(Message("user", "Hi")) != message_fingerprint(
        Message("user", "Hello")
    )
    assert message_fingerprint(Message("user", "Hi")) != message_fingerprint(
        Message("assistant", "Hi")
    )


def test_lineage_keys_find_a_prefix_and_tools_are_part_of_history() -> None:
    tools = [Tool("f", "d", {"type": "object"})]
    history = [Message("user", "q"), Message("assistant", "a"), Message("user", "q2")]
    keys = lineage(Conversation(messages=history, tools=tools))
    first = lineage(Conversation(messages=history[:1], tools=tools))
    assert first.reply_key(Message("assistant", " a ")) == keys.reply_keys_for_lookup()[0]
    other_tools = lineage(Conversation(messages=history, tools=[]))
    assert other_tools.reply_keys_for_lookup() != keys.reply_keys_for_lookup()
    assert keys.input_key != first.input_key


def test_normalization_rules_make_volatile_parts_equal() -> None:
    rules = compile_rules([{"pattern": r"x-billing-header: \S+"}])
    a = Message("system", "You are Claude.\nx-billing-header: abc123")
    b = Message("system", "You are Claude.\nx-billing-header: zzz999")
    assert message_fingerprint(a) != message_fingerprint(b)
    assert message_fingerprint(a, rules) == message_fingerprint(b, rules)
    with pytest.raises(ConversationError):
        compile_rules([{"pattern": "("}])


def test_memos_keep_digests_not_the_texts_clients_sent() -> None:
    """The per-process memos (message digests, canonical tool arguments) must not keep what
    every request sent: 40 distinct 1 MB messages and tool arguments leave little behind
    once their requests are gone (keyed by the texts, they kept all of it: ~120 MB)."""
    tracemalloc.start()
    try:
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        for k in range(40):
            text = f"{k:08d}" + "x" * (1 << 20)
            first = message_digest(Message("user", text))
            assert message_digest(Message("user", text)) == first  # still memoised
            canonical_arguments(json.dumps({"path": "f", "content": text}))
            del text
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert kept < 4 << 20, kept


def test_a_memo_stays_within_its_bytes() -> None:
    memo = Memo(max_bytes=4096, max_entry_bytes=1024)
    for k in range(100):
        memo.put(k.to_bytes(16, "little"), "v" * 200, 200)
    assert memo.bytes <= 4096
    assert memo.get((99).to_bytes(16, "little")) == "v" * 200  # the newest are kept
    assert memo.get((0).to_bytes(16, "little")) is None
    memo.put(b"k" * 16, "v" * 2000, 2000)  # over the entry bound: not kept
    assert memo.get(b"k" * 16) is None
