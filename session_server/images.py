"""Images in a conversation: decoding what clients send, content hashes, placeholder counts.

A vision-language model sees an image as a run of placeholder tokens (Qwen-VL:
`<|vision_start|>` + N x `<|image_pad|>` + `<|vision_end|>`), and N is a pure function of the
image's size and the model's processor settings: the processor resizes the image so both
sides are multiples of `patch_size * merge_size` and its area lies in [min_pixels,
max_pixels] (Qwen2-VL's `smart_resize`, which vLLM and transformers both use), cuts it into
`patch_size` patches and merges `merge_size**2` patches into one token. tokenkeep computes N
itself, so a prompt with images is known token for token before the engine sees it; the
engine's expanded prompt is then compared with it (`check_expanded`).

An image is named by the SHA-256 of its bytes: a harness that resends the same screenshot
sends the same image, whatever the data URL around it looked like.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from session_server.conversation import IMAGE_MARK, ConversationError, Message

# What the engine's image loader decodes and every harness sends; others are refused, not
# converted (a conversion would be an image the client never sent).
SUPPORTED_FORMATS = {
    "PNG": "image/png",
    "JPEG": "image/jpeg",
    "WEBP": "image/webp",
    "GIF": "image/gif",
}
MAX_IMAGE_BYTES = 20 << 20
# Read from the image's header before a pixel is decoded: a few KB of PNG can declare 8192 x
# 8192 pixels (a decompression bomb: a second of CPU and hundreds of MB to decode). 32 Mi
# pixels still takes an 8K (7680 x 4320) screenshot; the processor resizes far below it.
MAX_IMAGE_PIXELS = 32 << 20
MAX_ASPECT_RATIO = 200  # the processor refuses more extreme shapes


MAX_IMAGES_PER_REQUEST = 64
TEXT_ONLY = "the served model takes no images (text-only)"


class ImageTooLarge(ConversationError):
    """An image over the byte limit (HTTP 413 in every front-end)."""

    status = 413


@dataclass(frozen=True, slots=True)
class ImageInput:
    """One image as a client sent it (its header read; its pixels decoded by `verify`)."""

    data: bytes
    mime: str
    width: int
    height: int
    sha256: str

    @property
    def data_url(self) -> str:
        return f"data:{self.mime};base64,{base64.b64encode(self.data).decode('ascii')}"


# Harnesses resend every screenshot of the history on every turn: bytes already decoded are
# known by their hash (a digest: 64 characters a key, however big the image) and not decoded
# again (bounded; oldest forgotten first).
_KNOWN_IMAGES: dict[str, None] = {}
_KNOWN_MAX = 1024


def read_image(data: bytes, *, param: str | None = None) -> ImageInput:
    """Check and describe image bytes from their header only (no pixel is decoded): a
    supported format within the limits. `verify` decodes them."""
    if len(data) > MAX_IMAGE_BYTES:
        raise ImageTooLarge(
            f"image is {len(data)} bytes; at most {MAX_IMAGE_BYTES} bytes", param=param
        )
    try:
        with Image.open(io.BytesIO(data)) as image:
            fmt = image.format or ""
            width, height = image.size
    # PIL refuses sizes far over its own bound at open (DecompressionBombError) and may be
    # made to raise its warning: both are a client's image, not a server error.
    except (
        UnidentifiedImageError,
        OSError,
        SyntaxError,
        ValueError,
        Image.DecompressionBombError,
        Image.DecompressionBombWarning,
    ) as exc:
        raise ConversationError(f"image cannot be decoded: {exc}", param=param) from exc
    if fmt not in SUPPORTED_FORMATS:
        raise ConversationError(
            f"unsupported image format {fmt or 'unknown'}; send "
            f"{', '.join(sorted(SUPPORTED_FORMATS))}",
            param=param,
        )
    if width * height > MAX_IMAGE_PIXELS:
        raise ConversationError(
            f"image is {width}x{height}; at most {MAX_IMAGE_PIXELS} pixels", param=param
        )
    if min(width, height) < 1 or max(width, height) / min(width, height) > MAX_ASPECT_RATIO:
        raise ConversationError(
            f"image is {width}x{height}; the aspect ratio must be under {MAX_ASPECT_RATIO}",
            param=param,
        )
    sha256 = hashlib.sha256(data).hexdigest()
    return ImageInput(data, SUPPORTED_FORMATS[fmt], width, height, sha256)


def verify(images: list[ImageInput]) -> None:
    """Decode each image not decoded before: a truncated or corrupt body fails here, not in
    the engine. CPU-bound (PIL releases the GIL while it decodes): run it off the event
    loop, and only for a request that passed every cheaper check."""
    for image in images:
        if image.sha256 in _KNOWN_IMAGES:
            continue
        try:
            with Image.open(io.BytesIO(image.data)) as opened:
                opened.load()
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
            raise ConversationError(f"image cannot be decoded: {exc}", param="messages") from exc
        if len(_KNOWN_IMAGES) >= _KNOWN_MAX:
            # Requests verify in worker threads: another may have forgotten it already.
            _KNOWN_IMAGES.pop(next(iter(_KNOWN_IMAGES), ""), None)
        _KNOWN_IMAGES[image.sha256] = None


def decode_image(data: bytes, *, param: str | None = None) -> ImageInput:
    """Check, describe and decode image bytes (`read_image`, then `verify`)."""
    image = read_image(data, param=param)
    verify([image])
    return image


def image_media_type(data: bytes) -> str:
    """The media type of stored image bytes (checked when they came in)."""
    with Image.open(io.BytesIO(data)) as image:
        return SUPPORTED_FORMATS.get(image.format or "", "application/octet-stream")


def thumbnail_data_url(data: bytes, max_side: int = 96) -> str:
    """A small JPEG of stored image bytes, as a data: URL (the viewer's thumbnail)."""
    with Image.open(io.BytesIO(data)) as image:
        small = image.convert("RGB")
        small.thumbnail((max_side, max_side))
    buffer = io.BytesIO()
    small.save(buffer, "JPEG", quality=80)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def decode_data_url(url: str, *, param: str | None = None) -> ImageInput:
    """An image from a `data:image/...;base64,...` URL. Remote URLs are refused: tokenkeep does
    not fetch (a rollout must not depend on what a server returns later)."""
    if not url.startswith("data:"):
        scheme = url.split(":", 1)[0] if ":" in url else "(none)"
        raise ConversationError(
            f"image URLs must be data: URLs (base64); {scheme!r} URLs are not fetched",
            param=param,
        )
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise ConversationError("image data: URLs must be base64-encoded", param=param)
    return decode_base64(payload, param=param)


def no_marks(text: str, param: str) -> str:
    """Client text, refused if it holds the character tokenkeep marks images with."""
    if IMAGE_MARK in text:
        raise ConversationError("text must not contain U+FFFC", param=param)
    return text


def compose(pieces: list[str | ImageInput], separator: str) -> tuple[str, list[ImageInput]]:
    """A message's content from its parts in order: texts joined by `separator` (as each
    API joins adjacent text parts), an `IMAGE_MARK` where each image is."""
    text: list[str] = []
    images: list[ImageInput] = []
    previous_text = False
    for piece in pieces:
        if isinstance(piece, str):
            text.append((separator if previous_text else "") + piece)
            previous_text = True
        else:
            images.append(piece)
            text.append(IMAGE_MARK)
            previous_text = False
    return "".join(text), images


def check_count(messages: list[Message]) -> None:
    count = sum(len(m.images) for m in messages)
    if count > MAX_IMAGES_PER_REQUEST:
        raise ConversationError(
            f"{count} images in one request; at most {MAX_IMAGES_PER_REQUEST}", param="messages"
        )


async def admit(messages: list[Message], takes_images: bool) -> None:
    """A converted request's images, before any of their pixels is decoded: refused for a
    text-only model, then decoded in a worker thread (what the front-ends read so far is
    each image's header, and their count is checked)."""
    images = [image for m in messages for image in m.images]
    if not images:
        return
    if not takes_images:
        raise ConversationError(TEXT_ONLY, param="messages")
    await asyncio.to_thread(verify, images)


def decode_base64(payload: str, *, param: str | None = None) -> ImageInput:
    if len(payload) > (MAX_IMAGE_BYTES * 4) // 3 + 4:
        raise ImageTooLarge(f"image is over {MAX_IMAGE_BYTES} bytes", param=param)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ConversationError(f"image is not valid base64: {exc}", param=param) from exc
    return read_image(data, param=param)


@dataclass(frozen=True, slots=True)
class VisionSpec:
    """What decides placeholder counts, read from the served model's own files."""

    patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    image_token: str = "<|image_pad|>"
    start_token: str = "<|vision_start|>"
    end_token: str = "<|vision_end|>"

    def placeholders(self, width: int, height: int) -> int:
        """How many image tokens the processor makes of a width x height image."""
        resized_height, resized_width = smart_resize(
            height, width, self.patch_size * self.merge_size, self.min_pixels, self.max_pixels
        )
        patches = (resized_height // self.patch_size) * (resized_width // self.patch_size)
        return patches // (self.merge_size**2)


def vision_spec(model_dir: str | Path) -> VisionSpec | None:
    """The model's image processor settings (Qwen2-VL / Qwen3-VL `preprocessor_config.json`),
    or None for a model without one (a text-only model)."""
    path = Path(model_dir) / "preprocessor_config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text())
    size = config.get("size") or {}
    # Qwen3-VL writes the pixel bounds under `size`; Qwen2-VL checkpoints as min/max_pixels.
    min_pixels = size.get("shortest_edge", config.get("min_pixels"))
    max_pixels = size.get("longest_edge", config.get("max_pixels"))
    if not (config.get("patch_size") and min_pixels and max_pixels):
        return None
    return VisionSpec(
        patch_size=int(config["patch_size"]),
        merge_size=int(config.get("merge_size", 2)),
        min_pixels=int(min_pixels),
        max_pixels=int(max_pixels),
    )


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Qwen2-VL's resize rule: sides rounded to multiples of `factor`, the area brought into
    [min_pixels, max_pixels] keeping the aspect ratio. Python's `round` (half to even) is the
    processor's too."""
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


# --- placeholder runs in token sequences ------------------------------------------------


@dataclass(frozen=True, slots=True)
class PlaceholderRun:
    """Where one image's placeholder tokens sit in a token sequence."""

    sha256: str
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class VisionTokens:
    spec: VisionSpec
    start_id: int
    pad_id: int
    end_id: int


def vision_tokens(spec: VisionSpec | None, vocab: dict[str, int]) -> VisionTokens | None:
    if spec is None:
        return None
    ids = [vocab.get(t) for t in (spec.start_token, spec.image_token, spec.end_token)]
    if any(i is None for i in ids):
        return None
    start, pad, end = ids
    assert start is not None and pad is not None and end is not None
    return VisionTokens(spec, start, pad, end)


def expand(
    ids: list[int], images: list[ImageInput], vision: VisionTokens
) -> tuple[list[int], list[PlaceholderRun]]:
    """A rendered prompt (the chat template writes one pad per image: `start pad end`) with
    each image's pad repeated as often as the processor makes tokens of that image. `images`
    are the rendered messages' images in order; their runs' offsets are in the result."""
    out: list[int] = []
    runs: list[PlaceholderRun] = []
    position = 0
    for i, token in enumerate(ids):
        if (
            token == vision.pad_id
            and i > 0
            and ids[i - 1] == vision.start_id
            and i + 1 < len(ids)
            and ids[i + 1] == vision.end_id
        ):
            if position >= len(images):
                raise ValueError("the template wrote more image placeholders than images")
            image = images[position]
            length = vision.spec.placeholders(image.width, image.height)
            runs.append(PlaceholderRun(image.sha256, len(out), length))
            out.extend([vision.pad_id] * length)
            position += 1
        else:
            out.append(token)
    if position != len(images):
        raise ValueError(f"the template wrote {position} image placeholders for {len(images)}")
    return out, runs


def collapse(ids: list[int], runs: list[PlaceholderRun]) -> list[int]:
    """The prompt as vLLM's token-in endpoint takes it with `content_parts`: one pad per
    image (vLLM expands each, in order). Sending the expanded ids would expand them again."""
    out: list[int] = []
    position = 0
    for run in sorted(runs, key=lambda r: r.offset):
        out.extend(ids[position : run.offset + 1])
        position = run.offset + run.length
    out.extend(ids[position:])
    return out


def content_parts(images: list[ImageInput]) -> list[dict[str, str]]:
    """Every image of the prompt, in order (vLLM assigns the i-th part to the i-th pad; only
    the new ones would land on the first pads). The hash is vLLM's multimodal uuid: its
    processor cache then skips re-processing an image it has seen."""
    return [{"type": "image_url", "url": i.data_url, "uuid": i.sha256} for i in images]


def echo_mismatch(
    sent: list[int],
    runs: list[PlaceholderRun],
    echoed_ids: list[int] | None,
    echoed_placeholders: dict[str, list[dict[str, int]]] | None,
) -> str | None:
    """Why the engine's expanded prompt is not the one tokenkeep computed, or None."""
    if echoed_ids is not None and echoed_ids != sent:
        return "the engine expanded the images to a different prompt"
    got = [(p["offset"], p["length"]) for p in (echoed_placeholders or {}).get("image", [])]
    want = [(r.offset, r.length) for r in sorted(runs, key=lambda r: r.offset)]
    if got != want:
        return f"the engine placed images at {got}, tokenkeep at {want}"
    return None


def scan_runs(ids: list[int], vision: VisionTokens) -> list[tuple[int, int]]:
    """(offset, length) of every placeholder run (`start pad... end`) in a token sequence."""
    runs: list[tuple[int, int]] = []
    i, n = 0, len(ids)
    while True:
        try:
            i = ids.index(vision.start_id, i)
        except ValueError:
            break
        j = i + 1
        while j < n and ids[j] == vision.pad_id:
            j += 1
        if j > i + 1 and j < n and ids[j] == vision.end_id:
            runs.append((i + 1, j - i - 1))
        i = max(j, i + 1)
    return runs


@dataclass(frozen=True, slots=True)
class PromptImage:
    """An image a prompt holds, as tokenkeep knows it before its bytes are at hand: from the
    request, or from a stored turn's record (`extra.images`)."""

    sha256: str
    length: int
    width: int
    height: int


def place(ids: list[int], images: list[PromptImage], vision: VisionTokens) -> list[PlaceholderRun]:
    """The placeholder runs of a prompt, matched to the images it holds in order. A prompt
    whose runs are not exactly these images is refused: the engine would see pads without
    pictures (or pictures on the wrong pads)."""
    runs = scan_runs(ids, vision)
    if [length for _, length in runs] != [image.length for image in images]:
        raise ConversationError(
            f"the prompt holds {len(runs)} image placeholder run(s) and tokenkeep knows "
            f"{len(images)} image(s) for it; send the conversation again with every image, "
            "in order",
            param="messages",
        )
    return [
        PlaceholderRun(image.sha256, offset, length)
        for image, (offset, length) in zip(images, runs, strict=True)
    ]


def prompt_image(image: ImageInput, spec: VisionSpec) -> PromptImage:
    return PromptImage(
        image.sha256, spec.placeholders(image.width, image.height), image.width, image.height
    )
