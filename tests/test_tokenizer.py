"""FastTokenizer: the renderers' tokenizer over the Rust backend, with its short-text memo.

The memo must be invisible: every answer equals the backend's, a caller that mutates what it
got back cannot change a later answer, and the memo stays bounded whatever text arrives."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from session_server import tokenizer as tokenizer_module
from session_server.tokenizer import MEMO_CHARS, FastTokenizer, load_tokenizer
from tests.real_tokenizers import qwen3_dir


@pytest.fixture(scope="module")
def qwen3() -> FastTokenizer:
    return load_tokenizer(str(qwen3_dir()))


@pytest.fixture(scope="module")
def backend() -> Tokenizer:
    return Tokenizer.from_file(str(qwen3_dir() / "tokenizer.json"))


SHORT = ["<|im_start|>assistant\n", "\n", "user\n", "<think>", "héllo wörld", " ", "x" * MEMO_CHARS]


@pytest.mark.parametrize("text", SHORT)
@pytest.mark.parametrize("special", [False, True])
def test_short_texts_encode_as_the_backend_does_every_time(
    qwen3: FastTokenizer, backend: Tokenizer, text: str, special: bool
) -> None:
    expected = backend.encode(text, add_special_tokens=special).ids
    assert qwen3.encode(text, add_special_tokens=special) == expected
    assert qwen3.encode(text, add_special_tokens=special) == expected  # from the memo


def test_a_caller_mutating_its_ids_does_not_change_the_next_answer(qwen3: FastTokenizer) -> None:
    first = qwen3.encode("<|im_start|>user\n")
    expected = list(first)
    first.append(0)
    first[0] = -1
    assert qwen3.encode("<|im_start|>user\n") == expected


def test_long_texts_are_not_remembered(qwen3: FastTokenizer, backend: Tokenizer) -> None:
    text = "a long tool output line " * 20
    assert len(text) > MEMO_CHARS
    assert qwen3.encode(text) == backend.encode(text, add_special_tokens=False).ids
    assert (text, False) not in qwen3._short


def test_the_memo_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokenizer_module, "MEMO_ENTRIES", 8)
    fresh = load_tokenizer(str(qwen3_dir()))
    answers = {f"word{i}": fresh.encode(f"word{i}") for i in range(50)}
    assert len(fresh._short) == 8
    for text, ids in answers.items():  # past the bound: still right, just not kept
        assert fresh.encode(text) == ids


def test_single_token_decode_equals_the_backend_including_partial_characters(
    qwen3: FastTokenizer, backend: Tokenizer
) -> None:
    ids = backend.encode("é ✓ 😀 <|im_end|>", add_special_tokens=False).ids
    # A byte-level token of a multi-byte character decodes to U+FFFD on its own.
    for token in [*ids, *range(100, 140)]:
        assert qwen3.decode([token]) == backend.decode([token], skip_special_tokens=False)
        assert qwen3.decode([token], skip_special_tokens=True) == backend.decode(
            [token], skip_special_tokens=True
        )
    assert qwen3.decode(ids) == backend.decode(ids, skip_special_tokens=False)
