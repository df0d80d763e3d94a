"""The policy versions the engine replicas serve, and how far a rollout may lag behind them
(`--max-policy-lag`)."""

from __future__ import annotations

from session_server.engines import EngineClient
from session_server.metrics import Metrics
from session_server.service_config import ServiceConfig
from session_server.store.base import (
    LookupResult,
    TurnRecord,
)
from session_server.turns.errors import Refused
from session_server.versions import (
    first_weight_version,
    version_number,
)


class PolicyLag:
    """Which policy version each engine replica serves, and whether a rollout lags too far."""

    def __init__(self, engine: EngineClient, config: ServiceConfig, metrics: Metrics) -> None:
        self.engine = engine
        self.config = config
        self.metrics = metrics

    def engine_versions(self) -> dict[str, str | None]:
        """Replica URL -> the policy version it serves (None: not known yet)."""
        return {replica.url: replica.weight_version for replica in self.engine.replicas}

    def engine_version(self) -> float | None:
        """The published policy version (`POST /policy`) where it is a number, else the
        newest numeric version any replica serves (None: none known)."""
        published = self.engine.published_version
        if published is not None and (number := version_number(published)) is not None:
            return number
        numbers = [
            version_number(replica.weight_version)
            for replica in self.engine.replicas
            if replica.weight_version is not None
        ]
        known = [n for n in numbers if n is not None]
        return max(known) if known else None

    def policy_lag(self, first: TurnRecord | None) -> tuple[str | None, bool]:
        """The version that sampled `first` (a rollout's first turn) and whether the engine
        has moved more than `max_policy_lag` versions past it."""
        version = first_weight_version([first] if first else [])
        return version, self.lag_exceeded(version)

    def lag_exceeded(self, first_version: str | None) -> bool:
        """Whether the engine has moved more than `max_policy_lag` versions past the version
        that sampled a rollout's first turn (never without a bound or numeric versions)."""
        lag = self.config.max_policy_lag
        start = None if first_version is None else version_number(first_version)
        current = self.engine_version()
        if lag is None or start is None or current is None:
            return False
        return current > start + lag

    def check(self, found: LookupResult) -> None:
        """Refuse, before any engine call, a turn of a rollout that drifted too far
        off-policy (`--max-policy-lag`)."""
        if self.config.max_policy_lag is None:
            return
        if found.retry_of is not None:
            root = found.retry_path[0] if found.retry_path else found.retry_of
        else:
            root = found.parent_path[0] if found.parent_path else None
        version, exceeded = self.policy_lag(root)
        if exceeded:
            self.metrics.rejections.labels(reason="policy_lag").inc()
            raise Refused(
                409,
                f"policy lag exceeded: this rollout's first turn was sampled at version "
                f"{version}, the engine serves {self.engine_version():g} "
                f"(--max-policy-lag {self.config.max_policy_lag}); start a new rollout",
                kind="policy_lag_exceeded",
            )
