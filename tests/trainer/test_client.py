"""The `tokenkeep` client, sync and async, against a live server (real HTTP on a loopback
port, both stores, the engine double behind it), and the batch export's bad input."""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import openai
import pytest

from tests.session.conftest import Stack
from tests.trainer.test_weight_versions import said
from tests.trajectory_values import assert_trajectory_values
from tokenkeep import AsyncClient, Batch, Client, TokenkeepError, Trajectory


def as_exported(trajectory: Trajectory) -> dict[str, Any]:
    """The client's typed trajectory, read through the arrays a trainer uses, in the export's
    JSON shape for `assert_trajectory_values`."""
    return {
        "branches": [
            {
                "segments": [
                    {
                        "token_ids": segment.arrays().token_ids.tolist(),
                        "loss_mask": segment.arrays().loss_mask.tolist(),
                        "logprobs": [
                            None if np.isnan(v) else v for v in segment.arrays().logprobs.tolist()
                        ],
                        "weight_versions": [
                            {"version": s.version, "start": s.start, "end": s.end}
                            for s in segment.weight_versions
                        ],
                        "turns": segment.turns,
                    }
                    for segment in branch.segments
                ]
            }
            for branch in trajectory.branches
        ]
    }


def rollout(stack: Stack, client: Client, run: str, reward: float | None) -> str:
    session = client.create_session(sampling={"temperature": 0.5}, metadata={"run": run})
    stack.double.script(said(stack, "Forty-two."))
    stack.openai(session.id).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "The answer?"}]
    )
    client.finish(session.id, reward=reward, metadata={"judge": "exact"})
    return session.id


def test_a_rollout_from_creation_to_arrays(stack: Stack) -> None:
    run = uuid.uuid4().hex
    with Client(stack.url) as client:
        session = client.create_session(sampling={"temperature": 0.5}, metadata={"run": run})
        assert session.openai_base_url == f"{stack.url}/sessions/{session.id}/v1"
        assert session.anthropic_base_url == f"{stack.url}/sessions/{session.id}"
        stack.double.script(said(stack, "Forty-two."))
        stack.openai(session.id).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "The answer?"}]
        )
        assert stack.double.requests[-1].sampling["temperature"] == 0.5  # the override won

        trajectory = client.trajectory(session.id)
        assert isinstance(trajectory, Trajectory)
        [segment] = trajectory.branches[0].segments
        arrays = segment.arrays()
        assert arrays.token_ids.dtype == np.int64
        assert (
            arrays.token_ids.tolist() == stack.prompts()[-1] + said(stack, "Forty-two.").token_ids
        )
        # The arrays a trainer feeds on hold the engine's values, position by position.
        checked = assert_trajectory_values(
            as_exported(trajectory), stack.double.samples, every_sample=True
        )
        assert checked == len(said(stack, "Forty-two.").token_ids)
        assert [s.version for s in segment.weight_versions] == ["default"]

        finish = client.finish(session.id, reward=1.0, metadata={"judge": "exact"})
        assert finish.reward == 1.0
        with pytest.raises(TokenkeepError) as again:
            client.finish(session.id, reward=0.0)
        assert again.value.status == 409

        [listed] = client.list_finished(selector=f"run={run}")
        assert (listed.id, listed.finish.reward, listed.metadata) == (session.id, 1.0, {"run": run})

        [row] = list(client.export(selector=f"run={run}"))
        assert row.token_ids == arrays.token_ids.tolist()
        assert (row.reward, row.metadata, row.finish_metadata) == (
            1.0,
            {"run": run},
            finish.metadata,
        )

        client.delete(session.id)
        with pytest.raises(TokenkeepError) as gone:
            client.trajectory(session.id)
        assert gone.value.status == 404
        assert client.list_finished(selector=f"run={run}") == []


def test_a_batch_of_rollouts_as_padded_arrays(memory_stack: Stack) -> None:
    run = uuid.uuid4().hex
    with Client(memory_stack.url) as client:
        ids = [rollout(memory_stack, client, run, r) for r in (1.0, 0.0, None)]
        batch = client.export_batch(session_ids=ids, pad_id=-1)
        trajectories = client.trajectories(ids)
    assert isinstance(batch, Batch)
    assert batch.session_ids == ids
    assert batch.token_ids.shape == batch.loss_mask.shape == batch.logprobs.shape
    assert batch.rewards[:2].tolist() == [1.0, 0.0] and np.isnan(batch.rewards[2])
    for i, trajectory in enumerate(trajectories):
        tokens = trajectory.branches[0].segments[0].token_ids
        assert batch.token_ids[i, : len(tokens)].tolist() == tokens
        assert (batch.token_ids[i, len(tokens) :] == -1).all()
        assert batch.attention_mask[i].sum() == len(tokens)
        arrays = trajectory.branches[0].segments[0].arrays()
        assert batch.loss_mask[i, : len(tokens)].tolist() == arrays.loss_mask.tolist()
        np.testing.assert_array_equal(batch.logprobs[i, : len(tokens)], arrays.logprobs)
    # Each padded row holds the values the engine sampled for that session.
    for trajectory in trajectories:
        assert_trajectory_values(as_exported(trajectory), memory_stack.double.samples)


