"""The packed record format: exact round trips and its size."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from session_server.store.base import RoutedExperts, TurnRecord, WeightSpan
from session_server.store.codec import (
    HEADER_SIZE,
    CorruptRecord,
    decode_turn,
    encode_turn,
)

token_ids = st.one_of(
    st.lists(st.integers(0, 2**24 - 1), max_size=300),
    st.lists(st.integers(0, 2**32 - 1), max_size=300),
)
float32s = st.floats(width=32, allow_nan=True, allow_infinity=True)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=8,
)


@st.composite
def weight_spans(draw: st.DrawFn, n_completion: int) -> list[WeightSpan]:
    """Ordered, non-overlapping spans within the completion (gaps allowed: a token may have
    no reported version)."""
    cuts = sorted(draw(st.sets(st.integers(0, n_completion), max_size=6)))
    pairs = list(itertools.pairwise(cuts))
    chosen = [p for p in pairs if draw(st.booleans())]
    return [WeightSpan(draw(st.text(max_size=6)), start, end) for start, end in chosen]


@st.composite
def routes(draw: st.DrawFn) -> RoutedExperts | None:
    if draw(st.booleans()):
        return None
    shape = (draw(st.integers(0, 20)), draw(st.integers(1, 4)), draw(st.integers(1, 3)))
    top = draw(st.sampled_from([255, 256, 70000]))
    values = draw(
        st.lists(st.integers(0, top), min_size=int(np.prod(shape)), max_size=int(np.prod(shape)))
    )
    return RoutedExperts(
        draw(st.integers(0, 2**31)), np.array(values, dtype=np.int64).reshape(shape)
    )


@st.composite
def records(draw: st.DrawFn) -> TurnRecord:
    completion = draw(token_ids)
    return TurnRecord(
        turn_id=draw(st.integers(1, 2**31)),
        parent_id=draw(st.none() | st.integers(1, 2**32 - 1)),
        segment_start=draw(st.booleans()),
        kind=draw(st.sampled_from(["first", "extend", "fork", "retry", "rewrite"]) | st.text()),
        break_reason=draw(st.none() | st.text()),
        prompt_delta=draw(token_ids),
        completion_ids=completion,
        logprobs=draw(st.lists(float32s, min_size=len(completion), max_size=len(completion))),
        finish_reason=draw(st.sampled_from(["stop", "length", "abort"]) | st.text()),
        stop_reason=draw(st.none() | st.integers(0, 2**31) | st.text()),
        n_messages=draw(st.integers(0, 2**32 - 1)),
        created_at=draw(st.floats(0, 4e9)),
        api=draw(st.sampled_from(["chat", "responses", "messages", "completions"]) | st.text()),
        extra=draw(st.dictionaries(st.text(max_size=8), json_values, max_size=4)),
        weight_versions=draw(weight_spans(len(completion))),
        routed_experts=draw(routes()),
    )


def same(a: TurnRecord, b: TurnRecord) -> bool:
    """Equality that treats NaN logprobs as equal to NaN."""
    nan_free = [x if not math.isnan(x) else "nan" for x in a.logprobs]
    return nan_free == [x if not math.isnan(x) else "nan" for x in b.logprobs] and all(
        getattr(a, name) == getattr(b, name) for name in TurnRecord.__slots__ if name != "logprobs"
    )


@given(records())
def test_round_trip_is_exact(record: TurnRecord) -> None:
    assert same(decode_turn(record.turn_id, encode_turn(record)), record)


def test_size_is_three_bytes_per_token_plus_four_per_logprob() -> None:
    record = TurnRecord(
        turn_id=1,
        parent_id=7,
        segment_start=False,
        kind="extend",
        break_reason=None,
        prompt_delta=list(range(150_000, 151_000)),
        completion_ids=list(range(200)),
        logprobs=[-0.5] * 200,
        finish_reason="stop",
    )
    assert len(encode_turn(record)) == HEADER_SIZE + 1200 * 3 + 200 * 4
    record.prompt_delta[0] = 2**24
    assert len(encode_turn(record)) == HEADER_SIZE + 1200 * 4 + 200 * 4


def test_decodes_a_32k_token_record_to_python_ints() -> None:
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 151_936, 32_000).tolist()
    record = TurnRecord(
        turn_id=3,
        parent_id=None,
        segment_start=True,
        kind="first",
        break_reason=None,
        prompt_delta=prompt,
        completion_ids=[5],
        logprobs=[float("nan")],
        finish_reason="length",
    )
    decoded = decode_turn(3, encode_turn(record))
    assert decoded.prompt_delta == prompt
    assert all(type(t) is int for t in decoded.prompt_delta[:10])
    assert math.isnan(decoded.logprobs[0])


@pytest.mark.parametrize(
    ("prompt", "message"),
    [([-1], "outside"), ([2**32], "outside"), ([1.5], "integers"), ([[1, 2]], "integers")],
)
def test_rejects_bad_token_ids(prompt: list[int], message: str) -> None:
    record = TurnRecord(
        turn_id=0,
        parent_id=None,
        segment_start=True,
        kind="first",
        break_reason=None,
        prompt_delta=prompt,
        completion_ids=[],
        logprobs=[],
        finish_reason="stop",
    )
    with pytest.raises(ValueError, match=message):
        encode_turn(record)


def test_truncated_record_is_reported() -> None:
    record = TurnRecord(
        turn_id=0,
        parent_id=None,
        segment_start=True,
        kind="first",
        break_reason=None,
        prompt_delta=[1, 2, 3],
        completion_ids=[4],
        logprobs=[-1.0],
        finish_reason="stop",
    )
    blob = encode_turn(record)
    with pytest.raises(CorruptRecord):
        decode_turn(1, blob[:-1])
    with pytest.raises(CorruptRecord):
        decode_turn(1, blob[:10])


def test_one_version_for_the_whole_completion_costs_its_string_only() -> None:
    record = TurnRecord(0, None, True, "first", None, [1, 2], [3, 4, 5], [-1.0] * 3, "stop")
    plain = len(encode_turn(record))
    record.weight_versions = [WeightSpan("12", 0, 3)]
    assert len(encode_turn(record)) - plain == len('{"w":"12"}')
    assert decode_turn(1, encode_turn(record)).weight_versions == [WeightSpan("12", 0, 3)]


@pytest.mark.parametrize(
    "spans",
    [
        [WeightSpan("1", 0, 4)],  # past the completion
        [WeightSpan("1", 2, 2)],  # empty
        [WeightSpan("1", 0, 2), WeightSpan("2", 1, 3)],  # overlapping
    ],
)
def test_rejects_bad_weight_spans(spans: list[WeightSpan]) -> None:
    record = TurnRecord(0, None, True, "first", None, [1], [3, 4, 5], [-1.0] * 3, "stop")
    record.weight_versions = spans
    with pytest.raises(ValueError, match="weight_versions"):
        encode_turn(record)


def test_routes_cost_layers_times_top_k_bytes_per_position() -> None:
    record = TurnRecord(0, None, True, "first", None, [1, 2], [3, 4, 5], [-1.0] * 3, "stop")
    plain = len(encode_turn(record))
    experts = np.arange(4 * 48 * 8).reshape(4, 48, 8) % 128  # 48 layers, top-8 of 128
    record.routed_experts = RoutedExperts(0, experts)
    assert len(encode_turn(record)) - plain == 13 + 4 * 48 * 8
    decoded = decode_turn(1, encode_turn(record)).routed_experts
    assert decoded == record.routed_experts and decoded is not None
    assert decoded.experts.dtype == np.uint8
