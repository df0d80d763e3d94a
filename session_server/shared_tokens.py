"""Long texts tokenized once per process: the token ids of a text many rollouts send (a GRPO
group's G copies of one first message, `n > 1`, one system prompt and tool list across a
whole run) are kept, bounded in bytes, and handed to every later request for the same text.

The cache lives on one tokenizer (`tokenizer.FastTokenizer`), so its key is the text alone
(and `add_special_tokens`): the tokenizer, and so the vocabulary, is the one that made every
entry. It caches tokenization, not rendering: a template renders the conversation as it
always does and only the tokenization of its text is shared, so a hit gives exactly the ids
a fresh `encode` gives. Where a text is cut into pieces before it is looked up
(`special_cuts`), each cut is at a special token the Rust tokenizer itself splits the text
at before it normalizes or pre-tokenizes anything, so the pieces' ids joined are the whole
text's ids.
"""

from __future__ import annotations

import re
import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DEFAULT_BUDGET_BYTES = 256 << 20
"""`--shared-tokens-bytes`' default: ~800 distinct 32k-token texts (their ids as 4-byte
integers plus the text itself, the key)."""

SHARED_MIN_CHARS = 2_048
"""Texts (and pieces) shorter than this are tokenized each time: their tokenization costs
less than a millisecond, and keeping them would fill the cache with one-off harness text."""

# Normalizers and pre-tokenizers the Rust tokenizer applies to each split on its own (the
# pieces between special tokens), so a piece tokenized alone is tokenized as it is inside the
# whole text. Metaspace is among them only where it prepends to every split (`always`) or to
# none (`never`): with `first` it prepends to the text's first split only.
_PER_SPLIT = frozenset(
    {
        "NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Replace", "Prepend", "Strip",
        "StripAccents", "Nmt", "ByteLevel", "Split", "Digits", "Punctuation", "Whitespace",
        "WhitespaceSplit", "UnicodeScripts", "BertPreTokenizer", "Sequence",
    }
)  # fmt: skip


def _per_split(component: dict[str, Any] | None) -> bool:
    if component is None:
        return True
    kind = component.get("type")
    if kind == "Metaspace":
        return component.get("prepend_scheme") in {"always", "never"}
    if kind not in _PER_SPLIT:
        return False
    parts = component.get("normalizers") or component.get("pretokenizers") or []
    return all(_per_split(part) for part in parts)


@dataclass(frozen=True)
class Cuts:
    """Where a text can be cut into pieces that tokenize alone as they do inside it: at the
    added tokens `clean`, found with `pattern`, which matches every unnormalized added token
    the way the Rust tokenizer matches them (leftmost, longest first) so that a cut is never
    taken inside a longer one."""

    pattern: re.Pattern[str]
    clean: frozenset[str]

    def pieces(self, text: str) -> list[tuple[str, bool]]:
        """`text` as consecutive pieces, each with whether it is worth sharing: the long
        runs between cut tokens stand alone, everything else (short runs and the cut tokens
        themselves) is joined into the pieces between them."""
        out: list[tuple[str, bool]] = []
        start = 0  # where the current run of short text starts
        run_from = 0  # where the text after the last cut starts
        for match in self.pattern.finditer(text):
            if match.group() not in self.clean:
                continue
            if match.start() - run_from >= SHARED_MIN_CHARS:
                if run_from > start:
                    out.append((text[start:run_from], False))
                out.append((text[run_from : match.start()], True))
                start = match.start()
            run_from = match.end()
        if len(text) - run_from >= SHARED_MIN_CHARS:
            if run_from > start:
                out.append((text[start:run_from], False))
            out.append((text[run_from:], True))
        elif len(text) > start:
            out.append((text[start:], False))
        return out


def special_cuts(tokenizer_json: dict[str, Any]) -> Cuts | None:
    """Where texts of this tokenizer (its tokenizer.json) can be cut, or None where cutting
    would not be exact. A cut needs an added token the tokenizer splits the text at before
    normalizing (`normalized: false`) that takes no whitespace from its neighbours (`lstrip`,
    `rstrip`) and needs no word boundary (`single_word`), and a normalizer and pre-tokenizer
    that work on each split alone."""
    if tokenizer_json.get("truncation") or tokenizer_json.get("padding"):
        return None
    if not (
        _per_split(tokenizer_json.get("normalizer"))
        and _per_split(tokenizer_json.get("pre_tokenizer"))
    ):
        return None
    added = [t for t in tokenizer_json.get("added_tokens", []) if not t.get("normalized")]
    if not added or any(t.get("single_word") for t in added):
        return None
    contents = sorted({t["content"] for t in added}, key=len, reverse=True)
    return Cuts(
        re.compile("|".join(re.escape(c) for c in contents)),
        frozenset(t["content"] for t in added if not (t.get("lstrip") or t.get("rstrip"))),
    )


@dataclass
class _Flight:
    """One tokenization in progress: later callers for the same text wait for it."""

    done: threading.Event
    ids: array[int] | None = None


class SharedTokens:
    """Token ids of long texts, least recently used first out, bounded in bytes (the ids as
    4-byte integers and the text they are kept under). One tokenization per text at a time:
    callers that ask for a text being tokenized wait for that tokenization (rendering runs in
    worker threads, so the waiting is a thread's, never the event loop's)."""

    def __init__(self, encode: Callable[[str, bool], list[int]], budget_bytes: int) -> None:
        self._encode = encode
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[tuple[str, bool], array[int]] = OrderedDict()
        self._flights: dict[tuple[str, bool], _Flight] = {}
        self._lock = threading.Lock()
        self.bytes_held = 0
        self.hits = 0
        self.misses = 0

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        key = (text, add_special_tokens)
        with self._lock:
            ids = self._entries.get(key)
            if ids is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return ids.tolist()
            flight = self._flights.get(key)
            leader = flight is None
            if flight is None:
                flight = self._flights[key] = _Flight(threading.Event())
                self.misses += 1
            else:
                self.hits += 1
        if not leader:
            flight.done.wait()
            if flight.ids is not None:
                return flight.ids.tolist()
            return self._encode(text, add_special_tokens)  # the leader failed: try alone
        try:
            fresh = self._encode(text, add_special_tokens)
            flight.ids = array("i", fresh)
        finally:
            with self._lock:
                del self._flights[key]
                if flight.ids is not None:
                    self._keep(key, flight.ids)
            flight.done.set()
        return fresh

    def _keep(self, key: tuple[str, bool], ids: array[int]) -> None:
        size = _size(key[0], ids)
        if size > self.budget_bytes:
            return
        self._entries[key] = ids
        self.bytes_held += size
        while self.bytes_held > self.budget_bytes:
            (text, _), dropped = self._entries.popitem(last=False)
            self.bytes_held -= _size(text, dropped)


def _size(text: str, ids: array[int]) -> int:
    return sys.getsizeof(text) + ids.itemsize * len(ids)