def test_bad_batches_are_refused_before_anything_is_sent(stack: Stack) -> None:
    run = uuid.uuid4().hex
    with Client(stack.url) as client:
        finished = rollout(stack, client, run, 1.0)
        running = client.create_session(metadata={"run": run}).id
        cases = {
            "unknown": ([finished, "no-such-session"], 404, "not found"),
            "unfinished": ([finished, running], 409, "not finished"),
        }
        for session_ids, status, words in cases.values():
            with pytest.raises(TokenkeepError) as refused:
                list(client.export(session_ids=session_ids))
            assert refused.value.status == status and words in refused.value.message
        with pytest.raises(TokenkeepError) as nothing:
            list(client.export(selector=f"run={run},absent=1"))
        assert nothing.value.status == 404
        with pytest.raises(TokenkeepError) as malformed:
            client.list_finished(selector="run")
        assert malformed.value.status == 400
        # Nothing was touched.
        assert [s.id for s in client.list_finished(selector=f"run={run}")] == [finished]
        client.trajectory(running)


async def test_the_async_client(memory_stack: Stack) -> None:
    run = uuid.uuid4().hex
    async with AsyncClient(memory_stack.url) as client:
        session = await client.create_session(metadata={"run": run})
        memory_stack.double.script(said(memory_stack, "Yes."))
        harness = openai.AsyncOpenAI(
            base_url=session.openai_base_url, api_key=session.api_key, max_retries=0
        )
        async with harness as openai_client:
            await openai_client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "Ready?"}]
            )
        await client.finish(session.id, reward=0.5)
        [listed] = await client.list_finished(selector=f"run={run}")
        assert listed.finish.reward == 0.5
        rows = [row async for row in client.export(session_ids=[session.id])]
        batch = await client.export_batch(session_ids=[session.id])
        assert batch.token_ids[0].tolist() == rows[0].token_ids
        [trajectory] = await client.trajectories([session.id])
        assert trajectory.branches[0].segments[0].token_ids == rows[0].token_ids
        await client.delete(session.id)
        with pytest.raises(TokenkeepError):
            await client.delete(session.id)


def test_retries_aborts_and_statuses_through_the_client(stack: Stack) -> None:
    """What a rollout driver does around failures: a resent turn, a generation aborted from
    the driver (its harness gets an error, the session stays usable), a finish that says
    why, and a trainer taking one leaf per rollout and only the healthy rollouts."""
    question = [{"role": "user", "content": "The answer?"}]
    with Client(stack.url) as client, ThreadPoolExecutor(1) as pool:
        session = client.create_session()
        harness = stack.openai(session.id)
        for text in ("Forty.", "Forty-two."):
            stack.double.script(said(stack, text))
            harness.chat.completions.create(model="m", messages=question)
        stack.double.script(said(stack, "Four"))
        stack.double.latency_s = 3.0
        try:
            pending = pool.submit(
                lambda: harness.chat.completions.create(model="m", messages=question)
            )
            while len(stack.double.requests) < 3:
                time.sleep(0.02)
            aborted = client.abort(session.id)
            with pytest.raises(openai.BadRequestError) as cut:
                pending.result()
        finally:
            stack.double.latency_s = 0.0
        assert (aborted.id, aborted.aborted, aborted.finish) == (session.id, 1, None)
        assert cut.value.body["type"] == "aborted"  # type: ignore[index]
        every = client.trajectory(session.id)
        assert [b.leaf_turn_id for b in every.branches] == [1, 2, 3]
        [last] = client.trajectory(session.id, branches="last").branches
        assert last.leaf_turn_id == 3
        assert last.segments[0].turns[-1]["finish_reason"] == "abort"

        done = client.abort(session.id, finish=True)
        assert done.aborted == 0 and done.finish is not None and done.finish.status == "aborted"
        with pytest.raises(TokenkeepError) as finished:
            client.abort(session.id)
        assert finished.value.status == 409
        with pytest.raises(TokenkeepError) as unknown:
            client.abort("nobody-here")
        assert unknown.value.status == 404

        healthy = client.create_session()
        stack.double.script(said(stack, "Yes."))
        stack.openai(healthy.id).chat.completions.create(model="m", messages=question)
        client.finish(healthy.id, reward=1.0, status="ok")
        assert [s.id for s in client.list_finished(status=["aborted"])] == [session.id]
        assert healthy.id in [s.id for s in client.list_finished(status=["ok", "env_error"])]
        rows = list(client.export(session_ids=[session.id], branches="last"))
        assert [(r.leaf_turn_id, r.status) for r in rows] == [(3, "aborted")]
        assert len(list(client.export(session_ids=[session.id]))) == 3
        with pytest.raises(TokenkeepError) as bad:
            client.list_finished(status=["crashed"])
        assert bad.value.status == 400 and bad.value.param == "status"
