"""Images, token-exact: the Qwen3-VL template, placeholder counts, and the real vLLM CPU engine
on the tiny Qwen3-VL (`tokenkeep engine build-model --model tiny-qwen3-vl`).

The engine tests send what tokenkeep sends (`/inference/v1/generate` with one pad per image
and every image so far as `content_parts`) and compare the engine's expanded prompt and
placeholder ranges with the ones tokenkeep computed, turn after turn.
"""

from __future__ import annotations

import base64
import io
import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image

from session_server.conversation import (
    IMAGE_MARK,
    Conversation,
    ConversationError,
    Message,
    Tool,
    lineage,
)
from session_server.devtools import localengine
from session_server.images import (
    ImageInput,
    ImageTooLarge,
    PlaceholderRun,
    collapse,
    content_parts,
    decode_base64,
    decode_data_url,
    decode_image,
    echo_mismatch,
    vision_spec,
)
from session_server.splice import ChatModel, to_renderer_messages, to_renderer_tools
from session_server.tokenizer import load_tokenizer
from tests.real_tokenizers import qwen3_dir
from tests.vllm_fixture import RunningEngine, vision_engine

__all__ = ["vision_engine"]

TEMPLATE = Path(localengine.__file__).parent / "templates" / "qwen3_vl.jinja"
TOOLS = [
    Tool(
        "click",
        "Click at a point of the screen",
        {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}},
    )
]
# (width, height) -> placeholders under the tiny model's processor settings, as vLLM 0.32
# expanded them (tests below prove each against the engine).
SIZES = {
    (32, 32): 64,  # under min_pixels: scaled up to 256x256
    (64, 48): 70,
    (200, 100): 72,
    (333, 517): 160,
    (100, 1000): 93,
    (1280, 800): 1000,  # a laptop screenshot
    (3000, 2000): 1014,  # over max_pixels: scaled down
}


def png(width: int, height: int, shade: int = 0) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (shade, 120, 200)).save(buffer, "PNG")
    return buffer.getvalue()


def image(width: int, height: int, shade: int = 0) -> ImageInput:
    return decode_image(png(width, height, shade))


