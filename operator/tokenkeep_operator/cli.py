"""`tokenkeep operator`: run the Kopf operator with tokenkeep's handlers, one active at a time."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlparse

import kopf

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")

logger = logging.getLogger(__name__)


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
    election = parser.add_argument_group(
        "leader election", "operators sharing a Lease take turns: one works, the others wait"
    )
    election.add_argument(
        "--no-leader-election", action="store_true", help="work without holding the Lease"
    )
    election.add_argument(
        "--lease-namespace",
        metavar="NS",
        help="namespace of the Lease (default: the pod's namespace, else `default`)",
    )
    election.add_argument("--lease-name", default="tokenkeep-operator", metavar="NAME")
    election.add_argument(
        "--lease-duration",
        type=float,
        default=15.0,
        metavar="SECONDS",
        help="how long a silent holder keeps the Lease before a standby takes it (default 15)",
    )
    election.add_argument(
        "--lease-forbidden-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="exit non-zero when RBAC has refused the Lease this long (default 30)",
    )
    parser.add_argument("--debug", action="store_true", help="log Kopf's internals too")
    return parser


class _StandbyHealth(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"standby\n")

    def log_message(self, *_: object) -> None:
        pass


def _standby_liveness(url: str | None) -> ThreadingHTTPServer | None:
    """A waiting operator is alive: answer the liveness probe until Kopf serves it."""
    if not url:
        return None
    parsed = urlparse(url)
    server = ThreadingHTTPServer((parsed.hostname or "0.0.0.0", parsed.port or 80), _StandbyHealth)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _stop_kopf() -> None:
    """Stop Kopf as SIGTERM does (its graceful path). Not Kopf's `stop_flag`: every kind of
    flag it accepts is waited for in a worker thread that then blocks the exit."""
    os.kill(os.getpid(), signal.SIGTERM)


def _lease_namespace(explicit: str | None) -> str:
    if explicit:
        return explicit
    if SERVICE_ACCOUNT_NAMESPACE.is_file():
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
    return "default"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    kopf.configure(debug=args.debug, verbose=args.debug)
    logging.getLogger("tokenkeep_operator").setLevel(logging.INFO)
    if not args.debug:
        # Kopf logs every handled event at INFO; its warnings and errors are what matter.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    from tokenkeep_operator import handlers  # noqa: F401  (registers the handlers)

    lost = threading.Event()
    elector = None
    if not args.no_leader_election:
        from tokenkeep_operator.kube import Kube, load_config
        from tokenkeep_operator.leader import LeaderElector, LeaseForbidden

        elector = LeaderElector(
            Kube(load_config()),
            _lease_namespace(args.lease_namespace),
            args.lease_name,
            duration=args.lease_duration,
            forbidden_timeout=args.lease_forbidden_timeout,
        )
        health = _standby_liveness(args.liveness)
        stopping = threading.Event()
        previous = signal.signal(signal.SIGTERM, lambda *_: stopping.set())
        try:
            if not elector.wait_for_leadership(stopping):
                return 0  # stopped while on standby
        except LeaseForbidden as forbidden:
            # Not a standby: no other operator will ever let this one work.
            logging.getLogger("tokenkeep_operator").error("cannot lead: %s", forbidden)
            return 2
        except KeyboardInterrupt:
            return 0
        finally:
            signal.signal(signal.SIGTERM, previous)
            if health is not None:
                health.shutdown()
                health.server_close()
        renewing = threading.Event()
        threading.Thread(
            target=elector.keep_renewing, args=(renewing, lost, _stop_kopf), daemon=True
        ).start()
    try:
        kopf.run(
            standalone=True,  # no Kopf peering: the Lease decides who works
            clusterwide=args.all_namespaces,
            namespaces=args.namespace or (),
            liveness_endpoint=args.liveness,
        )
    finally:
        if elector is not None:
            renewing.set()
            if not lost.is_set():
                elector.release()
    # Losing the Lease is a failure: exit non-zero so the pod restarts as a candidate.
    return 1 if lost.is_set() else 0
