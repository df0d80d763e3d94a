"""Server settings: every flag of `tokenkeep serve` also reads a TOKENKEEP_* variable
(which is how the operator configures pods)."""

from __future__ import annotations

import functools
import ipaddress
import json
import logging
from typing import Annotated, Any, Literal

from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="TOKENKEEP_", extra="ignore", populate_by_name=True
    )

    engine_urls: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """Engine replicas (TOKENKEEP_ENGINE_URLS, comma-separated)."""
    engine_kind: Literal["vllm", "sglang"] = "vllm"
    """Which engine's wire format the replicas speak (TOKENKEEP_ENGINE_KIND, flag --engine):
    vLLM's token endpoint or SGLang's native /generate (session_server/engine_wire/)."""
    engine_discovery: bool = False
    """Treat every address an engine host name resolves to as a replica, re-resolved over
    time (TOKENKEEP_ENGINE_DISCOVERY; the operator sets it for its headless Service)."""
    model: str = "default"
    """The model name the engine serves (sent to the engine, reported to clients)."""
    tokenizer: str = ""
    """A local tokenizer directory or a Hugging Face id available offline."""
    renderer: str = "auto"
    redis_url: str | None = None
    """redis://, rediss://, redis+sentinel://..., redis+cluster://... (store/redis.py)."""
    redis_retry_s: float = 2.0
    """How long one store operation is retried while Redis is unreachable before 503."""
    redis_timeout_s: float = 5.0
    """Socket timeout of one Redis command."""
    redis_wait_replicas: int = 0
    """Acknowledge a turn only after this many Redis replicas hold it (WAIT); 0 = off."""
    redis_wait_timeout_ms: int = 1000
    max_inflight: int = 256
    """Generation requests this process runs at once (the rest wait in the queue)."""
    max_queue: int = 8192
    """Generation requests that may wait for a slot; more are refused with 429. Sized for an
    RL step's rollout burst (4,096 at once, like vLLM's own unbounded queue): a waiting
    request costs its connection and up to uvicorn's 64 KiB read buffer of its body
    (bench/results/served.md measures it), so the default bounds the queue's memory to well
    under 1 GiB."""
    queue_timeout_s: float = 600.0
    """How long a request may wait for a slot before 503 (the engine request timeout: a burst
    drains at the engine's pace, and waiting here is what vLLM would do with it)."""
    engine_max_inflight: int = 256
    """Requests in flight to one engine replica (vLLM's default max_num_seqs is 256)."""
    shutdown_grace_s: float = 30.0
    """On SIGTERM: how long in-flight requests may take to finish before the process exits."""
    host: str = "127.0.0.1"
    port: int = 8000
    context_length: int | None = None
    """Max model length (prompt + completion). Default: the tokenizer's `model_max_length`
    (32768 where it has none, at most 2**20). The engine is not asked: set it to the
    engine's `--max-model-len` where that is smaller."""
    session_ttl_seconds: int | None = 86400
    create_sessions_on_first_use: bool = True
    max_policy_lag: int | None = Field(default=None, ge=0)
    """Refuse a new turn (409) once the engine's policy version exceeds the version that
    sampled the rollout's first turn by more than this (numeric versions; None = off)."""
    routed_experts: bool = False
    """MoE routing replay for every session that does not say otherwise
    (TOKENKEEP_ROUTED_EXPERTS; the engine needs --enable-return-routed-experts)."""
    sampling_overrides: dict[str, Any] = Field(default_factory=dict)
    """Server-wide sampling overrides (JSON), below a session's own."""
    admin_key: str | None = Field(
        default=None,
        validation_alias=AliasChoices("admin_key", "TOKENKEEP_ADMIN_KEY", "TOKENKEEP_API_KEY"),
    )
    """Opens every endpoint (Bearer or x-api-key). Unset: protected mode, loopback clients
    only (see session_server.api.auth). TOKENKEEP_API_KEY is its older name."""
    session_id_keys: bool = False
    """Accept `tk-<session id>` as that session's key (derivable from the id: trusted
    setups only)."""
    insecure: bool = False
    """With no admin key, answer every client, not only loopback ones."""
    max_body_bytes: int = Field(default=8 << 20, ge=1024)
    """Largest request body accepted; larger ones get 413 before they are read."""
    log_level: str = "info"
    reasoning_item_key: str | None = None
    """Signs the `encrypted_content` of Responses reasoning items; unset, a random key per
    process (items from another replica or before a restart are then not recognised and the
    lineage falls back to the messages, which is always correct, only less exact)."""
    startup_check: bool = True
    """`tokenkeep serve` runs a few `tokenkeep check` scenarios at start-up, in the background,
    and logs the verdict (TOKENKEEP_STARTUP_CHECK)."""
    check_cache_dir: str = "~/.cache/tokenkeep/check"
    """Start-up check verdicts, one file per tokenizer + template hash."""

    @field_validator("engine_urls", mode="before")
    @classmethod
    def _split_urls(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [u.strip() for u in value.split(",") if u.strip()]
        return value

    @field_validator("sampling_overrides", mode="before")
    @classmethod
    def _parse_json(cls, value: Any) -> Any:
        if isinstance(value, str):
            return json.loads(value) if value.strip() else {}
        return value


# --- protected mode (see session_server.api.auth); here so that `tokenkeep serve` can refuse
# to start before importing the server.


@functools.lru_cache(maxsize=1024)  # the guard asks it for the client of every request
def is_loopback(host: str | None) -> bool:
    if not host:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


def listen_problem(settings: Settings) -> str | None:
    """Why `tokenkeep serve` must not start with these settings (protected mode), or None."""
    if settings.admin_key or settings.insecure or is_loopback(settings.host):
        return None
    return (
        f"refusing to listen on {settings.host} without credentials: set an admin key "
        "(--admin-key / TOKENKEEP_ADMIN_KEY), or pass --insecure to let anyone who can reach "
        "this address use every session"
    )


def log_mode(settings: Settings) -> None:
    """The one start-up log line that says how requests are authenticated (a warning
    wherever something is left open)."""
    log = logging.getLogger("tokenkeep")
    if settings.admin_key and not settings.session_id_keys:
        log.info("auth: admin key and per-session keys required")
    elif settings.admin_key:
        log.warning("auth: admin key and per-session keys required; tk-<session id> keys accepted")
    elif settings.insecure:
        log.warning("auth: INSECURE: no credentials checked, for any client (--insecure)")
    else:
        log.warning(
            "auth: protected mode: no admin key configured, so loopback clients are answered "
            "without credentials and all other clients are refused"
        )
