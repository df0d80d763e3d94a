"""Batch export files: JSONL (one row per line, as the server sends it) or Parquet.

Parquet needs `pyarrow` (`pip install 'tokenkeep[parquet]'`). Its columns are the row's fields;
token data are list columns (`token_ids` int32, `loss_mask` int8, `logprobs` float32 with nulls
on context tokens, `weight_versions` a list of {version, start, end}), `metadata` and
`finish_metadata` are JSON text (their keys differ from session to session), `routed_experts`
the `.npy` bytes of the (T - 1, layers, top_k) routes (null without routing replay; JSONL
keeps the server's base64 of them).

A file is written beside its destination and moved into place only when complete, so a
failed export never leaves a partial file under the destination name.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any, Literal

from tokenkeep.types import Row, npy_bytes

Format = Literal["parquet", "jsonl"]
ROWS_PER_BATCH = 256


class ExportFileError(Exception):
    """The destination cannot be written, or the format's library is missing."""


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.parquet  # the submodule that writes files
    except ImportError as exc:
        raise ExportFileError(
            "Parquet export needs pyarrow: pip install 'tokenkeep[parquet]' "
            "(or export --format jsonl)"
        ) from exc
    return pyarrow


def _schema(pa: Any) -> Any:
    span = pa.struct([("version", pa.string()), ("start", pa.int32()), ("end", pa.int32())])
    return pa.schema(
        [
            ("session_id", pa.string()),
            ("branch", pa.int32()),
            ("leaf_turn_id", pa.int32()),
            ("segment", pa.int32()),
            ("start_reason", pa.string()),
            ("token_ids", pa.list_(pa.int32())),
            ("loss_mask", pa.list_(pa.int8())),
            ("logprobs", pa.list_(pa.float32())),
            ("weight_versions", pa.list_(span)),
            ("versions", pa.list_(pa.string())),
            ("mixed_versions", pa.bool_()),
            ("stale_tokens", pa.int32()),
            ("reward", pa.float64()),
            ("finished_at", pa.float64()),
            ("metadata", pa.string()),
            ("finish_metadata", pa.string()),
            ("routed_experts", pa.binary()),
            ("status", pa.string()),
            ("group", pa.string()),
        ]
    )


def _columns(rows: list[Row]) -> dict[str, list[Any]]:
    columns: dict[str, list[Any]] = {}
    for row in rows:
        data = asdict(row)
        data["metadata"] = json.dumps(row.metadata, separators=(",", ":"))
        data["finish_metadata"] = json.dumps(row.finish_metadata, separators=(",", ":"))
        routes = row.routed_experts
        data["routed_experts"] = None if routes is None else npy_bytes(routes)
        for name, value in data.items():
            columns.setdefault(name, []).append(value)
    return columns


def _json_row(row: Row) -> dict[str, Any]:
    data = asdict(row)
    routes = row.routed_experts
    data["routed_experts"] = (
        None if routes is None else base64.b64encode(npy_bytes(routes)).decode()
    )
    return data


def _batches(rows: Iterable[Row]) -> Iterator[list[Row]]:
    batch: list[Row] = []
    for row in rows:
        batch.append(row)
        if len(batch) == ROWS_PER_BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


def check_writable(path: Path, fmt: Format) -> None:
    """Fail before any work if `path` cannot be written as `fmt`."""
    if fmt == "parquet":
        _pyarrow()
    if path.is_dir():
        raise ExportFileError(f"{path} is a directory")
    try:
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}."):
            pass
    except OSError as exc:
        raise ExportFileError(f"cannot write {path}: {exc.strerror or exc}") from exc


def write(
    rows: Iterable[Row],
    path: Path,
    fmt: Format,
    on_row: Callable[[Row], None] | None = None,
) -> int:
    """Write every row to `path` (atomically); returns the number of rows."""
    check_writable(path, fmt)
    descriptor, temp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    temp = Path(temp_name)
    count = 0

    def counted() -> Iterator[Row]:
        nonlocal count
        for row in rows:
            count += 1
            if on_row is not None:
                on_row(row)
            yield row

    try:
        with os.fdopen(descriptor, "wb") as out:
            if fmt == "parquet":
                _write_parquet(counted(), out)
            else:
                for row in counted():
                    out.write(json.dumps(_json_row(row), separators=(",", ":")).encode() + b"\n")
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            temp.unlink()
        raise
    return count


def _write_parquet(rows: Iterable[Row], out: IO[bytes]) -> None:
    pa = _pyarrow()
    schema = _schema(pa)
    with pa.parquet.ParquetWriter(out, schema) as writer:
        for batch in _batches(rows):
            writer.write_table(pa.Table.from_pydict(_columns(batch), schema=schema))
