"""Token ids a model can sample run to its output layer's size (config.json `vocab_size`),
past the tokenizer's entries on most models (Qwen3: 151,936 for 151,669). The engine-reply
check (issue 33) first bounded replies by the tokenizer, and `demo --train`'s random model,
which samples the padding now and then, lost rollouts to 502s. The engine double stands in
for vLLM."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from session_server.splice import ChatModel
from session_server.tokenizer import load_tokenizer
from tests.engine_double import EngineDouble, ScriptedCompletion
from tests.real_tokenizers import qwen3_dir
from tests.session.conftest import Stack, make_stack

OUTPUT_LAYER = 151_936
END = 151_645  # <|im_end|>


@pytest.fixture
def padded(tmp_path: Path, engine_double: EngineDouble) -> Iterator[Stack]:
    folder = tmp_path / "model"
    shutil.copytree(qwen3_dir(), folder)
    (folder / "config.json").write_text(json.dumps({"vocab_size": OUTPUT_LAYER}))
    model = ChatModel(load_tokenizer(str(folder)))
    yield from make_stack(model, engine_double, "memory", None)


def test_the_output_layer_bounds_what_the_engine_may_sample(padded: Stack) -> None:
    assert padded.model.vocab_size < OUTPUT_LAYER == padded.model.output_size
    padding = padded.model.vocab_size + 5
    padded.double.script(ScriptedCompletion([562, padding, END]))
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with padded.http() as http:
        sampled = http.post("/sessions/pad/v1/chat/completions", json=body)
        assert sampled.status_code == 200, sampled.text
        tokens = padded.trajectory("pad")["branches"][0]["segments"][0]["token_ids"]
        assert tokens[-3:] == [562, padding, END]  # kept as sampled
        padded.double.script(ScriptedCompletion([562, OUTPUT_LAYER, END]))
        beyond = http.post("/sessions/past/v1/chat/completions", json=body)
        assert beyond.status_code == 502, beyond.text
        assert http.get("/sessions/past/trajectory").json()["branches"] == []


def test_without_a_config_the_tokenizer_bounds_it() -> None:
    model = ChatModel(load_tokenizer(str(qwen3_dir())))
    assert model.output_size == model.vocab_size
