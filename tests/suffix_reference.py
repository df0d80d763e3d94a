"""An independent reference for the tokens tokenkeep adds after a stored turn.

Contiguity alone (turn k+1's prompt starts with turn k's prompt + sampled tokens) says
nothing about what follows the sampled tokens: a splice that dropped a tool result or left
out the generation prompt would still be contiguous. This reference says what must follow,
from the model's own chat template over the request as the harness sent it
(`tokenizer.apply_chat_template`, not tokenkeep's splice or renderer):

- the added tokens are exactly the template's own tokens (`apply_chat_template` tokenizing
  the whole request) after the stored assistant turn's end-of-turn token (the framing of
  every new message, then the generation prompt), compared as token ids, not decoded text;
  where that turn ends is found with a sentinel in its content, not by tokenkeep's rule;
- every new message's text is in them, in order;
- one rule of tokenkeep's own, named and checked exactly (`closing_rule`): a turn cut by
  `max_tokens` has no end-of-turn token, so tokenkeep closes it first (context, outside the
  loss): an open reasoning block with `</think>`, then the turn with its end-of-turn token.
"""

from __future__ import annotations

import contextlib
import copy
import json
from typing import Any

from session_server.splice import ChatModel

TRUNCATED_TURN_IS_CLOSED = "a turn cut by max_tokens is closed (reasoning, then the turn)"


