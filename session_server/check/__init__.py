"""`tokenkeep check`: will this model's rollouts stay token-exact through tokenkeep?

The check loads the tokenizer and chat template as `tokenkeep serve` does, then drives a
corpus of multi-turn scenarios through the real serving path in-process: the ASGI app (each
API, streamed and not) -> TurnService -> splice, in front of `ScriptedEngine`, an in-process
implementation of the engine-client interface that "samples" scripted completions.

The completions come from the model's own chat template: an assistant message (text,
reasoning, a tool call) is rendered by the template, the text after the generation prompt is
cut at the end-of-turn token and tokenized *non-canonically* (canonical tokens split into
sub-word pieces that are in the vocabulary, literal markers spelled byte by byte, a UTF-8
character cut in half, a turn cut by max_tokens). So every family gets completions in its own
syntax, and the kind a real sampler produces but a re-tokenizer never gives back.

Per scenario it compares what the engine received on each later turn with what was stored
(prompt + sampled tokens) before: tokenkeep keeps them contiguous or records why not. It does
the same for a naive server that re-renders the whole history with the template each turn.

The package: `scenarios` (the corpus and the `Scripter` that spells completions), `engine`
(`ScriptedEngine`), `harnesses` (one per API), `run` (`run_check`), `report` (rows, verdict,
text), `startup` (the cached start-up check of `serve`), `cli` (`tokenkeep check`).
"""

from session_server.check.cli import main
from session_server.check.engine import ScriptedEngine
from session_server.check.report import Report, Row, format_report
from session_server.check.run import CheckInputError, load_model, run_check
from session_server.check.scenarios import (
    FIRST_USER,
    SCENARIOS,
    TOOL,
    TOOL_RESULT,
    Scenario,
    Scripter,
    byte_level_chars,
)
from session_server.check.startup import startup_check

__all__ = [
    "FIRST_USER",
    "SCENARIOS",
    "TOOL",
    "TOOL_RESULT",
    "CheckInputError",
    "Report",
    "Row",
    "Scenario",
    "ScriptedEngine",
    "Scripter",
    "byte_level_chars",
    "format_report",
    "load_model",
    "main",
    "run_check",
    "startup_check",
]
