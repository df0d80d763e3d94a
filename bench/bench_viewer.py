"""How long the rollout viewer takes to show a 128k-token session in a real browser.

A live session server (embedded store, real Qwen3 tokenizer) holds one session of
`--tokens` tokens in 32 turns (prompt deltas of text tokens, sampled completions with
logprobs); Debian's headless Chromium (Playwright, pointed at /usr/bin/chromium) opens
`/ui/sessions/<id>` and we time, per run:
- `json`: the session JSON the page fetches (server side: export + per-token pieces);
- `first tokens`: navigation start -> the first token on screen;
- `last block`: the page scrolled to the end -> the last token rendered (blocks of 1024
  tokens render only near the screen, so the page never builds 128k spans at once);
- `responsive`: while the page loads, the longest gap between two 50 ms timer ticks
  (the main thread's longest freeze).

Run: .venv/bin/python bench/bench_viewer.py [--tokens 131072] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.append(str(Path(__file__).resolve().parents[1]))
from session_server.app import build_service, create_app
from session_server.settings import Settings
from session_server.store.base import SessionMeta, TurnRecord
from tests.api.stack import qwen3
from tests.live_server import serving
from tests.real_tokenizers import qwen3_dir
from tests.viewer.test_browser import CHROMIUM_ARGS, chromium_path

TURNS = 32


async def fill(store: object, session_id: str, tokens: int) -> None:
    rng = random.Random(0)
    await store.create_session(  # type: ignore[attr-defined]
        SessionMeta(session_id=session_id, created_at=time.time(), ttl_seconds=None)
    )
    per_turn = tokens // TURNS
    parent = None
    for i in range(TURNS):
        prompt = [rng.randrange(200, 150000) for _ in range(per_turn * 3 // 4)]
        completion = [rng.randrange(200, 150000) for _ in range(per_turn - len(prompt))]
        record = TurnRecord(
            turn_id=0,
            parent_id=parent,
            segment_start=i == 0,
            kind="first" if i == 0 else "extend",
            break_reason=None,
            prompt_delta=prompt,
            completion_ids=completion,
            logprobs=[-rng.random() * 3 for _ in completion],
            finish_reason="stop",
        )
        (parent,) = await store.append_turns(session_id, [record], [[f"k{i}"]])  # type: ignore[attr-defined]


def measure(url: str, session_id: str, runs: int) -> dict[str, list[float]]:
    from playwright.sync_api import sync_playwright

    figures: dict[str, list[float]] = {"json": [], "first": [], "last": [], "freeze": []}
    for _ in range(runs):
        started = time.perf_counter()
        httpx.get(f"{url}/ui/api/sessions/{session_id}", timeout=120).raise_for_status()
        figures["json"].append(time.perf_counter() - started)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=chromium_path(), headless=True, args=CHROMIUM_ARGS
        )
        for _ in range(runs):
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.add_init_script(
                """window.__gaps = []; let last = performance.now();
                setInterval(() => { const now = performance.now();
                  window.__gaps.push(now - last); last = now; }, 50);"""
            )
            started = time.perf_counter()
            page.goto(f"{url}/ui/sessions/{session_id}")
            page.wait_for_selector(".tokens .t", timeout=120_000)
            figures["first"].append(time.perf_counter() - started)
            started = time.perf_counter()
            page.evaluate("() => window.scrollTo(0, document.body.scrollHeight)")
            last = page.locator(".tokens .block").last
            last.locator(".t").last.wait_for(timeout=120_000)
            figures["last"].append(time.perf_counter() - started)
            gaps = page.evaluate("() => window.__gaps")
            figures["freeze"].append(max(gaps) / 1000 - 0.05 if gaps else float("nan"))
            page.close()
        browser.close()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=131072)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    config = Settings(engine_urls=["http://127.0.0.1:9"], model="m", tokenizer=str(qwen3_dir()))
    service = build_service(config, model=qwen3())
    asyncio.run(fill(service.store, "big", args.tokens))
    with serving(create_app(config, service)) as url:
        figures = measure(url, "big", args.runs)
    names = {
        "json": "session JSON (export + pieces), server",
        "first": "navigation -> first tokens on screen",
        "last": "scroll to end -> last token rendered",
        "freeze": "longest main-thread freeze while loading",
    }
    print(f"{args.tokens} tokens, {TURNS} turns, {args.runs} runs (median, max)")
    for key, label in names.items():
        values = figures[key]
        print(f"  {label:45s} {statistics.median(values):6.2f} s  {max(values):6.2f} s")


if __name__ == "__main__":
    main()
