"""Which engine replicas exist, which are up, and which may serve a session.

Discovery (every address a headless Service's name resolves to is one replica), health checks
in the background, the published policy's fencing, and the session's order over the replicas
that may serve: rendezvous (highest-random-weight) hashing of the session id, so every
session-server process sends a session to the same engine (its prefix cache holds the
conversation) and losing a replica moves only that replica's sessions. `EngineClient` asks
this set where to send a request; it never decides that itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import socket
import time
from collections.abc import Callable, Iterator

import httpx

from session_server.engine_wire.base import EngineError, Replica, Retryable, Wire
from session_server.store.base import WeightSpan
from session_server.tokenizer_match import UNCHECKED, TokenizerProbe

logger = logging.getLogger(__name__)

# A replica is marked down by its health check, or after this many requests in a row could not
# reach it. One refused or reset connection is not enough: under a burst a busy engine's
# accept queue overflows now and then while it is perfectly alive.
FAILURES_BEFORE_DOWN = 3
RECHECK_S = 0.5
"""While no replica is ready, a generation re-checks them at most this often."""


async def _resolve(url: str) -> list[str]:
    """`url` once per address its host resolves to (none if it does not resolve now)."""
    parsed = httpx.URL(url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(parsed.host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        logger.warning("engine host %s does not resolve: %s", parsed.host, exc)
        return []
    addresses = sorted({info[4][0] for info in infos})
    return [str(parsed.copy_with(host=address, port=port)).rstrip("/") for address in addresses]


def rendezvous_order(session_id: str, urls: list[str]) -> list[str]:
    """Replica URLs ranked for a session, best first. Stable across processes and restarts
    (a keyed hash, not Python's randomised `hash`)."""

    def weight(url: str) -> bytes:
        return hashlib.blake2b(f"{session_id}\x00{url}".encode(), digest_size=8).digest()

    return sorted(urls, key=weight, reverse=True)


class ReplicaSet:
    """The engine replicas behind one `EngineClient`, their health and their fencing."""

    def __init__(
        self,
        urls: list[str],
        *,
        wire: Wire,
        http: httpx.AsyncClient,
        health_http: httpx.AsyncClient,
        health_timeout: httpx.Timeout,
        health_interval_s: float,
        max_inflight_per_replica: int,
        discover: bool,
        tokenizer_probe: TokenizerProbe | None = None,
    ) -> None:
        self.wire = wire
        self._http = http
        self._health_http = health_http
        self._health_timeout = health_timeout
        self.health_interval_s = health_interval_s
        self.max_inflight_per_replica = max_inflight_per_replica
        self._configured = urls
        self._discover = discover
        self._tokenizer_probe = tokenizer_probe
        """Compared with each replica before it serves (None: no comparison)."""
        self._replicas = {url: Replica(url) for url in urls}
        for replica in self._replicas.values():
            self._tokenizer_unchecked(replica)
        self.on_unverified: list[Callable[[Replica], None]] = []
        """Called with each replica whose weights may have changed behind tokenkeep's back:
        added by discovery, or marked down (it may come back restarted). The policy fences
        it until it is known to serve the published version."""
        self.published_version: str | None = None
        """The policy version published through tokenkeep (None: none)."""
        self.accepts_version: Callable[[str], bool] | None = None
        """Whether a generation stamped with this version may be kept (None: any)."""
        self._health_task: asyncio.Task[None] | None = None
        self._recheck: asyncio.Task[None] | None = None
        self._rechecked_at = -math.inf
        self._down_reasons: dict[str, str] = {}
        """Per replica URL, what its last failed health check said (for the refusal)."""

    @property
    def replicas(self) -> list[Replica]:
        return list(self._replicas.values())

    async def start(self) -> None:
        """Check every replica once, then keep checking in the background."""
        await self.discover()
        await self.check_health()
        if self._health_task is None:
            self._health_task = asyncio.create_task(self._health_loop(), name="engine-health")

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
            self._health_task = None
        if self._recheck is not None:
            await asyncio.gather(self._recheck, return_exceptions=True)

    async def ready(self) -> bool:
        """At least one replica answers its health check."""
        if self._health_task is None:
            await self.check_health()
        return any(replica.healthy for replica in self._replicas.values())

    async def check_health(self) -> None:
        await asyncio.gather(*(self._check(r) for r in self._replicas.values()))

    async def _check(self, replica: Replica, *, strike_on_timeout: bool = True) -> None:
        """A refused connection or a non-200 answer is a definite "down". A check that times
        out is not: a server whose own event loop is saturated by a burst sees its timers
        fire before it reads the answer, so a timeout only counts towards the failures in
        a row (`strike_on_timeout`)."""
        try:
            response = await self._health_http.get(replica.url + self.wire.health_path)
            healthy = response.status_code == 200
            self._down_reasons[replica.url] = f"health check answered {response.status_code}"
        except httpx.TimeoutException as exc:
            if strike_on_timeout:
                self._strike(replica, f"health check timed out: {exc!r}")
            return
        except httpx.HTTPError as exc:
            healthy = False
            self._down_reasons[replica.url] = f"unreachable: {exc!r}"
        if healthy != replica.healthy:
            logger.warning("engine %s is now %s", replica.url, "up" if healthy else "down")
            if not healthy:
                self._unverified(replica)  # it may come back restarted: on which weights?
        replica.healthy = healthy
        if healthy:
            replica.failures = 0
        if healthy:
            await self.wire.probe(self._http, replica, self._health_timeout)
            if replica.tokenizer_differs is not None:
                await self._compare_tokenizer(replica)

    def _tokenizer_unchecked(self, replica: Replica) -> None:
        if self._tokenizer_probe is not None:
            replica.tokenizer_differs = UNCHECKED

    async def _compare_tokenizer(self, replica: Replica) -> None:
        """Probe a replica not (yet) known to tokenize as this server does; one that differs
        keeps getting no turns, and is probed again every health round."""
        assert self._tokenizer_probe is not None  # only set where a probe is configured
        differs = await self._tokenizer_probe.compare(self._http, replica.url, self._health_timeout)
        if differs is not None and differs != UNCHECKED and differs != replica.tokenizer_differs:
            logger.error("engine %s refused: tokenizer %s", replica.url, differs)
        elif differs is None:
            logger.info("engine %s tokenizes as this server does", replica.url)
        replica.tokenizer_differs = differs

    def observe_version(
        self,
        replica: Replica,
        spans: list[WeightSpan] | None,
        accepted_at_start: Callable[[str], bool] | None,
    ) -> None:
        """Note the version that sampled a reply's last tokens; raise `Retryable` (fencing
        the replica) where neither the policy published when the request was sent nor the
        one published now accepts it: a replica restarted on its base weights between two
        health rounds gets no turn stored, while a turn that finished on the old weights
        as a publish began (pause "wait") is kept."""
        if not spans:
            return
        version = spans[-1].version
        replica.weight_version = version
        if (
            accepted_at_start is not None
            and not accepted_at_start(version)
            and not (self.accepts_version is None or self.accepts_version(version))
        ):
            replica.fenced = f"behind: sampled with {version}, published {self.published_version}"
            logger.warning("engine %s fenced: %s", replica.url, replica.fenced)
            raise Retryable(
                EngineError(
                    503,
                    f"engine {replica.url} sampled with policy {version}, not the published "
                    f"{self.published_version}; nothing was stored",
                    "PolicyFenced",
                ),
                mark_down=False,
            )

    async def discover(self) -> None:
        """With discovery on, every address a configured host name resolves to is one
        replica (a Kubernetes headless Service lists each engine pod), re-resolved on every
        health round: pods that come are added, pods that go are dropped."""
        if not self._discover:
            return
        found: dict[str, Replica] = {}
        for url in self._configured:
            for address_url in await _resolve(url):
                found[address_url] = self._replicas.get(address_url) or Replica(address_url)
        if found and found.keys() != self._replicas.keys():
            logger.info("engine replicas: %s", ", ".join(sorted(found)))
            added = [replica for url, replica in found.items() if url not in self._replicas]
            self._replicas = found
            for replica in added:
                self._unverified(replica)

    def _unverified(self, replica: Replica) -> None:
        self._tokenizer_unchecked(replica)  # it may come back serving another model
        for hook in self.on_unverified:
            hook(replica)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            try:
                await self.discover()
                await self.check_health()
            except Exception:  # the loop must outlive any single bad check
                logger.exception("engine health check failed")

    def order_for(self, session_id: str) -> list[Replica]:
        """Replicas to try for a session: healthy ones in rendezvous order. If none is marked
        healthy, all of them (a stale mark must not turn into a guaranteed failure). A fenced
        replica (behind the published policy, or its update failed) or one whose tokenizer
        differs from this server's (or is not yet compared) is never a candidate."""
        serving = {url: r for url, r in self._replicas.items() if r.refused is None}
        if not serving:
            reasons = "; ".join(f"{r.url}: {r.refused}" for r in self._replicas.values())
            if any(r.fenced for r in self._replicas.values()):
                raise EngineError(
                    503,
                    f"no engine replica serves the published policy now ({reasons}); retry later",
                    "PolicyFenced",
                )
            if any(r.tokenizer_differs != UNCHECKED for r in self._replicas.values()):
                raise EngineError(
                    503,
                    f"no engine replica tokenizes as this session server does ({reasons}); "
                    "nothing was sampled",
                    "TokenizerMismatch",
                )
            raise EngineError(
                503,
                f"no engine replica is compared with this server's tokenizer yet ({reasons}); "
                "retry the turn later",
                "EngineUnavailable",
                retry_after_s=max(1, math.ceil(self.health_interval_s)),
            )
        healthy = [url for url, r in serving.items() if r.healthy]
        ranked = rendezvous_order(session_id, healthy or list(serving))
        return [self._replicas[url] for url in ranked]

    async def need_ready(self) -> None:
        """Refuse a generation at once (503, retryable) while no replica that may serve
        passes its health check: every engine restarting or loading its model. The marks
        are first refreshed by one check (shared by the requests that arrive meanwhile, at
        most one per `RECHECK_S`), so a stale mark is not a refusal. Without the health loop
        (a client used without `start`) the replicas are tried as before."""
        if self._health_task is None or self._any_ready():
            return
        if self._recheck is None and time.monotonic() - self._rechecked_at >= RECHECK_S:
            self._recheck = asyncio.create_task(self._refresh(), name="engine-recheck")
        if self._recheck is not None:
            await asyncio.shield(self._recheck)
        if self._any_ready() or not any(
            r.fenced is None and r.tokenizer_differs in (None, UNCHECKED)
            for r in self._replicas.values()
        ):
            return  # a refused fleet is order_for's refusal (PolicyFenced, TokenizerMismatch)
        down = "; ".join(
            f"{url}: {self._down_reasons.get(url, 'marked down')}" for url in sorted(self._replicas)
        )
        raise EngineError(
            503,
            f"no engine replica is ready (restarting or loading its model? {down or 'none'}); "
            "sessions, finish and export still work; retry the turn later",
            "EngineUnavailable",
            retry_after_s=max(1, math.ceil(self.health_interval_s)),
        )

    def _any_ready(self) -> bool:
        return any(r.healthy and r.refused is None for r in self._replicas.values())

    async def _refresh(self) -> None:
        try:
            await self.discover()
            await self.check_health()
        except Exception:  # as in the health loop: a bad check is not the request's error
            logger.exception("engine health check failed")
        finally:
            self._rechecked_at = time.monotonic()
            self._recheck = None

    def attempts(self, session_id: str) -> Iterator[Replica]:
        """Where to send a request, in turn: the candidates, then the candidates once more,
        ranked again. A failure before the first token moves on, and a second round catches
        a failure that says nothing about the replica (a pooled connection the engine had
        just closed, a replica marked down a moment ago that has recovered)."""
        for _ in range(2):
            yield from self._candidates(session_id)

    def _candidates(self, session_id: str) -> list[Replica]:
        """`order_for`, less the replicas at their in-flight limit (a full preferred replica
        sends the session to the next one rather than queueing it there)."""
        order = self.order_for(session_id)
        free = [r for r in order if r.inflight < self.max_inflight_per_replica]
        if not free:
            raise EngineError(
                503,
                f"every engine replica has {self.max_inflight_per_replica} requests in flight; "
                "retry later",
                "EngineOverloaded",
            )
        return free

    async def unreachable(self, replica: Replica, reason: str) -> None:
        """A request could not reach `replica`: it is asked at once whether it is alive (its
        health check decides, so a dead engine stops receiving traffic right away), and
        repeated failures mark it down regardless."""
        self._strike(replica, reason)
        if replica.healthy:
            await self._check(replica, strike_on_timeout=False)

    def _strike(self, replica: Replica, reason: str) -> None:
        replica.failures += 1
        if replica.failures >= FAILURES_BEFORE_DOWN and replica.healthy:
            logger.warning(
                "engine %s marked down: %d failures in a row, last: %s",
                replica.url,
                replica.failures,
                reason,
            )
            replica.healthy = False
            self._unverified(replica)
