"""Screenshots through the whole stack: the OpenAI SDK, tokenkeep (Redis store), a recording
relay, and real vLLM CPU serving the tiny Qwen3-VL. Three turns: a screenshot, a tool result,
a new screenshot with the first one resent; streamed and not."""

from __future__ import annotations

import base64
import hashlib
import io
import uuid
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from PIL import Image

from session_server.app import create_app
from session_server.images import decode_image
from session_server.settings import Settings
from session_server.splice import ChatModel
from session_server.tokenizer import load_tokenizer
from tests.integration.conftest import RealStack
from tests.integration.relay import Relay
from tests.live_server import serving
from tests.vllm_fixture import RunningEngine, vision_engine

__all__ = ["vision_engine"]

pytestmark = pytest.mark.vllm

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "click",
            "description": "Click at a point of the screen",
            "parameters": {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                "required": ["x", "y"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def vision_stack(vision_engine: RunningEngine, redis_server: str) -> Iterator[RealStack]:
    relay = Relay(vision_engine.url)
    with serving(relay.app()) as relay_url:
        settings = Settings(
            engine_urls=[relay_url],
            model=vision_engine.served_model_name,
            tokenizer=str(vision_engine.model_dir),
            context_length=vision_engine.max_model_len,
            redis_url=redis_server,
        )
        with serving(create_app(settings)) as url:
            model = ChatModel(load_tokenizer(str(vision_engine.model_dir)))
            yield RealStack(url, relay, model, vision_engine)


def screenshot(width: int, height: int, shade: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (shade, 90, 160)).save(buffer, "PNG")
    return buffer.getvalue()


def image_part(data: bytes) -> dict[str, Any]:
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def ask(
    client: openai.OpenAI, body: dict[str, Any], stream: bool
) -> tuple[Any, list[int], list[int]]:
    """(the assistant message to echo, the prompt ids, the sampled ids)."""
    if not stream:
        reply = client.chat.completions.create(**body)
        choice = reply.choices[0]
        return (
            choice.message.model_dump(exclude_none=True),
            (reply.model_extra or {})["prompt_token_ids"],
            (choice.model_extra or {})["token_ids"],
        )
    prompt: list[int] = []
    sampled: list[int] = []
    content = ""
    calls: dict[int, dict[str, Any]] = {}
    for chunk in client.chat.completions.create(**body, stream=True):
        prompt = (chunk.model_extra or {}).get("prompt_token_ids") or prompt
        for choice in chunk.choices:
            sampled += (choice.model_extra or {}).get("token_ids") or []
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or ():
                empty = {"name": "", "arguments": ""}
                entry = calls.setdefault(
                    call.index, {"id": call.id, "type": "function", "function": empty}
                )
                if call.function and call.function.name:
                    entry["function"]["name"] += call.function.name
                if call.function and call.function.arguments:
                    entry["function"]["arguments"] += call.function.arguments
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = list(calls.values())
    return message, prompt, sampled


@pytest.mark.parametrize("stream", [False, True])
def test_screenshot_tool_loop_is_token_exact(vision_stack: RealStack, stream: bool) -> None:
    http = vision_stack.http()
    session = http.post("/sessions", json={"id": f"vl-{uuid.uuid4().hex}", "sampling": {"seed": 5}})
    assert session.status_code == 201, session.text
    session_id = session.json()["id"]
    client = vision_stack.openai(session.json())
    first, second = screenshot(1280, 800, 10), screenshot(333, 517, 200)
    vision = vision_stack.model.vision
    assert vision is not None
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You operate a desktop."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Open settings."}, image_part(first)],
        },
    ]
    prompts: list[list[int]] = []
    completions: list[list[int]] = []
    for turn in range(3):
        body: dict[str, Any] = {
            "model": vision_stack.engine.served_model_name,
            "messages": [dict(m) for m in messages],
            "tools": TOOLS,
            "max_tokens": 64 if turn == 0 else 8,
            "extra_body": {"return_token_ids": True},
        }
        if turn == 0:  # random weights: the grammar makes the first reply a real tool call
            body["tool_choice"] = {"type": "function", "function": {"name": "click"}}
            # The engine's qwen3 reasoning parser would hold the grammar back until a </think>
            # this Instruct template never opens.
            body["extra_body"]["reasoning_ended"] = True
        before = len(vision_stack.relay.exchanges)
        message, prompt, sampled = ask(client, body, stream)
        [exchange] = vision_stack.relay.exchanges[before:]
        # The engine got one pad per image and every image so far, and reports the prompt the
        # harness was told, with the images where tokenkeep placed them.
        images_so_far = [first] if turn < 2 else [first, second, first]
        assert [
            base64.b64decode(p["url"].split(",", 1)[1]) for p in exchange.content_parts
        ] == images_so_far
        assert exchange.sent_prompt.count(vision.pad_id) == len(images_so_far)
        assert exchange.reported_prompt == prompt
        assert exchange.sampled[0] == sampled
        sizes = [decode_image(i) for i in images_so_far]
        want = [vision.spec.placeholders(i.width, i.height) for i in sizes]
        assert [p["length"] for p in (exchange.mm_placeholders or {})["image"]] == want
        if turn:
            stored = prompts[-1] + completions[-1]
            assert prompt[: len(stored)] == stored, f"turn {turn + 1} is not contiguous"
        prompts.append(prompt)
        completions.append(sampled)
        messages.append(message)
        if turn == 0:
            [call] = message.get("tool_calls") or pytest.fail(f"no tool call: {message}")
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": "clicked"})
        elif turn == 1:
            messages.append(
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Now:"},
                        image_part(second),
                        {"type": "text", "text": "Before:"},
                        image_part(first),
                    ],
                }
            )

    summary = http.get(f"/sessions/{session_id}").json()
    assert (summary["turns"], summary["segments"], summary["breaks"]) == (3, 1, {})
    [branch] = http.get(f"/sessions/{session_id}/trajectory").json()["branches"]
    [segment] = branch["segments"]
    assert segment["token_ids"] == prompts[-1] + completions[-1]
    assert sum(segment["loss_mask"]) == sum(map(len, completions))
    pads = [i for i, t in enumerate(segment["token_ids"]) if t == vision.pad_id]
    assert len(pads) == 1000 + 160 + 1000
    assert all(segment["loss_mask"][i] == 0 for i in pads)
    # The trainer's view: each turn lists the images its prompt added, in segment coordinates,
    # and the bytes come back by hash.
    listed = [
        [(i["sha256"], i["length"], i["width"], i["height"]) for i in turn.get("images", [])]
        for turn in segment["turns"]
    ]
    sha = {data: hashlib.sha256(data).hexdigest() for data in (first, second)}
    assert listed == [
        [(sha[first], 1000, 1280, 800)],
        [],
        [(sha[second], 160, 333, 517), (sha[first], 1000, 1280, 800)],
    ]
    for turn in segment["turns"]:
        for entry in turn.get("images", []):
            run = segment["token_ids"][entry["offset"] - 1 : entry["offset"] + entry["length"] + 1]
            assert run == [vision.start_id, *[vision.pad_id] * entry["length"], vision.end_id]
    for data in (first, second):
        fetched = http.get(f"/sessions/{session_id}/images/{sha[data]}")
        assert (fetched.status_code, fetched.content) == (200, data)
        assert fetched.headers["content-type"] == "image/png"
    assert http.get(f"/sessions/{session_id}/images/{'0' * 64}").status_code == 404
    # The viewer draws each placeholder run as one block with a thumbnail of the image.
    [view] = http.get(f"/ui/api/sessions/{session_id}").json()["branches"][0]["segments"]
    drawn = [(i["sha256"], i["length"]) for i in view["images"]]
    assert drawn == [(sha[first], 1000), (sha[second], 160), (sha[first], 1000)]
    thumbnail = view["images"][0]["thumbnail"]
    assert thumbnail.startswith("data:image/jpeg;base64,")
    assert Image.open(io.BytesIO(base64.b64decode(thumbnail.split(",", 1)[1]))).size == (96, 60)


