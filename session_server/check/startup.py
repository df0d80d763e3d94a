"""The start-up check of `tokenkeep serve`: the quick scenarios, cached per tokenizer and
template."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import Callable
from pathlib import Path

from session_server import __version__
from session_server.check.report import path_label
from session_server.check.run import run_check
from session_server.check.scenarios import SCENARIOS
from session_server.splice import ChatModel

log = logging.getLogger("tokenkeep.check")


def cache_key(model: ChatModel) -> str:
    digest = hashlib.sha256()
    folder = Path(str(model.tokenizer.name_or_path))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (folder / name).is_file():
            digest.update((folder / name).read_bytes())
    digest.update(str(model.tokenizer.chat_template).encode())
    digest.update(f"{model.family}|{model.template_bridge}|{__version__}".encode())
    return digest.hexdigest()[:32]


def startup_check(
    model: ChatModel,
    cache_dir: Path,
    on_verdict: Callable[[bool], None],
    on_replies: Callable[[bool | None, bool | None], None] | None = None,
) -> bool:
    """The quick scenarios over Chat Completions, streamed and not, cached per tokenizer +
    template hash; logs the verdict and hands it to `on_verdict` (token-exact) and
    `on_replies` (tool calls parsed as calls, streamed = non-streamed; None: not measured)."""
    cache = cache_dir / f"{cache_key(model)}.json"
    cached = False
    try:
        data = json.loads(cache.read_text())
        cached = True
    except (OSError, ValueError):
        report = asyncio.run(
            run_check(model, scenarios=[s for s in SCENARIOS if s.quick], apis=("chat",))
        )
        data = report.as_json()
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
            cache.write_text(json.dumps(data))
        except OSError as exc:
            log.warning("start-up check: cannot cache the result in %s: %s", cache_dir, exc)
    broken = [s["name"] for s in data["scenarios"] if not s["contiguous"]]
    source = " (cached)" if cached else ""
    parsed, streams = data.get("tool_calls_parsed"), data.get("stream_equal")
    if data["contiguous"]:
        log.info(
            "start-up check%s: token-exact on %d scenarios, path %s (%s)",
            source,
            len(data["scenarios"]),
            path_label(model.family),
            model.path.reason,
        )
    else:
        log.warning(
            "start-up check%s: tokenkeep BREAKS contiguity on %s (path %s); run `tokenkeep check`",
            source,
            ", ".join(broken) or "every scenario",
            path_label(model.family),
        )
    if parsed is False:
        log.warning(
            "start-up check%s: tool calls in this model's syntax reach the harness as TEXT on "
            "path %s; run `tokenkeep check`",
            source,
            path_label(model.family),
        )
    if streams is False:
        log.warning(
            "start-up check%s: streamed replies differ from non-streamed ones on path %s; "
            "run `tokenkeep check`",
            source,
            path_label(model.family),
        )
    on_verdict(bool(data["contiguous"]))
    if on_replies is not None:
        on_replies(parsed, streams)
    return bool(data["contiguous"])
