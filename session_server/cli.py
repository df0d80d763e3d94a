"""`tokenkeep` command line: serve, engine, demo, operator."""

from __future__ import annotations

import argparse
import logging
import os
import sys


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the session server")
    env = os.environ.get
    p.add_argument(
        "--engine-url",
        action="append",
        dest="engine_urls",
        help="vLLM base URL; repeat for replicas (TOKENKEEP_ENGINE_URLS)",
    )
    p.add_argument("--model", help="served model name (TOKENKEEP_MODEL)")
    p.add_argument("--tokenizer", help="tokenizer directory or id (TOKENKEEP_TOKENIZER)")
    p.add_argument("--renderer", help="auto (default) or a renderer name (TOKENKEEP_RENDERER)")
    p.add_argument("--redis-url", help="Redis URL; absent: embedded store (TOKENKEEP_REDIS_URL)")
    p.add_argument("--host", help="bind address (TOKENKEEP_HOST)")
    p.add_argument("--port", type=int, help="port (TOKENKEEP_PORT)")
    p.add_argument("--context-length", type=int, help="max model length (TOKENKEEP_CONTEXT_LENGTH)")
    p.add_argument(
        "--engine-discovery",
        action="store_true",
        default=None,
        help="one replica per address of each engine host (TOKENKEEP_ENGINE_DISCOVERY)",
    )
    limits = (
        ("--max-inflight", int, "generation requests run at once (TOKENKEEP_MAX_INFLIGHT)"),
        ("--max-queue", int, "requests that may wait for a slot (TOKENKEEP_MAX_QUEUE)"),
        ("--queue-timeout-s", float, "longest wait for a slot (TOKENKEEP_QUEUE_TIMEOUT_S)"),
        (
            "--engine-max-inflight",
            int,
            "requests in flight per engine replica (TOKENKEEP_ENGINE_MAX_INFLIGHT)",
        ),
        (
            "--shutdown-grace-s",
            float,
            "on SIGTERM, time for in-flight requests to finish (TOKENKEEP_SHUTDOWN_GRACE_S)",
        ),
        ("--redis-retry-s", float, "retry Redis this long before 503 (TOKENKEEP_REDIS_RETRY_S)"),
        (
            "--redis-wait-replicas",
            int,
            "acknowledge a turn once N Redis replicas hold it (TOKENKEEP_REDIS_WAIT_REPLICAS)",
        ),
    )
    for flag, kind, help_text in limits:
        p.add_argument(flag, type=kind, help=help_text)
    p.add_argument("--log-level", default=env("TOKENKEEP_LOG_LEVEL", "info"))


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from session_server.app import GracefulServer, create_app
    from session_server.settings import Settings

    overrides = {
        k: v for k, v in vars(args).items() if v is not None and k in Settings.model_fields
    }
    settings = Settings(**overrides)
    if not settings.engine_urls:
        print("tokenkeep serve: give --engine-url (or TOKENKEEP_ENGINE_URLS)", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(message)s")
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=False,
        # After the drain (GracefulServer) little is left; this bounds what is.
        timeout_graceful_shutdown=5,
        # Longer than clients keep idle connections (httpx: 5 s) and than load balancers'
        # idle timeouts (60 s), so that the client, never the server, closes an idle
        # connection: otherwise a request sent as the server closes it is lost in flight.
        timeout_keep_alive=75,
    )
    GracefulServer(config, app.state.admission, settings.shutdown_grace_s).run()
    return 0


# Subcommands that own their argument parsing: the rest of the command line goes to them.
_DELEGATED = {
    "engine": ("session_server.localengine", "a real vLLM engine on this machine's CPU"),
    "operator": ("tokenkeep_operator.cli", "run the Kubernetes operator"),
    "demo": ("session_server.demo", "run the whole stack locally and drive a session"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _DELEGATED:
        import importlib

        module = importlib.import_module(_DELEGATED[argv[0]][0])
        return int(module.main(argv[1:]) or 0)
    parser = argparse.ArgumentParser(prog="tokenkeep", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    for name, (_module, help_text) in _DELEGATED.items():
        sub.add_parser(name, help=help_text, add_help=False)
    args = parser.parse_args(argv)
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