def test_bad_images_are_refused_and_the_session_is_unchanged(vision_stack: RealStack) -> None:
    http = vision_stack.http()
    session = http.post("/sessions", json={"id": f"vl-{uuid.uuid4().hex}"}).json()
    client = vision_stack.openai(session)
    good = screenshot(64, 48, 1)
    bmp = io.BytesIO()
    Image.new("RGB", (8, 8)).save(bmp, "BMP")
    cases = {
        "cannot be decoded": good[:50],
        "unsupported image format BMP": bmp.getvalue(),
    }
    for reason, data in cases.items():
        with pytest.raises(openai.BadRequestError, match=reason):
            client.chat.completions.create(
                model=vision_stack.engine.served_model_name,
                messages=[{"role": "user", "content": [image_part(data)]}],
                max_tokens=4,
            )
    with pytest.raises(openai.BadRequestError, match="are not fetched"):
        client.chat.completions.create(
            model=vision_stack.engine.served_model_name,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
                    ],
                }
            ],
            max_tokens=4,
        )
    assert http.get(f"/sessions/{session['id']}").json()["turns"] == 0


def _contiguous(exchanges: list[Any], images: list[list[bytes]], vision: Any) -> None:
    """Each prompt vLLM reports starts with the previous one + its sampled tokens, and the
    engine got every image so far, placed as tokenkeep counts them."""
    for k, exchange in enumerate(exchanges):
        sent = [base64.b64decode(p["url"].split(",", 1)[1]) for p in exchange.content_parts]
        assert sent == images[k]
        want = [vision.spec.placeholders(*Image.open(io.BytesIO(i)).size) for i in images[k]]
        got = (exchange.mm_placeholders or {}).get("image", [])
        assert [p["length"] for p in got] == want
        if k:
            stored = exchanges[k - 1].reported_prompt + exchanges[k - 1].sampled[0]
            assert exchange.reported_prompt[: len(stored)] == stored


