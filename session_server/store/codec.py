"""Compact binary form of a TurnRecord and JSON form of a SessionMeta, shared by both stores.

A record is a fixed header, a short JSON object for the rare string fields, then the token IDs
of `prompt_delta` and `completion_ids` as little-endian integers of 3 bytes (when every ID is
below 2**24, true of every real vocabulary) or 4 bytes, then one float32 logprob per
completion token (vLLM's logprobs are float32, so this is lossless for them), then, for a turn
with MoE routes (flag), a small header and the expert ids as the narrowest unsigned integers
that hold them (1 byte each for up to 256 experts: layers x top_k bytes per position). The
turn id is not stored: it is the record's key in its session.

The parent id sits at byte offset 1 (1-based position 2) as an unsigned 32-bit little-endian
integer, 0 for a root: the Redis lookup script reads it there to walk the path of a session
stored before the store kept parent ids in a hash of their own.
"""

from __future__ import annotations

import json
import struct
import sys
from array import array
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from session_server.store.base import Finish, RoutedExperts, SessionMeta, TurnRecord, WeightSpan

VERSION = 1
# version, parent_id (0 = root), flags, kind code, api code, finish code,
# len(prompt_delta), len(completion_ids), n_messages, created_at, length of the JSON part.
_HEADER = struct.Struct("<BIBBBBIIIdI")
HEADER_SIZE = _HEADER.size

_SEGMENT_START = 0x01
_WIDE_TOKENS = 0x02
_ROUTES = 0x04
# start position, positions, layers, top_k, bytes per expert id.
_ROUTE_HEADER = struct.Struct("<IIHHB")

# Common values of the enumerated string fields get a one-byte code (index + 1); 0 means the
# value is in the JSON part instead, so any string stays representable.
_KINDS = ("first", "extend", "fork", "retry", "rewrite")
_APIS = ("chat", "responses", "messages", "completions")
_FINISH_REASONS = ("stop", "length", "abort", "tool_calls", "error")

_NARROW_LIMIT = 1 << 24
# Token ids and logprobs are packed with `array` rather than numpy: a turn adds tens of tokens,
# and numpy's fixed cost per call was most of a record's encoding time at that size.
_U32 = next(code for code in "IL" if array(code).itemsize == 4)
_F32 = "f"
_BIG_ENDIAN = sys.byteorder == "big"


class CorruptRecord(ValueError):
    pass


def _code(table: tuple[str, ...], value: str) -> int:
    try:
        return table.index(value) + 1
    except ValueError:
        return 0


def stored_logprobs(values: list[float]) -> list[float]:
    """Logprobs as a stored record gives them back: float32, the width the codec keeps."""
    return array(_F32, values).tolist()


def _token_array(ids: list[int], what: str) -> array[int]:
    try:
        return array(_U32, ids)
    except TypeError:
        raise ValueError(f"{what} must be a flat list of integers") from None
    except OverflowError:
        raise ValueError(f"{what} holds a token ID outside [0, 2**32)") from None


def _little_endian(values: array[Any]) -> bytes:
    if _BIG_ENDIAN:
        values = array(values.typecode, values)
        values.byteswap()
    return values.tobytes()


def _from_little_endian(code: str, data: bytes | bytearray) -> array[Any]:
    values = array(code, data)
    if _BIG_ENDIAN:
        values.byteswap()
    return values


def _pack_tokens(arr: array[int], width: int) -> bytes:
    packed = _little_endian(arr)
    if width == 4:
        return packed
    narrow = bytearray(packed)
    del narrow[3::4]  # the high byte of each 32-bit id: zero below 2**24
    return bytes(narrow)


def _unpack_tokens(blob: bytes, offset: int, count: int, width: int) -> list[int]:
    data = blob[offset : offset + count * width]
    if width == 4:
        return _from_little_endian(_U32, data).tolist()
    wide = bytearray(4 * count)
    for byte in range(3):
        wide[byte::4] = data[byte::3]
    return _from_little_endian(_U32, wide).tolist()