def _as_template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request as vLLM's chat endpoint hands it to the template: tool-call arguments
    parsed into objects where they are JSON, `None` content as empty text."""
    out = copy.deepcopy(messages)
    for m in out:
        if m.get("content") is None:
            m["content"] = ""
        for call in m.get("tool_calls") or []:
            args = call["function"]["arguments"]
            if isinstance(args, str):
                # not JSON: the template writes the string as it is (only the history has it)
                with contextlib.suppress(ValueError):
                    call["function"]["arguments"] = json.loads(args)
    return out


def _render(
    model: ChatModel,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    *,
    generation_prompt: bool,
) -> list[int]:
    return list(
        model.tokenizer.apply_chat_template(
            _as_template_messages(messages),
            tools=tools,
            add_generation_prompt=generation_prompt,
            tokenize=True,
            return_dict=False,
        )
    )


SENTINEL = "TokenkeepSuffixSentinel"


def expected_suffix_ids(
    model: ChatModel,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    stop: int | None = None,
) -> list[int]:
    """The template's own tokens (its tokenization of the whole request) after the last
    assistant message's end-of-turn token.

    Where that turn ends is found without tokenkeep's rule (which counts end-of-turn tokens
    in a render of the history): the last assistant message's content is replaced by a
    sentinel in a text render, and the turn ends at the first end-of-turn token after it.
    The tail that follows is the same text in the real render; its tokens are read off the
    template's tokenization of the real request. `stop`: the stop token the turn was
    sampled with where it is not the end-of-turn token (Gemma 4 stops a calling turn at
    `<|tool_response>`, and the tool results continue the same turn)."""
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    if stop is not None and stop != model.close_token_id:
        # Only a stop token the template itself writes where that turn stops (Gemma 4's
        # `<|tool_response>`); a turn that ended on another stop token (Qwen3's
        # `<|endoftext|>`) is closed by the end-of-turn token like any other.
        stop_text = model.tokenizer.convert_ids_to_tokens(stop)
        if stop_text not in _render_text(model, messages, tools):
            stop = None
    close = stop if stop is not None else model.close_token_id
    assert close is not None
    close_text = model.tokenizer.convert_ids_to_tokens(close)
    marked = copy.deepcopy(messages)
    marked[last]["content"] = SENTINEL + _text(marked[last].get("content"))
    text = _render_text(model, marked, tools)
    calls_stop = stop is not None and stop != model.close_token_id
    if (SENTINEL not in text or calls_stop) and messages[last].get("tool_calls"):
        # Templates that write only the tool calls of a calling turn (Llama 3): mark a call.
        marked = copy.deepcopy(messages)
        marked[last]["tool_calls"][-1]["function"]["name"] += SENTINEL
        text = _render_text(model, marked, tools)
    # (a tool result may name the call it answers: the call is the first)
    assert text.count(SENTINEL) == 1 or (calls_stop and SENTINEL in text), (
        "the template does not render the last assistant turn"
    )
    end = text.find(close_text, text.index(SENTINEL))
    assert end >= 0, "the template does not close the stored turn"
    tail = text[end + len(close_text) :].replace(SENTINEL, "")  # a result naming the call
    full = _render(model, messages, tools, generation_prompt=True)
    cuts = [i + 1 for i, t in enumerate(full) if t == close and model.decode(full[i + 1 :]) == tail]
    assert len(cuts) == 1, f"the template's tokens hold the tail {tail!r} {len(cuts)} times"
    return full[cuts[0] :]


def _render_text(
    model: ChatModel, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> str:
    return str(
        model.tokenizer.apply_chat_template(
            _as_template_messages(messages),
            tools=tools,
            add_generation_prompt=True,
            tokenize=False,
        )
    )


def _text(content: Any) -> str:
    if isinstance(content, list):  # content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def _assert_carries(text: str, new_messages: list[dict[str, Any]]) -> None:
    position = 0
    for message in new_messages:
        needle = _text(message.get("content"))
        found = text.find(needle, position)
        if found < 0:  # templates that quote a message as a JSON string (Llama 3, gpt-oss)
            needle = json.dumps(needle, ensure_ascii=False)[1:-1]
            found = text.find(needle, position)
        assert found >= 0, f"new {message['role']} message {needle!r} missing from {text!r}"
        position = found + len(needle)


def closing_rule(model: ChatModel, sampled: list[int]) -> list[int]:
    """The tokens tokenkeep itself adds after a turn cut by `max_tokens` (no end-of-turn
    token was sampled): `</think>` if a reasoning block is still open, then the end-of-turn
    token. Nothing after a turn that ended on its own."""
    if not sampled or sampled[-1] in model.stop_token_ids:
        return []
    vocab = model.tokenizer.get_vocab()
    think, think_end = vocab.get("<think>"), vocab.get("</think>")
    closing: list[int] = []
    if think is not None and think in sampled:
        last_open = len(sampled) - 1 - sampled[::-1].index(think)
        if think_end not in sampled[last_open:]:
            closing.append(think_end)
    assert model.close_token_id is not None
    return [*closing, model.close_token_id]


def assert_suffix(
    model: ChatModel,
    prompt: list[int],
    stored: list[int],
    sampled: list[int],
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
) -> None:
    """`prompt` continues `stored` (prompt + `sampled` tokens of the turn the request's last
    assistant message is) with exactly the template's tail for the messages after it."""
    assert prompt[: len(stored)] == stored, "not contiguous with the stored turn"
    assert stored[len(stored) - len(sampled) :] == sampled
    added = prompt[len(stored) :]
    closing = closing_rule(model, sampled)
    assert added[: len(closing)] == closing, TRUNCATED_TURN_IS_CLOSED
    stop = sampled[-1] if sampled and sampled[-1] in model.stop_token_ids else None
    expected = expected_suffix_ids(model, messages, tools, stop)
    assert added[len(closing) :] == expected, (
        f"added tokens {model.decode(added[len(closing) :])!r} are not the template's tail "
        f"{model.decode(expected)!r} (as token ids)"
    )
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    _assert_carries(model.decode(expected), messages[last + 1 :])


def generation_prompt_text(model: ChatModel) -> str:
    """What the template adds to make the model answer (Qwen3: `<|im_start|>assistant\\n`)."""
    probe = [{"role": "user", "content": "probe"}]
    with_prompt = model.decode(_render(model, probe, None, generation_prompt=True))
    without = model.decode(_render(model, probe, None, generation_prompt=False))
    assert with_prompt.startswith(without)
    return with_prompt[len(without) :]


def assert_suffix_carries(
    model: ChatModel, added: list[int], new_messages: list[dict[str, Any]]
) -> None:
    """The weaker check where the request holds only the new messages: each one's text is in
    the added tokens, in order, and they end with the template's generation prompt."""
    text = model.decode(added)
    _assert_carries(text, new_messages)
    assert text.endswith(generation_prompt_text(model)), f"no generation prompt: {text!r}"
