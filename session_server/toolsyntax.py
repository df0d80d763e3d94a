"""A family's tool-call syntax, learned from its own chat template.

Where no `renderers` renderer reads a template's tool calls (DeepSeek V3.1/V3.2 and R1
distills, MiniMax M1/M3, functionary, Mistral, ...), the generic path learns how the
template writes one: it renders assistant messages with probe calls (one call, two calls,
content then a call, two parameters) and reads the literal text around the call's name and
arguments. The result parses sampled replies (`LearnedToolParser`, plugged into the generic
renderer), tells the streamer which text may open a call, and builds the `tool_choice`
constraint in the same syntax.

Two argument styles are learned: JSON arguments (`<｜tool▁sep｜>{...}`, `{"name": ..,
"arguments": {...}}`, `[ARGS]{...}`) and one element per parameter
(`<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>`, `<city>Paris</city>`).
A learned syntax is only used once it parses the template's own probe replies back.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from renderers import ToolCallParseStatus
from renderers.base import ParsedToolCall

# Probe calls; ids are 9 alphanumerics (what Mistral templates require).
_ID1, _ID2 = "a1B2c3D4e", "f5G6h7J8k"
_CONTENT = "TKCONTENTTK"
_ID = "\x00ID\x00"
_KEY = "\x00KEY\x00"
LEARNING_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": "Probe.",
            "parameters": {
                "type": "object",
                "properties": {key: {"type": kind} for key, kind in props},
            },
        },
    }
    for name, props in (
        ("get_weather", (("city", "string"), ("days", "integer"))),
        ("get_time", (("zone", "string"),)),
    )
]
_NAME = r"([A-Za-z_][\w.\-]*)"
_PARAM_KEY = r"([A-Za-z_][\w.\-]*)"
_ID_RE = r"([A-Za-z0-9_\-]{1,64})"

Render = Callable[[list[dict[str, Any]], bool], "str | None"]
"""(messages, add_generation_prompt) -> the template's text, or None where it refuses."""


