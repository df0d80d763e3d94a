"""Shared prompts are tokenized once (`session_server/shared_tokens.py`): G concurrent
first turns tokenize once, the cache stays inside its byte budget, and /metrics shows the
reuse on the served path. On the real tokenizer and template of every family in the support
matrix (the checks below, run by tests/session/test_family_paths.py on its models): a prompt
rendered from the cache is the prompt a fresh render gives, and a text cut at special tokens
tokenizes as the whole text does (BPE merges never cross a cut)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from session_server.conversation import Message, Tool
from session_server.shared_tokens import SHARED_MIN_CHARS, SharedTokens
from session_server.splice import ChatModel, to_renderer_messages
from session_server.tokenizer import FastTokenizer
from tests.engine_double import ScriptedCompletion
from tests.session.adversarial import END, tokens
from tests.session.conftest import Stack

LONG = SHARED_MIN_CHARS + 500
TOOLS = [
    Tool(
        "read_file",
        "Read a file. " + "It returns the file's text, line by line. " * 60,
        {"type": "object", "properties": {"path": {"type": "string"}}},
    )
]


def _repository(seed: str, chars: int) -> str:
    """Code-like text with non-ASCII, long whitespace runs and a line that ends without a
    newline (where BPE would merge with whatever follows)."""
    lines = [
        f"def f_{seed}_{i}(x):\n    return x * {i}  # café ünïcode {i}\n\n" for i in range(9999)
    ]
    return "".join(lines)[:chars] + "    tail_without_newline"


@contextmanager
def unshared(tokenizer: FastTokenizer) -> Iterator[None]:
    """The same tokenizer with no shared-tokens cache: every text tokenized fresh."""
    shared = tokenizer.shared
    tokenizer.shared = None
    try:
        yield
    finally:
        tokenizer.shared = shared


def _conversation(model: ChatModel, seed: str) -> list[Message]:
    specials = sorted(model.tokenizer.special_token_ids)[:3]
    named = "".join(model.tokenizer.convert_ids_to_tokens(specials))
    return [
        Message(role="system", content="You are a coding agent.\n" + _repository("sys", LONG)),
        # A user message that quotes special tokens in the middle of long text: the
        # template's text then holds them where no message boundary is.
        Message(role="user", content=_repository(seed, LONG) + named + _repository(seed, LONG)),
    ]


def assert_shared_render_is_fresh(family: ChatModel) -> None:
    """A prompt rendered with the cache (a miss, a hit of everything, a hit of the system
    part) equals the same render with no cache, and the template path's ids equal the
    template's own `tokenize=True`. Run on every family by tests/session/test_family_paths.py
    (its models are loaded once there)."""
    tokenizer = family.tokenizer
    assert tokenizer.shared is not None
    for seed in ("one", "one", "two"):  # a miss, a hit of everything, a hit of the system part
        messages = _conversation(family, seed)
        hits = tokenizer.shared.hits
        shared = family.render_prompt(messages, TOOLS)
        template = family._apply_template(messages, TOOLS, add_generation_prompt=True)
        with unshared(tokenizer):
            assert shared == family.render_prompt(messages, TOOLS)
        fresh = tokenizer.hf.apply_chat_template(
            to_renderer_messages(messages),
            tools=[t.as_openai() for t in TOOLS],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        assert template == list(fresh)
        if seed == "two":  # the system prompt and tools, tokenized with "one", are reused
            assert tokenizer.shared.hits > hits


def _cut_cases(tokenizer: FastTokenizer) -> list[str]:
    """Texts with special tokens between long runs, where a cut must not change the ids:
    letters on both sides that BPE merges when nothing separates them, whitespace that a
    pre-tokenizer attaches to the next word, two specials in a row, a special's first half."""
    special = tokenizer.convert_ids_to_tokens(sorted(tokenizer.special_token_ids)[0])
    other = tokenizer.convert_ids_to_tokens(sorted(tokenizer.special_token_ids)[-1])
    body = _repository("cut", LONG)
    return [
        body + "abc" + special + "def" + body,
        body + "  \n " + special + special + other + "  \n" + body,
        body + special[: len(special) // 2] + body + special,
        special + body + " " + other + " " + body + special[:-1],
    ]


def assert_cuts_tokenize_as_the_whole_text(tokenizer: FastTokenizer) -> None:
    """Each `_cut_cases` text is cut into pieces whose ids, tokenized alone (and kept),
    are the whole text's. Run on every family by tests/session/test_family_paths.py."""
    assert tokenizer._cuts is not None  # every family in the matrix can be cut
    for text in _cut_cases(tokenizer):
        assert len(tokenizer._cuts.pieces(text)) > 1
        assert "".join(p for p, _ in tokenizer._cuts.pieces(text)) == text
        whole = tokenizer._backend.encode(text, add_special_tokens=False).ids
        assert tokenizer.encode(text) == whole  # first time: pieces tokenized and kept
        assert tokenizer.encode(text) == whole  # then from the cache


def _gated(calls: list[str], release: threading.Event) -> Any:
    def encode(text: str, add_special_tokens: bool) -> list[int]:
        calls.append(text)
        assert release.wait(30)
        return [len(text), int(add_special_tokens)]

    return encode


def test_a_group_arriving_at_once_waits_for_one_tokenization() -> None:
    calls: list[str] = []
    release = threading.Event()
    shared = SharedTokens(_gated(calls, release), budget_bytes=1 << 20)
    results: list[list[int]] = []
    group = [
        threading.Thread(target=lambda: results.append(shared.encode("x" * LONG, False)))
        for _ in range(8)
    ]
    for thread in group:
        thread.start()
    while shared.hits + shared.misses < len(group):  # all eight asked before any answer
        threading.Event().wait(0.001)
    release.set()
    for thread in group:
        thread.join(30)
    assert calls == ["x" * LONG]
    assert results == [[LONG, 0]] * 8
    assert (shared.misses, shared.hits) == (1, 7)


def test_the_cache_stays_inside_its_byte_budget() -> None:
    release = threading.Event()
    release.set()
    texts = [chr(ord("a") + i) * LONG for i in range(6)]
    one = SharedTokens(_gated([], release), budget_bytes=1 << 30)
    one.encode(texts[0], False)
    budget = one.bytes_held * 3  # room for three texts
    shared = SharedTokens(_gated([], release), budget_bytes=budget)
    for text in texts[:3]:
        shared.encode(text, False)
    shared.encode(texts[0], False)  # used again: the least recently used is now texts[1]
    for text in texts[3:]:
        shared.encode(text, False)
        assert shared.bytes_held <= budget
    misses = shared.misses
    shared.encode(texts[1], False)
    assert shared.misses == misses + 1  # evicted
    tiny = SharedTokens(_gated([], release), budget_bytes=100)
    tiny.encode(texts[0], False)
    assert tiny.bytes_held == 0  # larger than the whole budget: never kept


def _metric(text: str, name: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(name + " "))
    return float(line.split()[1])


def test_a_group_on_the_served_path_shows_reuse_in_metrics_only(memory_stack: Stack) -> None:
    body = "Fix the failing test.\n" + _repository("served", LONG)
    with memory_stack.http() as http:
        before = http.get("/metrics").text
        for member in range(4):
            memory_stack.double.script(ScriptedCompletion(tokens(memory_stack.model, "Ok", END)))
            client = memory_stack.openai(f"group-{member}")
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": body}])
        after = http.get("/metrics").text
    prompts = memory_stack.prompts()[-4:]
    assert all(prompt == prompts[0] for prompt in prompts)
    with unshared(memory_stack.model.tokenizer):
        fresh = memory_stack.model.render_prompt([Message(role="user", content=body)], [])
    assert prompts[0] == fresh
    hits = _metric(after, "tokenkeep_shared_tokens_hits_total")
    assert hits - _metric(before, "tokenkeep_shared_tokens_hits_total") >= 3
    assert _metric(after, "tokenkeep_shared_tokens_bytes") > 0