@pytest.fixture(scope="module")
def vl_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real Qwen3 tokenizer with the Qwen3-VL template and processor settings tokenkeep's
    tiny model ships (no engine needed)."""
    target = tmp_path_factory.mktemp("qwen3-vl")
    source = qwen3_dir()
    for name in ("tokenizer.json", "vocab.json", "merges.txt"):
        shutil.copy(source / name, target / name)
    config = json.loads((source / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE.read_text()
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    (target / "preprocessor_config.json").write_text(json.dumps(localengine.QWEN3_VL_PREPROCESSOR))
    return target


def screenshot_conversation(a: ImageInput, b: ImageInput) -> list[Message]:
    return [
        Message("system", "You operate a desktop."),
        Message("user", f"Open the settings.{IMAGE_MARK}", images=[a]),
        Message("assistant", "", tool_calls=[]),
        Message("tool", f"clicked{IMAGE_MARK}done", tool_call_id="c1", images=[b]),
        Message("user", f"{IMAGE_MARK}{IMAGE_MARK}Compare the two.", images=[a, b]),
    ]


# --- no engine ---------------------------------------------------------------------------


def test_template_matches_the_qwen3_vl_renderer(vl_tokenizer_dir: Path) -> None:
    """The shipped template writes what renderers' hand-written Qwen3-VL renderer writes, token
    for token: system + tools, images in user and tool messages, parallel tool results."""
    from renderers.qwen3_vl import Qwen3VLRenderer

    tokenizer = load_tokenizer(str(vl_tokenizer_dir))
    renderer = Qwen3VLRenderer(tokenizer)
    messages = to_renderer_messages(screenshot_conversation(image(64, 48), image(200, 100)))
    messages.insert(4, {"role": "tool", "tool_call_id": "c2", "content": "second"})
    for tools in (to_renderer_tools(TOOLS), None):
        for generation in (True, False):
            ours = tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=generation, tokenize=True,
                return_dict=False,
            )  # fmt: skip
            theirs = renderer.render(
                messages, tools=tools, add_generation_prompt=generation, process_multimodal=False
            ).token_ids
            assert list(ours) == list(theirs)


def test_render_expands_each_image_to_its_placeholder_count(vl_tokenizer_dir: Path) -> None:
    model = ChatModel(load_tokenizer(str(vl_tokenizer_dir)))
    assert model.vision is not None
    a, b = image(1280, 800), image(200, 100, 1)
    ids, runs = model.render_prompt_runs(screenshot_conversation(a, b), TOOLS)
    pad = model.vision.pad_id
    assert [(r.sha256, r.length) for r in runs] == [
        (a.sha256, 1000), (b.sha256, 72), (a.sha256, 1000), (b.sha256, 72),
    ]  # fmt: skip
    for run in runs:
        assert ids[run.offset - 1] == model.vision.start_id
        assert ids[run.offset : run.offset + run.length] == [pad] * run.length
        assert ids[run.offset + run.length] == model.vision.end_id
    assert ids.count(pad) == 2144
    assert collapse(ids, runs).count(pad) == 4


@pytest.mark.parametrize(("size", "count"), SIZES.items())
def test_placeholder_count_follows_the_resize_rule(
    vl_tokenizer_dir: Path, size: tuple[int, int], count: int
) -> None:
    spec = vision_spec(vl_tokenizer_dir)
    assert spec is not None
    assert spec.placeholders(*size) == count


def test_images_refused_by_a_text_only_model() -> None:
    model = ChatModel(load_tokenizer(str(qwen3_dir())))
    assert model.vision is None
    with pytest.raises(ConversationError, match="takes no images"):
        model.render_prompt(
            [Message("user", f"what is this? {IMAGE_MARK}", images=[image(8, 8)])], []
        )


def test_bad_images_are_refused_with_a_reason() -> None:
    good = png(16, 16)
    with pytest.raises(ConversationError, match="cannot be decoded"):
        decode_image(good[:40])  # truncated
    with pytest.raises(ConversationError, match="cannot be decoded"):
        decode_image(b"not an image at all")
    bmp = io.BytesIO()
    Image.new("RGB", (4, 4)).save(bmp, "BMP")
    with pytest.raises(ConversationError, match="unsupported image format BMP"):
        decode_image(bmp.getvalue())
    with pytest.raises(ConversationError, match="'https' URLs are not fetched"):
        decode_data_url("https://example.com/a.png")
    with pytest.raises(ConversationError, match="not valid base64"):
        decode_base64("%%%")
    with pytest.raises(ImageTooLarge):
        decode_base64("A" * (30 << 20))
    with pytest.raises(ConversationError, match="aspect ratio"):
        decode_image(png(1000, 2))
    ok = decode_data_url("data:image/png;base64," + base64.b64encode(good).decode())
    assert (ok.width, ok.height, ok.mime) == (16, 16, "image/png")


def test_lineage_knows_an_image_by_its_bytes() -> None:
    a, b = image(64, 48), image(64, 48, 9)
    resent = decode_data_url(a.data_url)  # the harness re-encodes the same screenshot

    def key(img: ImageInput) -> str:
        convo = Conversation([Message("user", f"look{IMAGE_MARK}", images=[img])])
        return lineage(convo).input_key

    assert key(a) == key(resent)
    assert key(a) != key(b)


# --- the real engine ---------------------------------------------------------------------


def generate(engine: RunningEngine, ids: list[int], images: list[ImageInput], **extra: Any) -> Any:
    body: dict[str, Any] = {
        "model": engine.served_model_name,
        "token_ids": ids,
        "sampling_params": {"max_tokens": 6, "temperature": 1.0, "seed": 7},
        "return_token_ids": True,
        **extra,
    }
    if images:
        body["content_parts"] = content_parts(images)
    response = httpx.post(f"{engine.url}/inference/v1/generate", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.vllm
def test_engine_expands_images_as_tokenkeep_counts(vision_engine: RunningEngine) -> None:
    model = ChatModel(load_tokenizer(str(vision_engine.model_dir)))
    for (width, height), count in SIZES.items():
        img = image(width, height)
        ids, runs = model.render_prompt_runs(
            [Message("user", f"{IMAGE_MARK}what is on the screen?", images=[img])], []
        )
        assert [r.length for r in runs] == [count]
        out = generate(vision_engine, collapse(ids, runs), [img])
        assert out["prompt_token_ids"] == ids
        assert out["mm_placeholders"] == {"image": [{"offset": runs[0].offset, "length": count}]}


@pytest.mark.vllm
def test_engine_traps_tokenkeep_avoids(vision_engine: RunningEngine) -> None:
    """What the token-in endpoint does with the two wrong ways of sending images: silently
    a different prompt, never an error. tokenkeep sends neither (and checks the echo)."""
    model = ChatModel(load_tokenizer(str(vision_engine.model_dir)))
    assert model.vision is not None
    pad = model.vision.pad_id
    a, b = image(64, 48), image(200, 100, 1)
    ids, runs = model.render_prompt_runs(
        [Message("user", f"{IMAGE_MARK} then {IMAGE_MARK}", images=[a, b])], []
    )
    # Already-expanded ids + content_parts: the first pad is expanded again, the rest stay.
    twice = generate(vision_engine, ids, [a, b][:1])
    assert twice["prompt_token_ids"].count(pad) == 70 + 70 + 72 - 1
    assert echo_mismatch(ids, runs[:1], twice["prompt_token_ids"], twice["mm_placeholders"])
    # Only the new image: it lands on the first placeholder, the second pad stays a lone token.
    only_new = generate(vision_engine, collapse(ids, runs), [b])
    assert only_new["mm_placeholders"] == {"image": [{"offset": runs[0].offset, "length": 72}]}
    assert echo_mismatch(ids, runs, only_new["prompt_token_ids"], only_new["mm_placeholders"])
    # Both, collapsed: exactly tokenkeep's prompt.
    right = generate(vision_engine, collapse(ids, runs), [a, b])
    assert echo_mismatch(ids, runs, right["prompt_token_ids"], right["mm_placeholders"]) is None


def _stream(engine: RunningEngine, ids: list[int], images: list[ImageInput]) -> dict[str, Any]:
    """A streamed generate: the first chunk carries the expanded prompt and placeholders."""
    body = {
        "model": engine.served_model_name,
        "token_ids": ids,
        "sampling_params": {"max_tokens": 6, "temperature": 1.0, "seed": 7},
        "return_token_ids": True,
        "stream": True,
        "content_parts": content_parts(images),
    }
    first: dict[str, Any] = {}
    tokens: list[int] = []
    finish = None
    with httpx.stream(
        "POST", f"{engine.url}/inference/v1/generate", json=body, timeout=300
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "prompt_token_ids" in chunk and not first:
                first = chunk
            for choice in chunk.get("choices", []):
                tokens += choice.get("token_ids") or []
                finish = choice.get("finish_reason") or finish
    return {
        "prompt_token_ids": first.get("prompt_token_ids"),
        "mm_placeholders": first.get("mm_placeholders"),
        "choices": [{"token_ids": tokens, "finish_reason": finish}],
    }


@pytest.mark.vllm
@pytest.mark.parametrize("streamed", [False, True])
def test_multi_turn_screenshots_stay_token_exact(
    vision_engine: RunningEngine, streamed: bool
) -> None:
    """Turn 1 with a screenshot, turn 2 a tool result, turn 3 a new screenshot and the first
    one resent: each prompt is the previous prompt + its sampled tokens + the bridge, the
    engine receives every image and expands it where tokenkeep placed it, and no placeholder
    lies in a sampled span."""
    model = ChatModel(load_tokenizer(str(vision_engine.model_dir)))
    first, second = image(1280, 800), image(333, 517, 1)
    turns = [
        [Message("user", f"Open the settings.{IMAGE_MARK}", images=[first])],
        [Message("tool", '{"clicked": true}', tool_call_id="c1")],
        [Message("user", f"Now:{IMAGE_MARK} before:{IMAGE_MARK}", images=[second, first])],
    ]
    history: list[Message] = [Message("system", "You operate a desktop.")]
    prompt: list[int] = []
    completion: list[int] = []
    finish = "stop"
    runs: list[PlaceholderRun] = []
    images: list[ImageInput] = []
    sampled_spans: list[tuple[int, int]] = []
    for k, new in enumerate(turns):
        if k == 0:
            history += new
            prompt, runs = model.render_prompt_runs(history, TOOLS)
        else:
            bridge = model.bridge(prompt, completion, finish, history, new, TOOLS)
            assert bridge.delta is not None, bridge.refusal
            base = len(prompt) + len(completion)
            runs += [PlaceholderRun(r.sha256, base + r.offset, r.length) for r in bridge.runs]
            previous = prompt + completion
            prompt = previous + bridge.delta
            assert prompt[: len(previous)] == previous  # contiguity
            history += new
        images += [i for m in new for i in m.images]
        sent = collapse(prompt, runs)
        out = (_stream if streamed else generate)(vision_engine, sent, images)
        assert echo_mismatch(prompt, runs, out["prompt_token_ids"], out["mm_placeholders"]) is None
        completion = out["choices"][0]["token_ids"]
        finish = out["choices"][0]["finish_reason"]
        sampled_spans.append((len(prompt), len(prompt) + len(completion)))
        reply = model.parse(completion, finish, prompt, TOOLS).message
        history.append(reply)
    assert [r.length for r in runs] == [1000, 160, 1000]
    assert [r.sha256 for r in runs] == [first.sha256, second.sha256, first.sha256]
    for run in runs:  # placeholders are prompt (loss mask 0), never sampled
        assert all(run.offset + run.length <= s or run.offset >= e for s, e in sampled_spans)


def test_check_passes_on_the_qwen3_vl_template(vl_tokenizer_dir: Path) -> None:
    """`tokenkeep check` (text scenarios: the check drives no images yet) on the VL template:
    every run token-exact where a naive re-render breaks each."""
    from tests.check.test_check import assert_contiguous, run_cli

    family = ChatModel(load_tokenizer(str(vl_tokenizer_dir))).family
    report = assert_contiguous(run_cli("--tokenizer", str(vl_tokenizer_dir), "--json"), family)
    assert len(report["scenarios"]) == 36
    assert not any(row["naive_contiguous"] for row in report["scenarios"])
