"""The viewer in a real browser: Debian's headless Chromium, driven by Playwright (which is
pointed at that executable and downloads nothing), against a live server's session."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.viewer.conftest import HOSTILE_USER, SAMPLED_ANSWER, Live, drive_rich_session

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("TOKENKEEP_ARTIFACTS", REPO / ".artifacts"))
# As the machine's own browser checks start it: no sandbox as root, nothing phoning home.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium_path() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        message = "Debian's chromium is not installed (apt-get install chromium)"
        if os.environ.get("CI"):
            pytest.fail(message)  # CI installs it (Makefile `browser`): missing is a failure
        pytest.skip(message)
    return path


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    from playwright.sync_api import sync_playwright

    executable = chromium_path()
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(
            executable_path=executable, headless=True, args=CHROMIUM_ARGS
        )
        try:
            yield launched
        finally:
            launched.close()


@pytest.fixture(scope="module")
def rich(live: Live) -> str:
    drive_rich_session(live, "viewer-browser")
    return "viewer-browser"


def test_session_page_shows_tokens_breaks_and_stays_inert(
    browser: object, live: Live, rich: str
) -> None:
    page = browser.new_page(viewport={"width": 1400, "height": 1000})  # type: ignore[attr-defined]
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(f"{live.url}/ui/sessions/{rich}")
    page.wait_for_selector(".t.s")

    # The newest branch: the harness rewrote the answer, so a second segment starts.
    reason = page.locator(".segment-head.break .reason").first.text_content()
    assert reason == "new segment: assistant_message_not_sampled"
    sampled = "".join(page.locator(".tokens .t.s").all_text_contents())
    assert '{"name": "get_weather", "arguments": {"city":"Paris"}}' in sampled
    assert sampled.endswith("Noted.<|im_end|>")
    context = "".join(page.locator(".tokens .t.c").all_text_contents())
    assert "It was sunny (edited by the harness)." in context
    assert HOSTILE_USER in context

    # The first branch holds the answer as sampled: its markup is text and runs nothing.
    page.select_option("#branch", "0")
    page.wait_for_selector(".tokens .t.s")
    sampled = "".join(page.locator(".tokens .t.s").all_text_contents())
    assert "".join(SAMPLED_ANSWER) in sampled
    assert page.locator(".segment-head.break").count() == 0
    assert page.evaluate("() => window.__pwned") is None
    assert page.locator("img").count() == 0 and page.locator("main script").count() == 0
    page.select_option("#branch", "2")
    page.wait_for_selector(".segment-head.break")
    styles = page.evaluate(
        """() => ['.t.s', '.t.c', '.t.sp'].map(
            (s) => getComputedStyle(document.querySelector(s)).backgroundColor)"""
    )
    assert len(set(styles)) == 3, styles  # sampled, context and special tokens look apart
    assert page.locator("nav.tree button.turn").count() == 4

    page.locator(".tokens .t.s").first.hover()
    detail = page.locator("#detail").text_content() or ""
    assert "token id" in detail and "yes (loss 1)" in detail and "turn#" in detail.replace(" ", "")

    page.locator("#next-break").click()
    assert page.locator(".segment-head.current").count() == 1
    page.locator("#logprob-colours").check()
    page.wait_for_selector(".t.s[style*='background']")

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "viewer-session.png"), full_page=False)
    assert errors == []
    page.close()


def test_list_page_links_to_the_session(browser: object, live: Live, rich: str) -> None:
    page = browser.new_page()  # type: ignore[attr-defined]
    page.goto(f"{live.url}/ui/?q={rich}")
    link = page.locator(f"table.sessions a[href='/ui/sessions/{rich}']")
    link.wait_for()
    row = page.locator("table.sessions tbody tr").first.text_content() or ""
    assert "assistant_message_not_sampled" in row
    link.click()
    page.wait_for_selector(".segment-head")
    assert page.url.endswith(f"/ui/sessions/{rich}")
    page.screenshot(path=str(ARTIFACTS / "viewer-list.png"))
    page.close()
