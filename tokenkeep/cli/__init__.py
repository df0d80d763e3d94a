"""The client's command line: `tokenkeep sessions` and `tokenkeep export`, both built on
`tokenkeep.Client`, both reaching the server the same way.

`--url` (TOKENKEEP_URL, else the local stack a running `tokenkeep demo` announced in
`local_stack_file()`, else where `tokenkeep serve` listens by default) names the server;
`--admin-key` (TOKENKEEP_ADMIN_KEY, the variable the server reads its own key from) is the
key, where the server has one. `--api-key` and TOKENKEEP_API_KEY, the names
`tokenkeep export` used first, still work (as the server accepts TOKENKEEP_API_KEY for its
key).

Every `tokenkeep` command (the server's too: this package imports nothing of the server, so
the server's commands import from here) reports a mistake the same way: one line on stderr
that says what is wrong and what to do, exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

import httpx

from tokenkeep.client import TokenkeepError

# Where `tokenkeep serve` listens by default (its --host and --port).
DEFAULT_URL = "http://127.0.0.1:8000"
USAGE_ERROR = 2


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows a flag's default where it has one: not for flags without a default (None) nor
    for switches (False), where "(default: None)" would say nothing. Descriptions are the
    commands' docstrings, printed as written (their examples keep their lines)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        # The admin key's default is the key itself (from the environment): never printed.
        if action.default is None or action.default is False or action.dest == "admin_key":
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """argparse, with a mistake on one line: argparse's own error prints the whole usage
    first, which buries the one line that says what is wrong."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"{self.prog}: {message} (see {self.prog} --help)\n")


def fail(prog: str, message: str) -> int:
    """Print a mistake as the one line every command prints; the exit status to return."""
    print(f"{prog}: {message}", file=sys.stderr)
    return USAGE_ERROR


def http_url(value: str) -> str:
    """An argparse type: an http:// or https:// URL with a host, as given."""
    try:
        url = httpx.URL(value)
    except httpx.InvalidURL as exc:
        raise argparse.ArgumentTypeError(f"{value!r} is not a URL ({exc})") from None
    if url.scheme not in ("http", "https") or not url.host:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not an http:// or https:// URL with a host, such as {DEFAULT_URL}"
        )
    return value


def counted(count: int, noun: str, plural: str | None = None) -> str:
    """ "1 turn", "2 turns": a count with its noun in the right number."""
    return f"{count} {noun if count == 1 else plural or noun + 's'}"


def local_stack_file() -> Path:
    """Where a running `tokenkeep demo` writes its session server's URL (and removes it on
    exit), so that the other commands find the demo without --url. In tokenkeep's cache
    folder, as the local engine (`$TOKENKEEP_CACHE_DIR`, default ~/.cache/tokenkeep)."""
    cache = os.environ.get("TOKENKEEP_CACHE_DIR") or Path.home() / ".cache" / "tokenkeep"
    return Path(cache) / "local-stack.json"


def local_stack_url() -> str | None:
    """The URL of the local demo that is running now, if one announced itself (a file left
    by a demo that was killed names a process that is gone: ignored)."""
    try:
        stack = json.loads(local_stack_file().read_text())
        os.kill(int(stack["pid"]), 0)
        return str(stack["url"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def default_url() -> str:
    """TOKENKEEP_URL, else the running local demo, else where `tokenkeep serve` listens."""
    return os.environ.get("TOKENKEEP_URL") or local_stack_url() or DEFAULT_URL


def server_arguments(parser: argparse.ArgumentParser) -> None:
    """`--url` and `--admin-key`, defaulting to their environment variables."""
    parser.add_argument(
        "--url",
        type=http_url,
        default=default_url(),
        help="the session server (TOKENKEEP_URL; else a running `tokenkeep demo`; else where "
        "`tokenkeep serve` listens by default)",
    )
    parser.add_argument(
        "--admin-key",
        "--api-key",
        dest="admin_key",
        default=os.environ.get("TOKENKEEP_ADMIN_KEY") or os.environ.get("TOKENKEEP_API_KEY"),
        help="the server's admin key, where it has one (TOKENKEEP_ADMIN_KEY; older names: "
        "--api-key, TOKENKEEP_API_KEY)",
    )


def unreachable(url: str, exc: httpx.HTTPError) -> str:
    """The line for a server that does not answer: which server, why, and how to name another."""
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return (
        f"cannot reach {url} ({reason}): start `tokenkeep serve` there or `tokenkeep demo` "
        "(found without --url while it runs), or name the server with --url or TOKENKEEP_URL"
    )


def refused(exc: TokenkeepError, admin_key: str | None) -> tuple[str, int]:
    """The line for a request the server refused, and the exit status: a missing or wrong
    admin key is the command line's mistake (2); anything else is the server's answer (1)."""
    line = f"HTTP {exc.status}: {exc.message}"
    if exc.status == 401:
        what = (
            "the admin key given is not the server's"
            if admin_key
            else "the server has an admin key"
        )
        return f"{line} ({what}: pass it with --admin-key or TOKENKEEP_ADMIN_KEY)", USAGE_ERROR
    return line, 1
