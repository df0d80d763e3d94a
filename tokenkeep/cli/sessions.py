"""`tokenkeep sessions [list | show ID]`: a running server's rollouts, in the terminal (`list`
when no command is given). Without --url it finds a running `tokenkeep demo`.

`show` prints each segment of a branch token by token: on a terminal, sampled tokens (loss 1)
in green, context (loss 0) dimmed, special tokens in magenta, with alternating shades so that
token boundaries show; piped or redirected, plain text with every sampled run between «»
markers. Each segment starts with its break reason. It reads the viewer's JSON
(`/ui/api/...`), so it needs what the viewer needs (the admin key where one is configured).
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime
from typing import Any, TextIO

import httpx

from tokenkeep.cli import Parser, counted, fail, refused, server_arguments, unreachable
from tokenkeep.client import Client, TokenkeepError

PROG = "tokenkeep sessions"

_SAMPLED = ("\x1b[30;48;5;151m", "\x1b[30;48;5;114m")
_CONTEXT = ("\x1b[2m", "\x1b[2;4m")
_SPECIAL = "\x1b[35;1m"
_REASON = "\x1b[33;1m"
_RESET = "\x1b[0m"


def _parser() -> argparse.ArgumentParser:
    parser = Parser(prog=PROG, description=__doc__)
    server_arguments(parser)
    sub = parser.add_subparsers(dest="command")
    listing = sub.add_parser("list", help="sessions, newest first")
    listing.add_argument("--limit", type=int, default=50, help="sessions to show")
    listing.add_argument("--offset", type=int, default=0, help="skip this many, newest first")
    listing.add_argument("--metadata", help="filter: key=value[,key=value]")
    listing.add_argument("--state", choices=["running", "finished"])
    listing.add_argument("--json", action="store_true", help="print the JSON as received")
    show = sub.add_parser("show", help="one session's tokens, segments and breaks")
    show.add_argument("session_id", help="the session to show")
    show.add_argument("--branch", type=int, help="branch index (default: the newest)")
    show.add_argument("--json", action="store_true", help="print the JSON as received")
    return parser


class _Mistake(Exception):
    """A request the session's data cannot answer (a branch it does not have)."""


def _breaks(breaks: dict[str, int]) -> str:
    return ", ".join(f"{reason} x{n}" for reason, n in breaks.items()) or "none"


def print_list(data: dict[str, Any], out: TextIO) -> None:
    header = (
        f"{'session':<36} {'created':<19} {'turns':>5} {'segs':>4} {'tokens':>8} "
        f"{'state':<8} {'reward':>7}  breaks"
    )
    print(header, file=out)
    for s in data["sessions"]:
        created = datetime.fromtimestamp(s["created_at"]).strftime("%Y-%m-%d %H:%M:%S")
        reward = "-" if s["reward"] is None else f"{s['reward']:g}"
        print(
            f"{s['id']:<36} {created:<19} {s['turns']:>5} {s['segments']:>4} "
            f"{s['tokens']:>8} {s['state']:<8} {reward:>7}  {_breaks(s['breaks'])}",
            file=out,
        )
    shown = len(data["sessions"])
    print(f"{shown} of {counted(data['total'], 'session')} (offset {data['offset']})", file=out)


def _plain_segment(segment: dict[str, Any]) -> str:
    parts: list[str] = []
    sampled = False
    for piece, mask in zip(segment["pieces"], segment["loss_mask"], strict=True):
        if mask and not sampled:
            parts.append("«")
        elif not mask and sampled:
            parts.append("»")
        sampled = bool(mask)
        parts.append(piece)
    if sampled:
        parts.append("»")
    return "".join(parts)


def _coloured_segment(segment: dict[str, Any]) -> str:
    parts: list[str] = []
    for i, (piece, mask, special) in enumerate(
        zip(segment["pieces"], segment["loss_mask"], segment["special"], strict=True)
    ):
        style = _SPECIAL if special else (_SAMPLED if mask else _CONTEXT)[i % 2]
        parts.append(f"{style}{piece}{_RESET}")
    return "".join(parts)


def print_session(data: dict[str, Any], branch_index: int | None, out: TextIO, tty: bool) -> None:
    branches = data["branches"]
    if not branches:
        print(f"session {data['id']}: no turns yet", file=out)
        return
    index = len(branches) - 1 if branch_index is None else branch_index
    if not 0 <= index < len(branches):
        raise _Mistake(f"no branch {index}: the session has branches 0..{len(branches) - 1}")
    branch = branches[index]
    for segment in branch["segments"]:
        reason = segment["start_reason"]
        title = (
            f"segment {segment['index'] + 1}: first"
            if reason == "first"
            else f"segment {segment['index'] + 1}: new segment, reason: {reason}"
        )
        line = f"── {title} ({len(segment['token_ids'])} tokens) ──"
        print(f"{_REASON}{line}{_RESET}" if tty and reason != "first" else line, file=out)
        print(_coloured_segment(segment) if tty else _plain_segment(segment), file=out)
    sampled = sum(sum(s["loss_mask"]) for s in branch["segments"])
    print(
        f"session {data['id']} branch {index}/{len(branches) - 1}: "
        f"{counted(data['turns'], 'turn')}, "
        f"{counted(len(branch['segments']), 'segment')} on this branch, "
        f"{counted(sampled, 'sampled token')}, "
        f"breaks: {_breaks(data['breaks'])}",
        file=out,
    )


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:  # `tokenkeep sessions [--url URL]`: the listing
        args = parser.parse_args([*(sys.argv[1:] if argv is None else argv), "list"])
    out = sys.stdout
    try:
        with Client(args.url, api_key=args.admin_key) as client:
            if args.command == "list":
                data = client.viewer_sessions(
                    limit=args.limit,
                    offset=args.offset,
                    metadata=args.metadata or None,
                    state=args.state,
                )
            else:
                data = client.viewer_session(args.session_id)
    except TokenkeepError as exc:
        line, status = refused(exc, args.admin_key)
        print(f"{PROG}: {line}", file=sys.stderr)
        return status
    except httpx.HTTPError as exc:
        return fail(PROG, unreachable(args.url, exc))
    if args.json:
        print(json.dumps(data), file=out)
    elif args.command == "list":
        print_list(data, out)
    else:
        try:
            print_session(data, args.branch, out, tty=out.isatty())
        except _Mistake as exc:
            return fail(PROG, str(exc))
    return 0
