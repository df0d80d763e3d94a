"""`tokenkeep` command line: serve, engine, demo, operator."""

from __future__ import annotations

import argparse
import logging
import os
import sys

# How long an idle client connection stays open. It must outlast the clients' own pool expiry
# (httpx and the OpenAI/Anthropic SDKs: 5 s, aiohttp: 15 s): with uvicorn's default of 5 s the
# server closed connections that a busy client was just reusing, and that request got no
# response at all.
KEEP_ALIVE_S = 75


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
    p.add_argument("--log-level", default=env("TOKENKEEP_LOG_LEVEL", "info"))


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from session_server.app import create_app
    from session_server.settings import Settings

    overrides = {
        k: v for k, v in vars(args).items() if v is not None and k in Settings.model_fields
    }
    settings = Settings(**overrides)
    if not settings.engine_urls:
        print("tokenkeep serve: give --engine-url (or TOKENKEEP_ENGINE_URLS)", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(message)s")
    # httpx logs every engine request at INFO: a second line per turn, formatted on the
    # request path, next to tokenkeep's own access log.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.root.level))
    app = create_app(settings)
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=False,
        timeout_keep_alive=KEEP_ALIVE_S,
    )
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
