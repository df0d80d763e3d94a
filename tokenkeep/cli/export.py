"""`tokenkeep export`: finished rollouts from a session server into a Parquet or JSONL file.

    tokenkeep export --url http://127.0.0.1:8000 --selector run=7 -o batch.parquet --delete

The sessions are resolved first (named with --session, or every finished session matching
--selector/--since/--until), then exported in one stream. With --delete they are deleted only
after the file is complete and in place; an export that fails deletes nothing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import httpx

from tokenkeep.cli import Parser, counted, fail, refused, server_arguments, unreachable
from tokenkeep.client import Client, TokenkeepError
from tokenkeep.files import ExportFileError, check_writable, write
from tokenkeep.types import Row

PROG = "tokenkeep export"


def _parser() -> argparse.ArgumentParser:
    p = Parser(prog=PROG, description=__doc__)
    p.add_argument("-o", "--output", required=True, type=Path, help="file to write (required)")
    p.add_argument(
        "--format",
        choices=["parquet", "jsonl"],
        help="default: from the output's suffix (.jsonl/.ndjson: jsonl, else parquet)",
    )
    server_arguments(p)
    p.add_argument("--session", action="append", dest="sessions", help="repeat for several")
    p.add_argument("--selector", help="key=value,... over session metadata")
    p.add_argument("--since", type=float, help="finished at or after (Unix time)")
    p.add_argument("--until", type=float, help="finished at or before (Unix time)")
    p.add_argument("--limit", type=int, default=1000, help="most sessions a selector picks")
    p.add_argument(
        "--min-weight-version",
        type=float,
        help="turns sampled by an older policy version are stale (see --stale)",
    )
    p.add_argument(
        "--stale",
        choices=["mask", "drop"],
        default="mask",
        help="stale turns: loss-masked, or left out",
    )
    p.add_argument("--delete", action="store_true", help="delete the sessions once written")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    fmt = args.format or (
        "jsonl" if args.output.suffix.lower() in (".jsonl", ".ndjson") else "parquet"
    )
    try:
        check_writable(args.output, fmt)
    except ExportFileError as exc:
        return fail(PROG, str(exc))
    try:
        with Client(args.url, api_key=args.admin_key, timeout=600) as client:
            return _export(client, args, fmt)
    except TokenkeepError as exc:
        line, status = refused(exc, args.admin_key)
        print(f"{PROG}: the server refused: {line}", file=sys.stderr)
        return status
    except ExportFileError as exc:
        return fail(PROG, str(exc))
    except httpx.HTTPError as exc:
        return fail(PROG, unreachable(args.url, exc))


def _export(client: Client, args: argparse.Namespace, fmt: str) -> int:
    if args.sessions:
        session_ids = list(dict.fromkeys(args.sessions))
    else:
        listed = client.list_finished(
            selector=args.selector, since=args.since, until=args.until, limit=args.limit
        )
        session_ids = [s.id for s in listed]
        if not session_ids:
            print(f"{PROG}: no finished session matches", file=sys.stderr)
            return 1
    rows = client.export(
        session_ids=session_ids, min_weight_version=args.min_weight_version, stale=args.stale
    )
    progress = _progress(len(session_ids), disabled=args.no_progress)
    seen: set[str] = set()

    def on_row(row: Row) -> None:
        if row.session_id not in seen:
            seen.add(row.session_id)
            progress.update(1)

    try:
        count = write(rows, args.output, fmt, on_row)
    finally:
        progress.close()
    print(
        f"wrote {counted(count, 'row')} of {counted(len(session_ids), 'session')} to {args.output}",
        file=sys.stderr,
    )
    if args.delete:
        for session_id in session_ids:
            try:
                client.delete(session_id)
            except TokenkeepError as exc:
                if exc.status != 404:  # gone already (expired): nothing left to delete
                    raise
        print(f"deleted {counted(len(session_ids), 'session')}", file=sys.stderr)
    return 0


def _progress(total: int, *, disabled: bool) -> Any:
    try:
        from tqdm import tqdm
    except ImportError as exc:
        raise ExportFileError(
            "the progress bar needs tqdm: pip install 'tokenkeep[parquet]' (or --no-progress)"
        ) from exc
    return tqdm(total=total, unit="session", disable=disabled, file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
