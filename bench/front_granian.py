"""Candidate (b) of issue 36 item 3, for measurement only: an ASGI app served by granian (a
Rust HTTP server, PyPI wheels) in this one process, instead of uvicorn.

    python bench/front_granian.py relay PORT            # bench/floor_relay.py's app
    python bench/front_granian.py relay-rsgi PORT       # the same relay on granian's own
                                                        # interface (RSGI), not ASGI
    python bench/front_granian.py serve -- SERVE_ARGS   # `tokenkeep serve SERVE_ARGS`

`serve` runs tokenkeep's own command line (settings, checks, the app as users get it) and
swaps only the server object at its end: granian's embedded server on the same host and
port, one runtime thread, on uvloop. What this leaves out of `tokenkeep serve` (header
timeouts and bounds, the graceful drain, the backlog) is irrelevant to a turn's CPU and is
why it is not a serving option. Run by bench/bench_front.py.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import uvloop
from granian.constants import HTTPModes, Interfaces
from granian.log import LogLevels
from granian.server.embed import Server

ROOT = Path(__file__).resolve().parents[1]


def _serve(app: Any, host: str, port: int, interface: Interfaces = Interfaces.ASGI) -> None:
    server = Server(
        app,
        address=host,
        port=port,
        interface=interface,
        http=HTTPModes.http1,
        websockets=False,
        log_level=LogLevels.warning,
    )
    uvloop.run(server.serve())


class _GranianServer:
    """Stands in for `session_server.app.GracefulServer` (same constructor)."""

    def __init__(self, config: Any, _admission: Any, _grace_s: float) -> None:
        self.config = config

    def run(self) -> None:
        _serve(self.config.app, self.config.host, self.config.port)


def main() -> None:
    mode = sys.argv[1]
    if mode in ("relay", "relay-rsgi"):
        sys.path.insert(0, str(ROOT))
        from bench.floor_relay import app, rsgi_app

        if mode == "relay":
            _serve(app, "127.0.0.1", int(sys.argv[2]))
        else:
            _serve(rsgi_app, "127.0.0.1", int(sys.argv[2]), Interfaces.RSGI)
        return
    import session_server.app
    from session_server import cli

    session_server.app.GracefulServer = _GranianServer  # type: ignore[assignment,misc]
    sys.exit(cli.main(["serve", *sys.argv[3:]]))


if __name__ == "__main__":
    main()
