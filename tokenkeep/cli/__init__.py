"""The client's command line: `tokenkeep sessions` and `tokenkeep export`, both built on
`tokenkeep.Client`, both reaching the server the same way.

`--url` (TOKENKEEP_URL) names the server; `--admin-key` (TOKENKEEP_ADMIN_KEY, the variable the
server reads its own key from) is the key, where the server has one. `--api-key` and
TOKENKEEP_API_KEY, the names `tokenkeep export` used first, still work (as the server accepts
TOKENKEEP_API_KEY for its key).
"""

from __future__ import annotations

import argparse
import os

DEFAULT_URL = "http://127.0.0.1:8000"


def server_arguments(parser: argparse.ArgumentParser) -> None:
    """`--url` and `--admin-key`, defaulting to their environment variables."""
    parser.add_argument(
        "--url",
        default=os.environ.get("TOKENKEEP_URL", DEFAULT_URL),
        help=f"the session server (TOKENKEEP_URL; default {DEFAULT_URL})",
    )
    parser.add_argument(
        "--admin-key",
        "--api-key",
        dest="admin_key",
        default=os.environ.get("TOKENKEEP_ADMIN_KEY") or os.environ.get("TOKENKEEP_API_KEY"),
        help="the server's admin key, where it has one (TOKENKEEP_ADMIN_KEY; older names: "
        "--api-key, TOKENKEEP_API_KEY)",
    )
