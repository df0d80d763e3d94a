"""Images: placeholder counts per image size and the latency an image adds, on the real vLLM CPU
engine serving tiny-qwen3-vl, side by side in one run (the machine is shared: read ratios).

For each size: the same one-turn prompt with the image (one pad + `content_parts`, as tokenkeep
sends it) and without it (text only), 1 sampled token, median of `--repeat` runs each; plus
tokenkeep's own work per image in-process (decode + SHA-256 + count + data URL). Writes
bench/results/vision.md.

    .venv/bin/python bench/bench_vision.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import time
from pathlib import Path

import httpx
from PIL import Image

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from session_server.conversation import IMAGE_MARK, Message  # noqa: E402
from session_server.devtools import localengine  # noqa: E402
from session_server.images import collapse, content_parts, decode_image  # noqa: E402
from session_server.splice import ChatModel  # noqa: E402
from session_server.tokenizer import load_tokenizer  # noqa: E402

SIZES = [(64, 48), (333, 517), (640, 400), (1280, 800), (1920, 1080), (3000, 2000)]


def noisy_png(width: int, height: int) -> bytes:
    """A screenshot-like image that does not compress to nothing."""
    image = Image.effect_noise((width, height), 64).convert("RGB")
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def timed(client: httpx.Client, body: dict[str, object]) -> float:
    started = time.perf_counter()
    response = client.post("/inference/v1/generate", json=body)
    response.raise_for_status()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--url", help="a running tiny-qwen3-vl engine (default: start one)")
    args = parser.parse_args()
    name = localengine.VISION_MODEL_NAME
    engine = None if args.url else localengine.start(name)
    url = args.url or engine.url  # type: ignore[union-attr]
    served = localengine.served_name(name)
    rows = []
    try:
        model = ChatModel(load_tokenizer(str(localengine.build_model(name))))
        client = httpx.Client(base_url=url, timeout=600)
        params = {"max_tokens": 1, "temperature": 0}
        for width, height in SIZES:
            data = noisy_png(width, height)
            started = time.perf_counter()
            image = decode_image(data)
            parts = content_parts([image])
            own_ms = (time.perf_counter() - started) * 1000
            ids, runs = model.render_prompt_runs(
                [Message("user", f"{IMAGE_MARK}describe", images=[image])], []
            )
            text_ids, _ = model.render_prompt_runs([Message("user", "describe")], [])
            with_image = {
                "model": served,
                "token_ids": collapse(ids, runs),
                "content_parts": parts,
                "sampling_params": params,
            }
            text_only = {
                "model": served,
                "token_ids": text_ids,
                "sampling_params": params,
            }
            timed(client, with_image)  # warm-up (and vLLM's processor cache learns the uuid)
            pairs = [
                (timed(client, text_only), timed(client, with_image)) for _ in range(args.repeat)
            ]
            # A fresh uuid each time: the image is processed again (no processor cache hit).
            cold = []
            for i in range(args.repeat):
                fresh = [{**parts[0], "uuid": f"{image.sha256}-{i}-{time.time_ns()}"}]
                cold.append(timed(client, {**with_image, "content_parts": fresh}))
            rows.append(
                (
                    f"{width}x{height}",
                    runs[0].length,
                    len(data),
                    own_ms,
                    statistics.median(p[0] for p in pairs) * 1000,
                    statistics.median(p[1] for p in pairs) * 1000,
                    statistics.median(cold) * 1000,
                )
            )
            print(rows[-1], flush=True)
    finally:
        if engine is not None:
            engine.stop()
    load = os.getloadavg()
    lines = [
        "# Images: placeholder counts and added latency (tiny-qwen3-vl, vLLM CPU 0.32)",
        "",
        f"`bench/bench_vision.py --repeat {args.repeat}`, {time.strftime('%Y-%m-%d')}, 2-core "
        f"machine shared with other work (load average {load[0]:.1f} / {load[1]:.1f} / "
        f"{load[2]:.1f} at the end): compare within a row. One sampled token; medians.",
        "*text only*: the same prompt without the image; *image*: with it, the image known to "
        "vLLM's processor cache (same uuid; the prompt's KV blocks may be cached too, as the "
        "earlier images of a rollout are); *image, new uuid*: processed and prefilled again (a "
        "new screenshot). *tokenkeep*: decode + SHA-256 + placeholder count + data URL on "
        "first sight (noise images: large PNGs); a resent image is only hashed.",
        "",
        "| image | placeholders | PNG bytes | tokenkeep ms | text only ms | image ms "
        "| image, new uuid ms |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for size, count, size_bytes, own, text, cached, cold in rows:
        lines.append(
            f"| {size} | {count} | {size_bytes} | {own:.1f} | {text:.0f} | {cached:.0f} "
            f"| {cold:.0f} |"
        )
    out = REPO / "bench" / "results" / "vision.md"
    out.write_text("\n".join(lines) + "\n")
    print(out.read_text())


if __name__ == "__main__":
    main()
