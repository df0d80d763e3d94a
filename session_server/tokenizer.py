"""Loading the served model's tokenizer (with its chat template) from a path or an id.

`FastTokenizer` puts the Rust `tokenizers` backend on the hot path. The renderers call
`encode` / `decode` for every message they bridge, and the Hugging Face Python wrapper costs
several milliseconds per call on top of the Rust encoder (batch plumbing, and character
offsets the renderers then use for content attribution that tokenkeep never reads). Chat
templates still go through the Hugging Face tokenizer, which owns them.
"""

from __future__ import annotations

import json
import os
from typing import Any

from session_server.shared_tokens import (
    DEFAULT_BUDGET_BYTES,
    SHARED_MIN_CHARS,
    SharedTokens,
    special_cuts,
)

# The Rust backend's batch encodes release the GIL while they work: a long text (a first
# turn's big message) tokenized in a worker thread then leaves the event loop free.
# `encode_batch_fast` skips the character offsets tokenkeep never reads (~15-20% less CPU
# than `encode_batch` on a 32k-token message, same ids). Short texts keep `encode`, which
# costs less per call.
GIL_FREE_CHARS = 8_192
# The renderers encode the same few short strings every turn (role headers, "\n", reasoning
# markers) and decode single tokens to test for whitespace: each is a call into the Rust
# backend (~20 us here) for an answer that never changes. Texts up to this length are
# remembered, up to MEMO_ENTRIES of them (a fixed bound: harness text is not kept forever).
MEMO_CHARS = 64
MEMO_ENTRIES = 4_096


class FastTokenizer:
    """The renderers' `Tokenizer` protocol over the Rust backend of a HF fast tokenizer.

    Deliberately not an `OffsetTokenizer` (no `__call__`): without offsets, renderers skip
    per-token content attribution, which tokenkeep does not use."""

    def __init__(self, hf_tokenizer: Any, shared_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        self.hf = hf_tokenizer
        self._backend = hf_tokenizer.backend_tokenizer
        self.shared = SharedTokens(self._encode_long, shared_bytes) if shared_bytes else None
        """Long texts' ids, tokenized once (None: --shared-tokens-bytes 0)."""
        self._cuts = special_cuts(json.loads(self._backend.to_str())) if self.shared else None
        self.name_or_path: str = hf_tokenizer.name_or_path
        self.unk_token_id: int | None = hf_tokenizer.unk_token_id
        self.eos_token_id: int | None = hf_tokenizer.eos_token_id
        self.chat_template: str | None = getattr(hf_tokenizer, "chat_template", None)
        self.model_max_length: int = hf_tokenizer.model_max_length
        self.all_special_ids: list[int] = list(hf_tokenizer.all_special_ids)
        self.added_tokens_decoder = hf_tokenizer.added_tokens_decoder
        self._vocab: dict[str, int] = hf_tokenizer.get_vocab()
        self.special_token_ids: frozenset[int] = frozenset(self.all_special_ids) | {
            token_id
            for token_id, token in self.added_tokens_decoder.items()
            if getattr(token, "special", False)
        }
        self._pieces: dict[int, str] = {}
        self._short: dict[tuple[str, bool], tuple[int, ...]] = {}

    def encode(
        self, text: str, *args: Any, add_special_tokens: bool = False, **kwargs: Any
    ) -> list[int]:
        if len(text) <= MEMO_CHARS:
            key = (text, add_special_tokens)
            ids = self._short.get(key)
            if ids is None:
                ids = tuple(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)
                if len(self._short) < MEMO_ENTRIES:
                    self._short[key] = ids
            return list(ids)  # the caller's own list: renderers extend and slice them
        if self.shared is None or len(text) < SHARED_MIN_CHARS:
            return self._encode_long(text, add_special_tokens)
        if add_special_tokens or self._cuts is None:
            # Special tokens are added around the whole text: it is shared whole.
            return self.shared.encode(text, add_special_tokens)
        ids: list[int] = []
        for piece, share in self._cuts.pieces(text):
            ids += self.shared.encode(piece, False) if share else self._encode_long(piece, False)
        return ids

    def _encode_long(self, text: str, add_special_tokens: bool) -> list[int]:
        if len(text) > GIL_FREE_CHARS:
            encoded = self._backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)
            return encoded[0].ids
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(
        self, token_ids: Any, *args: Any, skip_special_tokens: bool = False, **kwargs: Any
    ) -> str:
        ids = list(token_ids)
        if len(ids) == 1 and not skip_special_tokens:
            return self.pieces(ids)[0]
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def pieces(self, token_ids: list[int]) -> list[str]:
        """Each token decoded on its own (what a viewer shows at each position). A token that
        holds part of a multi-byte character decodes to U+FFFD on its own."""
        memo = self._pieces
        missing = list({t for t in token_ids if t not in memo})
        if missing:
            decoded = self._backend.decode_batch([[t] for t in missing], skip_special_tokens=False)
            memo.update(zip(missing, decoded, strict=True))
        return [memo[t] for t in token_ids]

    def convert_tokens_to_ids(self, tokens: Any) -> Any:
        if isinstance(tokens, str):
            return self._vocab.get(tokens, self.unk_token_id)
        return [self._vocab.get(t, self.unk_token_id) for t in tokens]

    def convert_ids_to_tokens(self, ids: Any) -> Any:
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        return [self._backend.id_to_token(i) for i in ids]

    def get_vocab(self) -> dict[str, int]:
        return self._vocab

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        return self.hf.apply_chat_template(*args, **kwargs)

    def __len__(self) -> int:
        return len(self.hf)


def load_tokenizer(
    path_or_id: str, shared_bytes: int = DEFAULT_BUDGET_BYTES, *, revision: str | None = None
) -> FastTokenizer:
    if not path_or_id:
        raise ValueError("--tokenizer is required (a local directory or a Hugging Face id)")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(path_or_id, revision=revision)
    if not getattr(hf, "is_fast", False):
        raise ValueError(f"{path_or_id}: tokenkeep needs a fast (tokenizer.json) tokenizer")
    return FastTokenizer(hf, shared_bytes)
