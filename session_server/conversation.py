"""The internal conversation every API front-end translates into, and its fingerprints.

Front-ends (Chat Completions, Responses, Messages) parse their wire format into a
`Conversation`; the session core never sees wire formats. Fingerprints decide whether a
request continues a stored turn: they keep what changes the model's view of the history
(roles, text, tool names and arguments) and drop what harnesses rewrite without meaning to
(surrounding whitespace, `None` vs `""` content, JSON spacing and key order, reasoning that
templates strip from earlier turns, tool-call ids that harnesses regenerate).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

import orjson
import re2

if TYPE_CHECKING:
    from session_server.images import ImageInput

Role = Literal["system", "user", "assistant", "tool"]
IMAGE_MARK = "\ufffc"

MAX_JSON_DEPTH = 128
"""Deepest nesting accepted in JSON the server takes apart (tool-call arguments, session
metadata): far past any tool's schema, far short of Python's recursion limit, which parsing,
fingerprinting, the chat template and serialising each recurse into (a few thousand levels
were a RecursionError, a 500)."""
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACKETS = re.compile(r"[\[\]{}]")
"""Where an image sits in a message's text (U+FFFC OBJECT REPLACEMENT CHARACTER): the i-th
mark is `Message.images[i]`. Front-ends refuse client text that contains it."""
ROLES: frozenset[str] = frozenset({"system", "user", "assistant", "tool"})


@dataclass(slots=True, frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str
    """The arguments as JSON text, exactly as the client sent them or as sampled."""


@dataclass(slots=True)
class Message:
    role: Role
    content: str = ""
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str | None = None
    name: str | None = None
    prompt_token_ids: list[int] | None = None
    """Token-aware clients: the prompt this assistant message was sampled from."""
    generation_token_ids: list[int] | None = None
    """Token-aware clients: the tokens sampled for this assistant message."""
    images: list[ImageInput] = field(default_factory=list)
    """The images of a user or tool message, in order (one `IMAGE_MARK` each in `content`)."""


@dataclass(slots=True, frozen=True)
class Tool:
    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)

    def as_openai(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }


@dataclass(slots=True)
class Conversation:
    """One request, as the session core sees it, whatever API it came through."""

    messages: list[Message]
    tools: list[Tool] = field(default_factory=list)
    tool_choice: str | dict[str, Any] | None = None
    """"auto" | "none" | "required" | {"name": ...} (a forced function)."""
    sampling: dict[str, Any] = field(default_factory=dict)
    """Sampling parameters the harness set explicitly, under vLLM's names
    (temperature, top_p, top_k, min_p, max_tokens, seed, stop, presence_penalty, ...)."""
    n: int = 1
    logprobs: bool = False
    response_format: dict[str, Any] | None = None
    """vLLM structured-output constraint (`{"json": schema}`, `{"regex": ...}`...)."""
    stream: bool = False
    api: str = "chat"
    model: str | None = None
    required_prefix_token_ids: list[int] | None = None
    """Token-aware clients: the exact token prefix the prompt must start with."""
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    """vLLM's `chat_template_kwargs`: variables the chat template renders with
    (`enable_thinking`); the planner lays them over the session's default, key by key."""
    thinking: bool | None = None
    """Anthropic Messages' `thinking` (enabled: True, disabled: False): the template's
    `enable_thinking` where it reads one and neither the session nor request set it."""
    reasoning_ended: bool | None = None
    """vLLM: structured outputs apply from the first token even under a reasoning parser
    (otherwise only after the reasoning block closes)."""
    previous_response_id: str | None = None
    """Responses API: `messages` are only the new items after that response's turn."""
    return_token_ids: bool | None = None
    """The request's own choice of token IDs in the reply (None: the session's, then the
    API's default)."""
    idempotency: Idempotency | None = None
    """The request's `Idempotency-Key` and a fingerprint of its body (None: no key)."""
    arrived: float | None = None
    """Unix time the server received the request, before it waited for an admission slot
    (None: when the turn starts): an abort of the session recorded since then cuts it."""


@dataclass(slots=True, frozen=True)
class Idempotency:
    key: str
    """The `Idempotency-Key` header (1-255 bytes), scoped to the session."""
    fingerprint: str
    """SHA-256 of the request body: the same key with another body is refused."""


