"""The train demo's token-level grammar and what it tells the learner, on the real Qwen3
tokenizer (the one the tiny model serves)."""

from __future__ import annotations

from session_server.devtools import train
from tests.real_tokenizers import qwen3_dir
from tokenkeep.types import Row, WeightSpan


def test_every_city_is_decided_at_its_first_token() -> None:
    grammar = train.Grammar.for_model(qwen3_dir())
    assert len(grammar.city_first_ids) == len(train.CITIES)
    assert grammar.lark.startswith("start: <[151657]> ") and grammar.lark.endswith("<[151658]>\n")
    lima = grammar.city_first_ids[train.CITIES.index("Lima")]
    # context, then the tool-call turn (forced, the choice, forced, end of turn), context,
    # then an unconstrained answer
    tokens = [1, 2, 151657, 198, lima, 7523, 151658, 151645, 3, 4, 5, 6]
    mask = [0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 1, 1]
    allowed = grammar.allowed(tokens, mask)
    assert allowed[:2] == [None, None] and allowed[8:] == [None] * 4
    assert allowed[2] == [151657] and allowed[3] == [198] and allowed[5] == [7523]
    assert allowed[4] == list(grammar.city_first_ids)
    assert allowed[7] == list(train.EOS_IDS)


def test_token_versions_follow_the_exported_spans() -> None:
    row = Row(
        session_id="s",
        branch=0,
        segment=0,
        start_reason="first",
        token_ids=[9] * 8,
        loss_mask=[0, 0, 1, 1, 0, 1, 1, 0],
        logprobs=[None, None, -1.0, -1.0, None, -1.0, -1.0, None],
        weight_versions=[WeightSpan("3", 2, 4), WeightSpan("4", 5, 7)],
        versions=["3", "4"],
        mixed_versions=True,
        stale_tokens=0,
        reward=1.0,
        finished_at=0.0,
        metadata={},
        finish_metadata={},
    )
    assert train.token_versions(row) == [None, None, "3", "3", None, "4", "4", None]
