"""`tokenkeep operator`: run the Kopf operator with tokenkeep's handlers."""

from __future__ import annotations

import argparse

import kopf


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenkeep operator",
        description="Run the operator for ModelServer and SessionServer resources.",
    )
    scope = parser.add_mutually_exclusive_group(required=True)
    scope.add_argument(
        "--namespace",
        action="append",
        metavar="NS",
        help="watch this namespace (repeatable)",
    )
    scope.add_argument("--all-namespaces", action="store_true", help="watch every namespace")
    parser.add_argument(
        "--liveness",
        metavar="URL",
        help="serve a liveness endpoint, e.g. http://0.0.0.0:8080/healthz",
    )
    parser.add_argument("--debug", action="store_true", help="log Kopf's internals too")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    kopf.configure(debug=args.debug, verbose=args.debug)
    from tokenkeep_operator import handlers  # noqa: F401  (registers the handlers)

    # One operator replica (the chart's Deployment uses Recreate): no peering needed.
    kopf.run(
        standalone=True,
        clusterwide=args.all_namespaces,
        namespaces=args.namespace or (),
        liveness_endpoint=args.liveness,
    )
    return 0