class ConversationError(ValueError):
    """A request the core cannot accept (maps to HTTP `status`, 400, in every front-end)."""

    status = 400

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def validate(conversation: Conversation) -> None:
    if not conversation.messages:
        raise ConversationError("messages must not be empty", param="messages")
    for i, message in enumerate(conversation.messages):
        if message.role not in ROLES:
            raise ConversationError(f"unknown role {message.role!r}", param=f"messages[{i}]")
        for j, call in enumerate(message.tool_calls):
            if too_deep(call.arguments):
                raise ConversationError(
                    f"tool call arguments nest deeper than {MAX_JSON_DEPTH} levels",
                    param=f"messages[{i}].tool_calls[{j}].arguments",
                )
    if conversation.n < 1 or conversation.n > 128:
        raise ConversationError("n must be between 1 and 128", param="n")


# --- canonical forms -------------------------------------------------------------------


def canonical_text(text: str | None, rules: list[Rule] | None = None) -> str:
    """Text as the fingerprint sees it: volatile parts removed, line endings unified,
    surrounding whitespace dropped (templates `| trim` it and harnesses strip it)."""
    if not text:
        return ""
    if rules:
        for rule in rules:
            text = rule.sub("", text, count=MAX_RULE_MATCHES)
    return text.replace("\r\n", "\n").strip()


def _normalise_json_value(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    if isinstance(value, dict):
        return {str(k): _normalise_json_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_normalise_json_value(v) for v in value]
    return value


def too_deep(value: Any) -> bool:
    """Whether `value` (JSON text or a parsed value) nests deeper than `MAX_JSON_DEPTH`,
    found without recursing (that is what would fail)."""
    if isinstance(value, str):
        if value.count("{") + value.count("[") <= MAX_JSON_DEPTH:
            return False  # fewer openers than the bound: no scan (nearly every call)
        depth = 0
        for bracket in _BRACKETS.findall(_JSON_STRING.sub("", value)):
            depth += 1 if bracket in "[{" else -1
            if depth > MAX_JSON_DEPTH:
                return True
        return False
    pending: list[tuple[Any, int]] = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, dict | list):
            if depth > MAX_JSON_DEPTH:
                return True
            children = item.values() if isinstance(item, dict) else item
            pending.extend((child, depth + 1) for child in children)
    return False


def parse_arguments(arguments: str | dict[str, Any] | None) -> Any:
    """Tool-call arguments as a value: JSON first, then a Python literal (harnesses that
    round-trip arguments through `str(dict)` send `{'a': False}`), else the raw text."""
    if arguments is None:
        return {}
    if not isinstance(arguments, str):
        return _normalise_json_value(arguments)
    text = arguments.strip()
    if not text:
        return {}
    if too_deep(text):  # a model's runaway output: kept as text, never parsed
        return text
    try:
        return _normalise_json_value(json.loads(text))
    except ValueError:
        pass
    try:
        return _normalise_json_value(ast.literal_eval(text))
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return text