def test_anthropic_image_blocks(vision_stack: RealStack) -> None:
    import anthropic

    http = vision_stack.http()
    session = http.post("/sessions", json={"sampling": {"seed": 3}}).json()
    client = anthropic.Anthropic(
        base_url=session["anthropic_base_url"], api_key=session["api_key"], max_retries=0
    )
    first, second = screenshot(200, 100, 30), screenshot(64, 48, 60)

    def block(data: bytes) -> dict[str, Any]:
        encoded = base64.b64encode(data).decode()
        source = {"type": "base64", "media_type": "image/png", "data": encoded}
        return {"type": "image", "source": source}

    messages: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": "What is open?"}, block(first)]}
    ]
    before = len(vision_stack.relay.exchanges)
    for turn in range(3):
        reply = client.messages.create(
            model=vision_stack.engine.served_model_name, max_tokens=8, messages=messages
        )
        messages.append({"role": "assistant", "content": [b.model_dump() for b in reply.content]})
        follow = [{"type": "text", "text": "and now?"}]
        if turn == 1:
            follow = [block(second), {"type": "text", "text": "after the click"}, block(first)]
        messages.append({"role": "user", "content": follow})
    assert vision_stack.model.vision is not None
    _contiguous(
        vision_stack.relay.exchanges[before:],
        [[first], [first], [first, second, first]],
        vision_stack.model.vision,
    )
    summary = http.get(f"/sessions/{session['id']}").json()
    assert (summary["turns"], summary["segments"]) == (3, 1)


def test_responses_input_image(vision_stack: RealStack) -> None:
    http = vision_stack.http()
    session = http.post("/sessions", json={"sampling": {"seed": 4}}).json()
    client = vision_stack.openai(session)
    first = screenshot(333, 517, 90)
    url = "data:image/png;base64," + base64.b64encode(first).decode()
    items: list[dict[str, Any]] = [
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": "Describe"},
                {"type": "input_image", "image_url": url},
            ],
        }
    ]
    before = len(vision_stack.relay.exchanges)
    for _ in range(2):
        response = client.responses.create(
            model=vision_stack.engine.served_model_name, input=items, max_output_tokens=8
        )
        items += [item.model_dump(exclude_none=True) for item in response.output]
        items.append({"role": "user", "content": "go on"})
    assert vision_stack.model.vision is not None
    _contiguous(
        vision_stack.relay.exchanges[before:], [[first], [first]], vision_stack.model.vision
    )
    summary = http.get(f"/sessions/{session['id']}").json()
    assert (summary["turns"], summary["segments"]) == (2, 1)