def encode_turn(record: TurnRecord) -> bytes:
    """Pack everything but `turn_id`. Raises ValueError on malformed token data."""
    prompt = _token_array(record.prompt_delta, "prompt_delta")
    completion = _token_array(record.completion_ids, "completion_ids")
    if len(record.logprobs) != len(completion):
        raise ValueError(f"{len(record.logprobs)} logprobs for {len(completion)} completion tokens")
    logprobs = array(_F32, record.logprobs)
    top = max((max(a) for a in (prompt, completion) if a), default=0)
    width = 3 if top < _NARROW_LIMIT else 4

    kind, api, finish = (
        _code(_KINDS, record.kind),
        _code(_APIS, record.api),
        _code(_FINISH_REASONS, record.finish_reason),
    )
    rare: dict[str, Any] = {}
    if not kind:
        rare["k"] = record.kind
    if not api:
        rare["a"] = record.api
    if not finish:
        rare["f"] = record.finish_reason
    if record.stop_reason is not None:
        rare["s"] = record.stop_reason
    if record.break_reason is not None:
        rare["b"] = record.break_reason
    if record.extra:
        rare["x"] = record.extra
    if record.weight_versions:
        rare["w"] = _pack_weight_versions(record.weight_versions, len(completion))
    rare_json = (
        json.dumps(rare, separators=(",", ":"), ensure_ascii=False).encode() if rare else b""
    )

    routes = _pack_routes(record.routed_experts) if record.routed_experts is not None else b""
    flags = (
        (_SEGMENT_START if record.segment_start else 0)
        | (_WIDE_TOKENS if width == 4 else 0)
        | (_ROUTES if routes else 0)
    )
    header = _HEADER.pack(
        VERSION,
        record.parent_id or 0,
        flags,
        kind,
        api,
        finish,
        len(prompt),
        len(completion),
        record.n_messages,
        record.created_at,
        len(rare_json),
    )
    return b"".join(
        (
            header,
            rare_json,
            _pack_tokens(prompt, width),
            _pack_tokens(completion, width),
            _little_endian(logprobs),
            routes,
        )
    )


def _pack_routes(routes: RoutedExperts) -> bytes:
    experts = np.asarray(routes.experts)
    if experts.ndim != 3 or experts.dtype.kind not in "iu" or routes.start < 0:
        raise ValueError("routed_experts must be (positions, layers, top_k) integers")
    if experts.size and int(experts.min()) < 0:
        raise ValueError("routed_experts holds a negative expert id")
    top = int(experts.max()) if experts.size else 0
    itemsize = 1 if top < 1 << 8 else 2 if top < 1 << 16 else 4
    positions, layers, top_k = experts.shape
    header = _ROUTE_HEADER.pack(routes.start, positions, layers, top_k, itemsize)
    return header + experts.astype(f"<u{itemsize}").tobytes()


def _unpack_routes(turn_id: int, blob: bytes, offset: int) -> RoutedExperts:
    try:
        start, positions, layers, top_k, itemsize = _ROUTE_HEADER.unpack_from(blob, offset)
    except struct.error as exc:
        raise CorruptRecord(f"turn {turn_id}: truncated routes") from exc
    offset += _ROUTE_HEADER.size
    count = positions * layers * top_k
    if itemsize not in (1, 2, 4) or len(blob) != offset + count * itemsize:
        raise CorruptRecord(f"turn {turn_id}: routes do not fit the record")
    experts = np.frombuffer(blob, dtype=f"<u{itemsize}", count=count, offset=offset)
    return RoutedExperts(start, experts.reshape(positions, layers, top_k))