class Memo:
    """A least-recently-used memo bounded by the bytes it holds, keyed by a digest of what
    was asked (16 bytes however long that was): keyed by the text itself, as
    `functools.lru_cache` is, a memo of N entries could hold N request bodies. A value over
    `max_entry_bytes` is not kept. Thread-safe (conversions run in worker threads)."""

    def __init__(self, max_bytes: int, max_entry_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.max_entry_bytes = max_entry_bytes
        self.bytes = 0
        self._entries: OrderedDict[bytes, tuple[Any, int]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: bytes) -> Any:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry[0]

    def put(self, key: bytes, value: Any, size: int) -> None:
        size += len(key) + _ENTRY_OVERHEAD
        if size > self.max_entry_bytes:
            return
        with self._lock:
            if key in self._entries:
                return
            self._entries[key] = (value, size)
            self.bytes += size
            while self.bytes > self.max_bytes:
                self.bytes -= self._entries.popitem(last=False)[1][1]


_ENTRY_OVERHEAD = 120
"""Bytes a memo entry costs beyond its key and value (dict slot, tuple, bytes headers)."""


def digest_of(*texts: str) -> bytes:
    """A memo key for these texts: each length-prefixed, so no two sequences share one."""
    h = hashlib.blake2b(digest_size=16)
    for text in texts:
        data = text.encode("utf-8", "surrogatepass")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.digest()


# Every request resends every earlier tool call: a long session would otherwise parse and
# re-serialise the same arguments once per message per turn. Arguments past 64 KiB (a file a
# tool writes) are parsed again each time rather than kept.
_ARGUMENTS = Memo(max_bytes=32 << 20, max_entry_bytes=64 << 10)


def canonical_arguments(arguments: str | dict[str, Any] | None) -> str:
    if not isinstance(arguments, str):
        return _canonical(parse_arguments(arguments))
    key = digest_of(arguments)
    canonical: str | None = _ARGUMENTS.get(key)
    if canonical is None:
        canonical = _canonical(parse_arguments(arguments))
        _ARGUMENTS.put(key, canonical, len(canonical))
    return canonical


def _canonical(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def message_fingerprint(message: Message, rules: list[Rule] | None = None) -> bytes:
    """What must be equal for two messages to be the same turn of history."""
    parts: list[str] = [message.role, canonical_text(message.content, rules)]
    # An image is its bytes' hash: the same screenshot resent continues the session.
    parts.extend(image.sha256 for image in message.images)
    if message.role == "assistant":
        # Reasoning is ignored: templates drop it from earlier turns, and the stored tokens
        # hold what was really sampled anyway.
        for call in message.tool_calls:
            parts.append(call.name)
            parts.append(canonical_arguments(call.arguments))
    return "\x1f".join(parts).encode("utf-8", "surrogatepass")


def tools_fingerprint(tools: list[Tool]) -> bytes:
    canonical = sorted(
        json.dumps(
            {"n": t.name, "d": t.description.strip(), "p": _normalise_json_value(t.parameters)},
            sort_keys=True,
            separators=(",", ":"),
            ensure_ascii=False,
        )
        for t in tools
    )
    return "\x1e".join(canonical).encode("utf-8", "surrogatepass")


# 64k messages' digests in ~10 MiB.
_DIGESTS = Memo(max_bytes=10 << 20, max_entry_bytes=1 << 10)


def message_digest(message: Message, rules: list[Rule] | None = None) -> bytes:
    """A short hash of the message's fingerprint. Memoised (without rules): every request
    resends the whole history, so a long session would otherwise canonicalise and hash the
    same tool outputs once per message per turn."""
    if rules or message.images:
        return _hash(message_fingerprint(message, rules))
    key = digest_of(
        message.role,
        message.content or "",
        *(text for c in message.tool_calls for text in (c.name, c.arguments)),
    )
    digest: bytes | None = _DIGESTS.get(key)
    if digest is None:
        digest = _hash(message_fingerprint(message))
        _DIGESTS.put(key, digest, len(digest))
    return digest


def _hash(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def _chain(previous: bytes, digest: bytes) -> bytes:
    return hashlib.blake2b(previous + digest, digest_size=12).digest()


@dataclass(slots=True)
class Lineage:
    """Running hashes over a request's messages: `keys[j]` names messages[0..j]."""

    keys: list[str]
    """One key per message, for messages[0..j] inclusive."""
    assistant_positions: list[int]
    """Indices j where messages[j] is an assistant message (where a stored turn can end)."""
    _last: bytes
    _rules: list[Rule] | None = None

    @property
    def input_key(self) -> str:
        return "i:" + self._last.hex()

    def reply_key(self, reply: Message) -> str:
        """The key of this conversation continued by `reply`."""
        return "r:" + _chain(self._last, message_digest(reply, self._rules)).hex()

    def reply_keys_for_lookup(self) -> list[str]:
        """Keys of every prefix that ends at an assistant message, shallowest first."""
        return ["r:" + self.keys[j] for j in self.assistant_positions]


def lineage(
    conversation: Conversation,
    rules: list[Rule] | None = None,
    *,
    after: str | None = None,
) -> Lineage:
    """O(messages): one hash per message. `after` (a stored turn's reply key) continues the
    chain from that turn, for requests that send only the messages after it."""
    if after is not None:
        state = bytes.fromhex(after.removeprefix("r:"))
    else:
        state = hashlib.blake2b(tools_fingerprint(conversation.tools), digest_size=12).digest()
    keys: list[str] = []
    assistant_positions: list[int] = []
    for j, message in enumerate(conversation.messages):
        state = _chain(state, message_digest(message, rules))
        keys.append(state.hex())
        if message.role == "assistant":
            assistant_positions.append(j)
    return Lineage(keys=keys, assistant_positions=assistant_positions, _last=state, _rules=rules)


MAX_RULES = 16
MAX_RULE_PATTERN_CHARS = 512
MAX_RULE_MATCHES = 8
"""Matches one rule removes from one message text; the rest of that text is compared as is."""
NORMALIZATION_BUDGET = 16 << 20
"""Worst-case characters the rules of one request may scan (see `check_normalization_cost`)."""
_RE2_MAX_MEM = 1 << 20
"""Memory for one compiled rule: refuses patterns whose automaton would be huge."""


class Rule(Protocol):
    """A compiled normalisation rule (an RE2 regular expression)."""

    def sub(self, repl: str, text: str, count: int = 0) -> str: ...

    def finditer(self, text: str) -> Iterator[Any]: ...


def compile_rules(rules: list[dict[str, Any]]) -> list[Rule]:
    """Session normalisation rules (`{"pattern": regex}`) to compiled patterns.

    Rules come from clients, so they run on RE2: matching is linear in the text (no
    backtracking: `(a+)+$` costs what `a+$` costs), and RE2 refuses what it cannot do in
    linear time (backreferences, lookaround). Searching again after each match is what can
    still be slow, hence `MAX_RULE_MATCHES` and `check_normalization_cost`."""
    if len(rules) > MAX_RULES:
        raise ConversationError(f"at most {MAX_RULES} normalization rules", param="normalization")
    compiled: list[Rule] = []
    for i, rule in enumerate(rules):
        pattern = rule.get("pattern") if isinstance(rule, dict) else None
        if not isinstance(pattern, str):
            raise ConversationError("normalization rules need a 'pattern' string", param=str(i))
        if len(pattern) > MAX_RULE_PATTERN_CHARS:
            raise ConversationError(
                f"normalization patterns are at most {MAX_RULE_PATTERN_CHARS} characters",
                param=str(i),
            )
        try:
            compiled.append(_compile_rule(pattern))
        except re2.error as exc:
            reason = exc.args[0].decode() if exc.args and isinstance(exc.args[0], bytes) else exc
            raise ConversationError(
                f"bad normalization pattern (RE2 syntax, no backreferences or lookaround): "
                f"{reason}",
                param=str(i),
            ) from exc
    return compiled


@functools.lru_cache(maxsize=1024)
def _compile_rule(pattern: str) -> Rule:
    options = re2.Options()
    options.log_errors = False
    options.max_mem = _RE2_MAX_MEM
    return re2.compile("(?m)" + pattern, options)  # type: ignore[no-any-return]


def check_normalization_cost(conversation: Conversation, rules: list[Rule]) -> None:
    """Refuse a request whose rules could scan more than `NORMALIZATION_BUDGET` characters:
    each rule searches each message text at most `MAX_RULE_MATCHES + 1` times, each search
    linear in the text. Bounds the time one request spends normalising on the event loop."""
    chars = sum(len(m.content or "") for m in conversation.messages)
    worst = chars * len(rules) * (MAX_RULE_MATCHES + 1)
    if worst > NORMALIZATION_BUDGET:
        raise ConversationError(
            f"this session's {len(rules)} normalization rule(s) cannot be applied to "
            f"{chars} characters of messages: at most "
            f"{NORMALIZATION_BUDGET // (len(rules) * (MAX_RULE_MATCHES + 1))} characters "
            f"with {len(rules)} rule(s)",
            param="messages",
        )


def text_chars(conversation: Conversation) -> int:
    """Characters of text in a request that would be tokenized (an upper bound). Tool
    definitions count too: every template writes them into the prompt (their schemas as
    JSON), so megabytes of tools would otherwise be rendered and tokenized before the
    context refused them."""
    return sum(
        len(m.content or "")
        + len(m.reasoning or "")
        + sum(len(c.arguments) + len(c.name) for c in m.tool_calls)
        for m in conversation.messages
    ) + sum(
        len(t.name) + len(t.description) + len(orjson.dumps(t.parameters).decode())
        for t in conversation.tools
    )