@pytest.fixture(scope="module")
def memory_vision_stack(vision_engine: RunningEngine) -> Iterator[RealStack]:
    """The same stack with the embedded store (no Redis)."""
    relay = Relay(vision_engine.url)
    with serving(relay.app()) as relay_url:
        settings = Settings(
            engine_urls=[relay_url],
            model=vision_engine.served_model_name,
            tokenizer=str(vision_engine.model_dir),
            context_length=vision_engine.max_model_len,
        )
        with serving(create_app(settings)) as url:
            model = ChatModel(load_tokenizer(str(vision_engine.model_dir)))
            yield RealStack(url, relay, model, vision_engine)


def _input_image(data: bytes) -> dict[str, Any]:
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    return {"type": "input_image", "image_url": url}


def _respond(client: openai.OpenAI, stream: bool, **body: Any) -> Any:
    if not stream:
        return client.responses.create(**body)
    final = None
    for event in client.responses.create(**body, stream=True):
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response  # a reply cut by max_output_tokens is `incomplete`
    assert final is not None
    return final


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("store", ["redis", "memory"])
def test_previous_response_id_keeps_earlier_images(
    vision_stack: RealStack, memory_vision_stack: RealStack, store: str, stream: bool
) -> None:
    """Issue 38: turn 2 sends only a new image and `previous_response_id` (what the Responses
    SDK and agents built on it do). The engine gets both images, in order, the prompt
    continues turn 1's tokens (one segment), and the export maps both runs to their images
    with loss mask 0."""
    stack = vision_stack if store == "redis" else memory_vision_stack
    http = stack.http()
    session = http.post("/sessions", json={"sampling": {"seed": 6}}).json()
    client = stack.openai(session)
    first, second = screenshot(64, 48, 11), screenshot(200, 100, 12)
    before = len(stack.relay.exchanges)
    model = stack.engine.served_model_name
    one = _respond(
        client, stream, model=model, max_output_tokens=6,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "What is this?"},
                                            _input_image(first)]}],
    )  # fmt: skip
    two = _respond(
        client, stream, model=model, max_output_tokens=6, previous_response_id=one.id,
        input=[{"role": "user", "content": [_input_image(second),
                                            {"type": "input_text", "text": "And this?"}]}],
    )  # fmt: skip
    three = _respond(
        client, stream, model=model, max_output_tokens=6, previous_response_id=two.id,
        input="Compare them.",
    )  # fmt: skip
    assert three.previous_response_id == two.id
    vision = stack.model.vision
    assert vision is not None
    exchanges = stack.relay.exchanges[before:]
    _contiguous(exchanges, [[first], [first, second], [first, second]], vision)
    assert [p["length"] for p in (exchanges[1].mm_placeholders or {})["image"]] == [70, 72]
    summary = http.get(f"/sessions/{session['id']}").json()
    assert (summary["turns"], summary["segments"], summary["breaks"]) == (3, 1, {})
    [branch] = http.get(f"/sessions/{session['id']}/trajectory").json()["branches"]
    [segment] = branch["segments"]
    assert segment["token_ids"] == exchanges[-1].reported_prompt + exchanges[-1].sampled[0]
    sha = {data: hashlib.sha256(data).hexdigest() for data in (first, second)}
    listed = [[(i["sha256"], i["length"]) for i in t.get("images", [])] for t in segment["turns"]]
    assert listed == [[(sha[first], 70)], [(sha[second], 72)], []]
    for turn in segment["turns"]:
        for entry in turn.get("images", []):
            at, n = entry["offset"], entry["length"]
            run = segment["token_ids"][at - 1 : at + n + 1]
            assert run == [vision.start_id, *[vision.pad_id] * n, vision.end_id]
            assert segment["loss_mask"][at : at + n] == [0] * n


