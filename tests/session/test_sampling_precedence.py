"""Sampling precedence across all four layers, through the whole server: the model's
`generation_config.json` < what the harness sends < server-wide overrides < the session's
overrides. Each row of the table says which layers are present and what the engine must get."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from session_server.splice import ChatModel
from session_server.tokenizer import load_tokenizer
from tests.engine_double import EngineDouble, ScriptedCompletion
from tests.real_tokenizers import qwen3_dir
from tests.session.adversarial import END, tokens
from tests.session.conftest import Stack, make_stack

GENERATION_CONFIG = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05}
SERVER = {"temperature": 0.7, "top_p": 0.9, "top_k": 30}
HARNESS = {"temperature": 0.8, "top_p": 0.85, "seed": 7}
SESSION = {"temperature": 0.9}
NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0}
"""What the engine gets where no layer says anything (vLLM's own neutral values)."""


@dataclass(frozen=True)
class Row:
    name: str
    layers: frozenset[str]
    expected: dict[str, Any]
    absent: tuple[str, ...] = field(default=())


TABLE = [
    Row("no layer: neutral values", frozenset(), NEUTRAL, ("repetition_penalty",)),
    Row(
        "generation_config only",
        frozenset({"generation_config"}),
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05},
    ),
    Row(
        "harness over generation_config",
        frozenset({"generation_config", "harness"}),
        {"temperature": 0.8, "top_p": 0.85, "top_k": 20, "repetition_penalty": 1.05},
    ),
    Row(
        "server over harness",
        frozenset({"harness", "server"}),
        {"temperature": 0.7, "top_p": 0.9, "top_k": 30, "min_p": 0.0},
        ("repetition_penalty",),
    ),
    Row(
        "server over generation_config",
        frozenset({"generation_config", "server"}),
        {"temperature": 0.7, "top_p": 0.9, "top_k": 30, "repetition_penalty": 1.05},
    ),
    Row(
        "session over server",
        frozenset({"server", "session"}),
        {"temperature": 0.9, "top_p": 0.9, "top_k": 30},
    ),
    Row(
        "session over harness",
        frozenset({"harness", "session"}),
        {"temperature": 0.9, "top_p": 0.85, "top_k": -1},
    ),
    Row(
        "all four: each key from the highest layer that sets it",
        frozenset({"generation_config", "harness", "server", "session"}),
        {"temperature": 0.9, "top_p": 0.9, "seed": 7, "top_k": 30, "repetition_penalty": 1.05},
    ),
]


@pytest.fixture(scope="module")
def generation_config_model(tmp_path_factory: pytest.TempPathFactory) -> ChatModel:
    """The real Qwen3 tokenizer in a model directory that also has a generation config."""
    directory = tmp_path_factory.mktemp("model")
    for source in Path(qwen3_dir()).iterdir():
        shutil.copy2(source, directory / source.name)
    (directory / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    return ChatModel(load_tokenizer(str(directory)))


@pytest.fixture
def row_stack(
    request: pytest.FixtureRequest,
    generation_config_model: ChatModel,
    qwen3_model: ChatModel,
    engine_double: EngineDouble,
) -> Iterator[Stack]:
    row: Row = request.param
    model = generation_config_model if "generation_config" in row.layers else qwen3_model
    overrides = SERVER if "server" in row.layers else {}
    yield from make_stack(model, engine_double, "memory", None, sampling_overrides=overrides)


@pytest.mark.parametrize("row_stack", TABLE, ids=[r.name for r in TABLE], indirect=True)
def test_each_layer_wins_over_the_ones_below(row_stack: Stack, request: Any) -> None:
    row: Row = request.node.callspec.params["row_stack"]
    with row_stack.http() as http:
        body: dict[str, Any] = {"id": "precedence"}
        if "session" in row.layers:
            body["sampling"] = SESSION
        assert http.post("/sessions", json=body).status_code == 201
    row_stack.double.script(ScriptedCompletion(tokens(row_stack.model, "Hi", END)))
    row_stack.openai("precedence").chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Hello"}],
        **(HARNESS if "harness" in row.layers else {}),
    )
    sent = row_stack.double.requests[-1].sampling
    assert {key: sent.get(key) for key in row.expected} == row.expected
    for key in row.absent:
        assert key not in sent
