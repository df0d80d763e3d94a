"""verifiers 0.4's real `TrainClient` (PyPI `verifiers==0.4.0`, pinned) against a live session
server: it renders the chat with its own renderer and posts the token prompt to
`<session base>/inference/v1/generate` (`renderers.client.generate`), then builds the
`TurnTokens` a verifiers/prime-rl trainer consumes. They must equal what the engine (the
double) was sent and sampled, and tokenkeep's export of the session.

verifiers pins its own dependency set (openai<3, renderers, mcp...), so it is installed into
its own virtualenv under `.cache/harnesses/` (once; skipped where PyPI is unreachable, which
under CI=true fails) and driven as a subprocess (`verifiers_train_client.py`)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.api.stack import reply
from tests.engine_double import EngineDouble
from tests.harnesses.conftest import live_stack
from tests.harnesses.test_litellm import run_script
from tests.integrations.venvs import framework_python
from tests.real_tokenizers import qwen3_dir

VERSION = "0.4.0"
DRIVER = Path(__file__).with_name("verifiers_train_client.py")


@pytest.fixture(scope="module")
def verifiers_python() -> Path:
    return framework_python(f"verifiers-{VERSION}", (f"verifiers=={VERSION}",))


@pytest.mark.parametrize("canonical", [True, False], ids=["canonical", "split"])
async def test_train_client_turn_tokens_equal_export_and_engine(
    double: EngineDouble, verifiers_python: Path, canonical: bool
) -> None:
    """Without verifiers' bridge (`PendingTurn`, which extends the previous turn's ids), the
    TrainClient re-renders the whole chat each turn. Where the model sampled "Hello!" as the
    canonical BPE, that re-render starts with the stored turn and the session stays one
    segment; where it sampled other pieces, the client itself sent different tokens: tokenkeep
    keeps them as sent (a `rewrite`, new segment, reason recorded), never a silent splice."""
    session = f"verifiers-{canonical}"
    with live_stack(double, []) as stack:
        first = reply("Hello!") if canonical else reply("Hel", "lo", "!")
        stack.script(first, reply("Sure", "."))
        result = await asyncio.to_thread(
            run_script, verifiers_python, DRIVER, f"{stack.url}/sessions/{session}/v1",
            str(qwen3_dir()), session,
        )  # fmt: skip
        turns = result["turns"]
        requests = stack.engine_requests()
        assert [t["prompt_ids"] for t in turns] == [r.prompt_ids for r in requests]
        assert [t["completion_ids"] for t in turns] == [c.token_ids for c in stack.sent]
        assert [t["completion_logprobs"] for t in turns] == [c.logprob_values() for c in stack.sent]
        assert [t["content"] for t in turns] == ["Hello!", "Sure."]

        trajectory = await stack.get(f"/sessions/{session}/trajectory")
        branches = trajectory["branches"]
        segments = [s for b in branches for s in b["segments"]]
        if canonical:
            assert len(branches) == 1
            stack.assert_contiguous()
            [segment] = segments
            assert [t["kind"] for t in segment["turns"]] == ["first", "extend"]
            spans = [(segment, t) for t in turns]
        else:
            kinds = [[t["kind"] for t in s["turns"]] for s in segments]
            assert sorted(kinds) == [["first"], ["rewrite"]], trajectory
            summary = await stack.get(f"/sessions/{session}")
            assert sum(summary["breaks"].values()) == 1
            by_kind = {s["turns"][0]["kind"]: s for s in segments}
            spans = [(by_kind["first"], turns[0]), (by_kind["rewrite"], turns[1])]
        for segment, turn in spans:
            start, end = (
                len(turn["prompt_ids"]),
                len(turn["prompt_ids"]) + len(turn["completion_ids"]),
            )
            assert segment["token_ids"][:end] == turn["prompt_ids"] + turn["completion_ids"]
            assert segment["loss_mask"][start:end] == [1] * (end - start)
            # The store keeps logprobs as float32.
            assert segment["logprobs"][start:end] == pytest.approx(
                turn["completion_logprobs"], abs=1e-6
            )
        last_segment, last = spans[-1]
        assert last_segment["token_ids"] == last["prompt_ids"] + last["completion_ids"]