def test_an_earlier_image_no_longer_stored_is_a_400(
    vision_stack: RealStack, redis_server: str
) -> None:
    """An earlier image that cannot be recovered (here: removed from Redis, as an expiry
    would) answers 400 naming it, and the session is left exactly as it was."""
    import redis

    http = vision_stack.http()
    session = http.post("/sessions", json={"sampling": {"seed": 7}}).json()
    client = vision_stack.openai(session)
    first = screenshot(64, 48, 21)
    model = vision_stack.engine.served_model_name
    one = client.responses.create(
        model=model, max_output_tokens=4,
        input=[{"role": "user", "content": [_input_image(first)]}],
    )  # fmt: skip
    sha = hashlib.sha256(first).hexdigest()
    server = redis.Redis.from_url(redis_server)
    [key] = list(server.scan_iter(f"*{{{session['id']}}}:images"))
    assert server.hdel(key, sha) == 1
    before = http.get(f"/sessions/{session['id']}").json()
    trajectory = http.get(f"/sessions/{session['id']}/trajectory").json()
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(
            model=model, max_output_tokens=4, previous_response_id=one.id, input="and now?"
        )
    assert sha in refused.value.message
    assert refused.value.body["param"] == "previous_response_id"  # type: ignore[index]
    assert http.get(f"/sessions/{session['id']}").json() == before
    assert http.get(f"/sessions/{session['id']}/trajectory").json() == trajectory


@pytest.mark.parametrize("api", ["chat", "messages"])
def test_a_chat_or_anthropic_history_without_an_earlier_image_gets_none_put_back(
    vision_stack: RealStack, api: str
) -> None:
    """Chat Completions and Anthropic Messages cannot continue stored state: by their
    definitions a request is the whole conversation. A client that resends its history with
    turn 1's image left out has asked about a conversation without it: the engine gets only
    the image that was sent (the stored one is not put back) and the turn starts a new
    segment, since its messages no longer match what was sampled."""
    import anthropic

    http = vision_stack.http()
    session = http.post("/sessions", json={"sampling": {"seed": 8}}).json()
    first, second = screenshot(64, 48, 41), screenshot(200, 100, 42)
    model = vision_stack.engine.served_model_name
    before = len(vision_stack.relay.exchanges)
    question = {"type": "text", "text": "What is this?"}
    if api == "chat":
        client = vision_stack.openai(session)
        messages: list[dict[str, Any]] = [
            {"role": "user", "content": [question, image_part(first)]}
        ]
        reply = client.chat.completions.create(model=model, max_tokens=4, messages=messages)
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content},
            {"role": "user", "content": [image_part(second), {"type": "text", "text": "And?"}]},
        ]
        messages[0]["content"] = [question]  # the image left out of the resent history
        client.chat.completions.create(model=model, max_tokens=4, messages=messages)
    else:
        agent = anthropic.Anthropic(
            base_url=session["anthropic_base_url"], api_key=session["api_key"], max_retries=0
        )

        def block(data: bytes) -> dict[str, Any]:
            encoded = base64.b64encode(data).decode()
            return {
                "type": "image",
                "source": {"type": "base64", "media_type": "image/png", "data": encoded},
            }

        messages = [{"role": "user", "content": [question, block(first)]}]
        answer = agent.messages.create(model=model, max_tokens=4, messages=messages)
        messages += [
            {"role": "assistant", "content": [b.model_dump() for b in answer.content]},
            {"role": "user", "content": [block(second), {"type": "text", "text": "And?"}]},
        ]
        messages[0]["content"] = [question]
        agent.messages.create(model=model, max_tokens=4, messages=messages)
    exchanges = vision_stack.relay.exchanges[before:]
    sent = [
        [base64.b64decode(p["url"].split(",", 1)[1]) for p in e.content_parts or []]
        for e in exchanges
    ]
    assert sent == [[first], [second]]
    summary = http.get(f"/sessions/{session['id']}").json()
    assert (summary["turns"], summary["segments"]) == (2, 2)