def _call(name: str, arguments: dict[str, Any], call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


@functools.lru_cache(maxsize=256)
def _lit(text: str) -> str:
    """A literal as a regex: whitespace runs match any whitespace; probe ids and keys are
    wildcards."""
    out: list[str] = []
    for piece in re.split(r"(\s+|\x00ID\x00|\x00KEY\x00)", text):
        if not piece:
            continue
        if piece == _ID:
            out.append(_ID_RE)
        elif piece == _KEY:
            out.append(_KEY)  # the parameter's own name, filled in per parameter
        elif piece.isspace():
            out.append(r"\s*")
        else:
            out.append(re.escape(piece))
    return "".join(out)


def _squash(text: str) -> str:
    return re.sub(r"\s+", "", text)


@dataclass(frozen=True, slots=True)
class ParamStyle:
    """One element per parameter: `p_next KEY glue VALUE p_close`."""

    p_next: str
    glue_head: str
    glue_tail: str
    flags: tuple[str, str] | None
    """(string, other) values of the attribute that differs between a string and a
    non-string parameter (DSML's `string="true"`); None where none does."""
    p_close: str


@dataclass(frozen=True, slots=True)
class ToolSyntax:
    """Literal text around a call, as the template writes it (`\\x00ID\\x00` where it
    writes the call id)."""

    opener: str
    """Between a reply's content and its first call's name."""
    start_opener: str | None
    """Where a reply with no content opens a call unlike `opener` (functionary v3.2 writes
    the name first): that literal, anchored at the reply's start."""
    name_sep: str
    mid: str | None
    """After a call up to the next call's name (None: one call per reply)."""
    close: str
    """After the last call."""
    params: ParamStyle | None = None
    """None: the arguments are one JSON object."""
    lead: str = ""
    """How a reply that is only a call starts, up to the name."""

    def describe(self) -> str:
        style = "per-parameter elements" if self.params else "JSON arguments"
        opener = self.opener.strip() or self.start_opener or ""
        return f"{json.dumps(opener, ensure_ascii=False)} ... ({style})"

    # --- parsing ------------------------------------------------------------------------

    def parse(self, text: str) -> tuple[str, list[ParsedToolCall]] | None:
        """(content, calls) where `text` holds calls in this syntax; else None."""
        if self.start_opener is not None:
            match = re.compile(r"\s*" + _lit(self.start_opener)).match(text)
            if match is not None:
                calls = self._calls(text, match.end(), match)
                if calls is not None:
                    return "", calls
        for match in re.finditer(_lit(self.opener), text) if self.opener.strip() else ():
            calls = self._calls(text, match.end(), match)
            if calls is not None:
                return text[: match.start()], calls
        return None

    def _calls(self, text: str, pos: int, opened: re.Match[str]) -> list[ParsedToolCall] | None:
        calls: list[ParsedToolCall] = []
        pending_id = _first_group(opened)
        while True:
            name = re.compile(_NAME + _lit(self.name_sep)).match(text, pos)
            if name is None:
                return None
            start = pos
            pending_id = pending_id or _first_group(name, 1)
            read = self._arguments(text, name.end())
            if read is None:
                return None
            arguments, pos = read
            call = ParsedToolCall(
                raw=text[start:pos],
                name=name.group(1),
                arguments=arguments,
                status=ToolCallParseStatus.OK,
                id=pending_id,
            )
            calls.append(call)
            pending_id = None
            following = re.compile(_lit(self.mid)).match(text, pos) if self.mid else None
            if following is not None and re.compile(_NAME).match(text, following.end()):
                call.id = call.id or _first_group(following)
                pos = following.end()
                continue
            rest = text[pos:]
            ended = re.compile(_lit(self.close)).match(rest)
            if ended is not None:
                call.id = call.id or _first_group(ended)
                rest = rest[ended.end() :]
            elif not _squash(self.close).startswith(_squash(rest)):
                return None  # not a whole call: the text stays text
            else:
                rest = ""
            if rest.strip():
                return None
            return calls

    def _arguments(self, text: str, pos: int) -> tuple[str, int] | None:
        """The arguments (JSON text) and where they end."""
        if self.params is None:
            while pos < len(text) and text[pos].isspace():
                pos += 1
            try:
                value, end = json.JSONDecoder().raw_decode(text, pos)
            except ValueError:
                return None
            return (text[pos:end], end) if isinstance(value, dict) else None
        style = self.params
        values: dict[str, Any] = {}
        head = re.compile(_lit(style.p_next) + _PARAM_KEY + _lit(style.glue_head))
        while True:
            key = head.match(text, pos)
            if key is None:
                break
            pos = key.end()
            flag = None
            if style.flags is not None:
                found = re.compile(r"([^\s\"'<>]*)" + _lit(style.glue_tail)).match(text, pos)
                if found is None:
                    return None
                flag, pos = found.group(1), found.end()
            elif style.glue_tail:
                found = re.compile(_lit(style.glue_tail)).match(text, pos)
                if found is None:
                    return None
                pos = found.end()
            closing = re.compile(_lit(style.p_close).replace(_KEY, re.escape(key.group(1))))
            end = closing.search(text, pos)
            if end is None:
                return None
            values[key.group(1)] = _param_value(text[pos : end.start()], flag, style.flags)
            pos = end.end()
        return json.dumps(values, ensure_ascii=False), pos

    # --- streaming ----------------------------------------------------------------------

    def hold_from(self, text: str) -> int:
        """Where streamed content must stop: a call may start there (the parse decides)."""
        if self.start_opener is not None:
            return 0  # a call may open the reply: held until the parse decides
        match = re.compile(_lit(self.opener)).search(text)
        if match is not None:
            return match.start()
        target = _squash(self.opener)
        for start in range(max(0, len(text) - len(self.opener) - 8), len(text)):
            tail = _squash(text[start:])
            if tail and target.startswith(tail):
                return start
        return len(text)

    # --- constraining -------------------------------------------------------------------

    def constraint(
        self,
        tools: list[tuple[str, dict[str, Any]]],
        literal: Callable[[str], list[Any]],
        reasoning_close: str | None = None,
    ) -> dict[str, Any] | None:
        """The structural-tag format of one call of any of `tools` (name, JSON schema) in
        this syntax, written as the template writes a reply that is only that call (from
        after its reasoning block: vLLM applies the constraint once reasoning has ended);
        None where the syntax carries a call id (the model invents it). `literal` turns
        text into format elements (special tokens as tokens)."""
        lead = self.lead
        if reasoning_close and reasoning_close in lead:
            lead = lead.rsplit(reasoning_close, 1)[1]
        if any(_ID in piece for piece in (lead, self.name_sep, self.close)):
            return None
        options = []
        for name, schema in tools:
            if self.params is None:
                arguments = [
                    {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 16}
                ]
            else:
                arguments = self._param_elements(schema, literal)
            elements = [
                *literal(lead + name + self.name_sep),
                *arguments,
                *literal(self.close),
            ]
            options.append({"type": "sequence", "elements": elements})
        return options[0] if len(options) == 1 else {"type": "or", "elements": options}

    def _param_elements(
        self, schema: dict[str, Any], literal: Callable[[str], list[Any]]
    ) -> list[dict[str, Any]]:
        """The required parameters, one element each, in the schema's order."""
        style = self.params
        assert style is not None
        properties = schema.get("properties") or {}
        out: list[dict[str, Any]] = []
        for key in schema.get("required") or []:
            prop = properties.get(key) or {}
            text = prop.get("type") == "string"
            head = style.p_next + key + style.glue_head
            if style.flags is not None:
                head += style.flags[0 if text else 1] + style.glue_tail
            value: dict[str, Any] = (
                {"type": "regex", "pattern": "[^<]*"}
                if text
                else {"type": "json_schema", "json_schema": prop or {}}
            )
            out += [*literal(head), value, *literal(style.p_close.replace(_KEY, key))]
        return out


def _first_group(match: re.Match[str], start: int = 0) -> str | None:
    groups = [g for g in match.groups()[start:] if g]
    return groups[0] if groups else None


def _param_value(raw: str, flag: str | None, flags: tuple[str, str] | None) -> Any:
    if flags is not None and flag == flags[0]:
        return raw
    try:
        value = json.loads(raw)
    except ValueError:
        return raw
    if flags is None and isinstance(value, str):
        return raw
    return value


def _common_prefix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class _Bodies:
    """The text the template writes for assistant probe replies (after its generation
    prompt, up to its end-of-turn marker)."""

    def __init__(self, render: Render, end_marker: str | None) -> None:
        self.render = render
        self.end_marker = end_marker
        self.user = [{"role": "user", "content": "Weather in Paris?"}]
        self.prompt = render(self.user, True)

    def body(self, calls: list[dict[str, Any]], content: str = "") -> str | None:
        body = self.reply_body({"role": "assistant", "content": content, "tool_calls": calls})
        return None if body is None else body.replace(_ID1, _ID).replace(_ID2, _ID)

    def reply_body(self, reply: dict[str, Any], witness: str = "get_weather") -> str | None:
        full = self.render([*self.user, reply], False)
        if full is None or self.prompt is None:
            return None
        common = _common_prefix(self.prompt, full)
        if common < len(self.prompt):
            # The finished turn is written unlike the generation prompt (`<think>` there,
            # none here): the body starts at the marker they diverge in, not inside it.
            marker = full.rfind("<", max(0, common - 24), common + 1)
            common = marker if marker >= 0 else common
        body = full[common:]
        at = body.find(witness)
        if at < 0:
            return None
        if self.end_marker:
            cut = body.find(self.end_marker, at)
            body = body if cut < 0 else body[:cut]
        return body


_REASONING = "TKREASONINGTK"


def learn_reasoning(render: Render, end_marker: str | None) -> tuple[str, str] | str:
    """(opener, closer): the markers the template writes around an assistant message's
    reasoning (MiniMax M3: `<mm:think>`, `</mm:think>`; the opener is empty where the
    generation prompt opens the block), or why there are none."""
    bodies = _Bodies(render, end_marker)
    reply = {"role": "assistant", "reasoning_content": _REASONING, "content": _CONTENT}
    body = bodies.reply_body(reply, _REASONING)
    if body is None:
        return "the template does not render reasoning"
    after = body.index(_REASONING) + len(_REASONING)
    content = body.find(_CONTENT, after)
    if content < 0:
        return "the template writes the reasoning after the content"
    closer = body[after:content].strip()
    if not closer:
        return "the template writes no marker after the reasoning"
    return body[: body.index(_REASONING)].strip(), closer


def learn(render: Render, end_marker: str | None) -> ToolSyntax | str:
    """The template's tool-call syntax, or why it cannot be learned."""
    bodies = _Bodies(render, end_marker)
    paris = {"city": "Paris"}
    one = bodies.body([_call("get_weather", paris, _ID1)])
    if one is None:
        return "the template does not render a tool call"
    first = one.index("get_weather")
    with_content = bodies.body([_call("get_weather", paris, _ID1)], _CONTENT)
    if with_content is not None and _CONTENT in with_content:
        after = with_content.index(_CONTENT) + len(_CONTENT)
        name_at = with_content.find("get_weather", after)
        if name_at < 0:
            return "the template writes a call's content after the call"
        opener = with_content[after:name_at]
        start_opener = None if _squash(opener) in _squash(one[:first]) else one[:first]
    else:
        # The template drops content beside calls (Llama 3.1, MiniMax M1): a call opens
        # the reply.
        with_content = None
        opener, start_opener = one[:first], None
    if not opener.strip():
        start_opener = one[:first]
    arguments = _json_arguments(one, first + len("get_weather"), paris)
    if arguments is not None:
        args_at, args_end = arguments
        name_sep = one[first + len("get_weather") : args_at]
        params = None
        close = one[args_end:]
    else:
        learned = _learn_params(bodies, one, first)
        if isinstance(learned, str):
            return learned
        name_sep, params, close = learned
    syntax = ToolSyntax(opener, start_opener, name_sep, None, close, params, one[:first])
    two = bodies.body([_call("get_weather", paris, _ID1), _call("get_time", {"zone": "UTC"}, _ID2)])
    if two is not None and "get_time" in two:
        # The text between the first call's arguments and the second call's name.
        name = re.compile(_NAME + _lit(name_sep)).match(two, first)
        read = syntax._arguments(two, name.end()) if name else None
        second = two.find("get_time")
        if read is not None and read[1] <= second:
            syntax = replace(syntax, mid=two[read[1] : second])
    return _verified(syntax, one, two, with_content)


def _json_arguments(body: str, after: int, expected: dict[str, Any]) -> tuple[int, int] | None:
    decoder = json.JSONDecoder()
    for at in (i for i, ch in enumerate(body) if ch == "{" and i >= after):
        try:
            value, end = decoder.raw_decode(body, at)
        except ValueError:
            continue
        if value == expected:
            return at, end
    return None


def _learn_params(bodies: _Bodies, one: str, first: int) -> tuple[str, ParamStyle, str] | str:
    """Per-parameter elements, learned from a call with a string and an integer parameter."""
    both = bodies.body([_call("get_weather", {"city": "Paris", "days": 2}, _ID1)])
    if both is None:
        return "the template does not render a call with two parameters"
    name_end = both.index("get_weather") + len("get_weather")
    try:
        city = both.index("city", name_end)
        paris = both.index("Paris", city)
        days = both.index("days", paris)
        two = both.index("2", days + 4)
    except ValueError:
        return "the arguments are neither JSON nor one element per parameter"
    s0 = both[name_end:city]
    s1 = both[city + 4 : paris]
    s2 = both[paris + 5 : days].replace("city", _KEY)
    s3 = both[days + 4 : two]
    s4 = both[two + 1 :].replace("days", _KEY)
    k = _common_prefix(s2, s4)
    p_close, p_next = s2[:k], s2[k:]
    if not p_close.strip() or not s0.endswith(p_next):
        return "the parameters' closing text could not be told apart"
    name_sep = s0[: len(s0) - len(p_next)] if p_next else s0
    head = _common_prefix(s1, s3)
    tail = _common_prefix(s1[::-1], s3[::-1])
    tail = min(tail, len(s1) - head, len(s3) - head)
    flags = None
    if s1 != s3:
        flags = (s1[head : len(s1) - tail], s3[head : len(s3) - tail])
    glue_head, glue_tail = s1[:head], s1[len(s1) - tail :] if tail else ""
    if flags is None:
        glue_head, glue_tail = s1, ""
    style = ParamStyle(p_next, glue_head, glue_tail, flags, p_close)
    # The single-parameter call closes with p_close, then the call's own close.
    after = one[one.index("Paris", first) + len("Paris") :].replace("city", _KEY)
    if not after.startswith(p_close):
        return "the parameters' closing text differs between calls"
    return name_sep, style, after[len(p_close) :]


def _verified(
    syntax: ToolSyntax, one: str, two: str | None, with_content: str | None
) -> ToolSyntax | str:
    """The syntax, once it reads the template's own probe replies back."""
    real = {"\x00ID\x00": _ID1}

    def restore(text: str) -> str:
        for key, value in real.items():
            text = text.replace(key, value)
        return text

    parsed = syntax.parse(restore(one))
    if parsed is None or [(c.name, _loads(c.arguments)) for c in parsed[1]] != [
        ("get_weather", {"city": "Paris"})
    ]:
        return "the learned syntax does not read the template's own tool call back"
    if with_content is not None:
        parsed = syntax.parse(restore(with_content))
        if parsed is None or _CONTENT not in parsed[0]:
            return "the learned syntax does not read content before a call back"
    if syntax.mid is not None and two is not None:
        parsed = syntax.parse(restore(two))
        if parsed is None or [c.name for c in parsed[1]] != ["get_weather", "get_time"]:
            syntax = replace(syntax, mid=None)
    return syntax


def _loads(arguments: Any) -> Any:
    try:
        return json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        return arguments


class LearnedToolParser:
    """The `renderers` tool-parser interface over a learned syntax (the generic renderer
    calls it on the reply's token IDs after any reasoning)."""

    def __init__(self, tokenizer: Any, syntax: ToolSyntax) -> None:
        self._tokenizer = tokenizer
        self.syntax = syntax

    def extract(self, ids: list[int]) -> tuple[list[int], list[ParsedToolCall]]:
        text = str(self._tokenizer.decode(ids, skip_special_tokens=False))
        parsed = self.syntax.parse(text)
        if parsed is None:
            return ids, []
        content, calls = parsed
        return list(self._tokenizer.encode(content, add_special_tokens=False)), calls