def decode_turn(turn_id: int, blob: bytes) -> TurnRecord:
    try:
        (
            version,
            parent,
            flags,
            kind,
            api,
            finish,
            n_prompt,
            n_completion,
            n_messages,
            created_at,
            rare_len,
        ) = _HEADER.unpack_from(blob)
    except struct.error as exc:
        raise CorruptRecord(f"turn {turn_id}: truncated header") from exc
    if version != VERSION:
        raise CorruptRecord(f"turn {turn_id}: unknown record version {version}")
    width = 4 if flags & _WIDE_TOKENS else 3
    expected = HEADER_SIZE + rare_len + (n_prompt + n_completion) * width + n_completion * 4
    routed = bool(flags & _ROUTES)
    if len(blob) != expected if not routed else len(blob) < expected:
        raise CorruptRecord(f"turn {turn_id}: {len(blob)} bytes, header says {expected}")

    offset = HEADER_SIZE
    rare = json.loads(blob[offset : offset + rare_len]) if rare_len else {}
    offset += rare_len
    # Prompt and completion IDs are adjacent: unpack them in one go.
    tokens = _unpack_tokens(blob, offset, n_prompt + n_completion, width)
    prompt, completion = tokens[:n_prompt], tokens[n_prompt:]
    offset += (n_prompt + n_completion) * width
    logprobs = _from_little_endian(_F32, blob[offset : offset + n_completion * 4]).tolist()
    routes = _unpack_routes(turn_id, blob, expected) if routed else None
    return TurnRecord(
        turn_id=turn_id,
        parent_id=parent or None,
        segment_start=bool(flags & _SEGMENT_START),
        kind=_KINDS[kind - 1] if kind else rare["k"],
        break_reason=rare.get("b"),
        prompt_delta=prompt,
        completion_ids=completion,
        logprobs=logprobs,
        finish_reason=_FINISH_REASONS[finish - 1] if finish else rare["f"],
        stop_reason=rare.get("s"),
        n_messages=n_messages,
        created_at=created_at,
        api=_APIS[api - 1] if api else rare["a"],
        extra=rare.get("x", {}),
        weight_versions=_unpack_weight_versions(rare.get("w"), n_completion),
        routed_experts=routes,
    )


def _pack_weight_versions(spans: list[WeightSpan], n_completion: int) -> str | list[Any]:
    """The common case, one version for the whole completion, is just the version string
    (a few bytes per turn); otherwise [[version, start, end], ...]."""
    end = 0
    for span in spans:
        if not isinstance(span.version, str) or not (end <= span.start < span.end):
            raise ValueError(f"weight_versions spans must be ordered and non-empty: {spans}")
        end = span.end
    if end > n_completion:
        raise ValueError(f"weight_versions span past the {n_completion} completion tokens")
    if len(spans) == 1 and spans[0].start == 0 and spans[0].end == n_completion:
        return spans[0].version
    return [[s.version, s.start, s.end] for s in spans]


def _unpack_weight_versions(packed: str | list[Any] | None, n_completion: int) -> list[WeightSpan]:
    if packed is None:
        return []
    if isinstance(packed, str):
        return [WeightSpan(packed, 0, n_completion)]
    return [WeightSpan(v, start, end) for v, start, end in packed]


def stored_tokens(record: TurnRecord) -> int:
    """The tokens a record adds to its session (what the `tokens` counter sums)."""
    return len(record.prompt_delta) + len(record.completion_ids)


def encode_meta(meta: SessionMeta) -> bytes:
    fields = asdict(meta)
    del fields["incarnation"]  # the store keeps it beside the metadata, not inside it
    return json.dumps(fields, separators=(",", ":"), ensure_ascii=False).encode()


def decode_meta(blob: bytes, incarnation: str | None = None) -> SessionMeta:
    return SessionMeta(**json.loads(blob), incarnation=incarnation)


def encode_finish(finish: Finish) -> bytes:
    return json.dumps(asdict(finish), separators=(",", ":"), ensure_ascii=False).encode()


def decode_finish(blob: bytes) -> Finish:
    return Finish(**json.loads(blob))


def validate_meta(meta: SessionMeta) -> None:
    if meta.ttl_seconds is not None and meta.ttl_seconds <= 0:
        raise ValueError(f"ttl_seconds must be positive or None, not {meta.ttl_seconds}")


@dataclass(slots=True)
class EncodedAppend:
    """What one `append_turns` call writes, encoded and checked before any store is touched."""

    blobs: list[bytes]
    parents: list[int]
    """Each turn's parent id, 0 for a root."""
    keys: list[list[str]]
    segments: int
    tokens: int
    breaks: list[str]


def encode_append(turns: list[TurnRecord], keys: list[list[str]]) -> EncodedAppend:
    if not turns:
        raise ValueError("append_turns needs at least one turn")
    if len(keys) != len(turns):
        raise ValueError(f"{len(keys)} key lists for {len(turns)} turns")
    return EncodedAppend(
        blobs=[encode_turn(t) for t in turns],
        parents=[t.parent_id or 0 for t in turns],
        keys=[list(k) for k in keys],
        segments=sum(t.segment_start for t in turns),
        tokens=sum(stored_tokens(t) for t in turns),
        breaks=[t.break_reason for t in turns if t.break_reason is not None],
    )
