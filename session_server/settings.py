"""Server settings: every flag of `tokenkeep serve` also reads a TOKENKEEP_* variable
(which is how the operator configures pods)."""

from __future__ import annotations

import difflib
import functools
import ipaddress
import json
import logging
import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import AliasChoices, Field, field_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from session_server.shared_tokens import DEFAULT_BUDGET_BYTES

ENV_PREFIX = "TOKENKEEP_"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", populate_by_name=True)

    engine_urls: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """Engine replicas (TOKENKEEP_ENGINE_URLS, comma-separated)."""
    engine_kind: Literal["vllm", "sglang"] = "vllm"
    """Which engine's wire format the replicas speak (TOKENKEEP_ENGINE_KIND, flag --engine):
    vLLM's token endpoint or SGLang's native /generate (session_server/engine_wire/)."""
    engine_key: str | None = None
    """Sent to every engine replica as `Authorization: Bearer` (TOKENKEEP_ENGINE_KEY): an
    engine started for publishing asks for it on every path but /health
    (session_server/vllm_extension.py; `tokenkeep engine start --engine-key`, the operator's
    engine Secret)."""
    engine_health_interval_s: float = Field(default=5.0, gt=0)
    """How often each engine replica is health-checked, its policy version read and, with a
    published policy, fenced or caught up (TOKENKEEP_ENGINE_HEALTH_INTERVAL_S)."""
    engine_discovery: bool = False
    """Treat every address an engine host name resolves to as a replica, re-resolved over
    time (TOKENKEEP_ENGINE_DISCOVERY; the operator sets it for its headless Service)."""
    model: str = "default"
    """The model name the engine serves (sent to the engine, reported to clients)."""
    tokenizer: str = ""
    """A local tokenizer directory or a Hugging Face id available offline."""
    tokenizer_revision: str | None = None
    """The Hugging Face revision (branch, tag, commit) of `tokenizer` to load
    (TOKENKEEP_TOKENIZER_REVISION): the operator sets the ModelServer's `model.revision`, so
    an engine pinned to a commit is never paired with the tokenizer of `main`."""
    renderer: str = "auto"
    redis_url: str | None = None
    """redis://, rediss://, redis+sentinel://..., redis+cluster://... (store/redis.py)."""
    redis_password: str | None = None
    """The Redis password where the URL carries none (TOKENKEEP_REDIS_PASSWORD; the operator
    sets it from the managed Redis's Secret, so the URL itself holds no secret)."""
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
    request costs its connection and its body, read before it queues (a request is admitted
    only once its body is there, so that slow senders hold no slot): typical turn bodies of
    tens of KiB keep a full queue under 1 GiB; bodies near --max-body-bytes multiply that."""
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
    max_body_strings: int = Field(default=1 << 16, ge=1024)
    """Most JSON strings (keys and values) a request body may hold; more get 413 as the body
    arrives, before it is parsed. Validating a body holds the GIL in one call (pydantic-core):
    225k tiny messages in 8 MiB held every other request, /healthz included, for over a
    second. Measured on 2 cores at load ~3: 65,531 strings validate in 22 ms, 131,067 in
    125 ms. A 2,000-step tool-calling conversation is ~45k strings."""
    body_timeout_s: float = Field(default=60.0, gt=0)
    """A request's whole body must arrive within this many seconds of its headers, else 408
    (8 MiB takes well under a second on any link a rollout runs over). A generation request
    waits for an admission slot only once its body is read, so slow bodies hold no slot."""
    keep_alive_s: float = Field(default=75.0, gt=0)
    """How long an idle client connection stays open between requests. It must outlast the
    clients' own pool expiry (httpx and the OpenAI/Anthropic SDKs: 5 s, aiohttp: 15 s): with
    uvicorn's default of 5 s the server closed connections that a busy client was just
    reusing, and that request got no response at all."""
    header_timeout_s: float = Field(default=10.0, gt=0)
    """A request's headers must be complete within this many seconds of its first byte (or
    of the connection's opening), else the connection is closed: uvicorn has no such bound,
    so connections that never finished a request were kept for ever."""
    shared_tokens_bytes: int = Field(default=DEFAULT_BUDGET_BYTES, ge=0)
    """Bytes of token ids kept for long texts many rollouts send (a group's first message, a
    shared system prompt and tool list), so that each is tokenized once per process; least
    recently used first out. 0 tokenizes every text each time."""
    max_header_bytes: int = Field(default=64 << 10, ge=1024)
    """Largest request line + headers accepted; past it the connection is closed."""
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


def _variables(name: str, info: FieldInfo) -> tuple[str, ...]:
    """The variables that set one field, its current name first: pydantic-settings reads a
    field with a validation alias from the alias's names only (no prefix added)."""
    if isinstance(info.validation_alias, AliasChoices):
        return tuple(
            c
            for c in info.validation_alias.choices
            if isinstance(c, str) and c.startswith(ENV_PREFIX)
        )
    return (ENV_PREFIX + name.upper(),)


ENV_NAMES: dict[str, str] = {
    name: _variables(name, info)[0] for name, info in Settings.model_fields.items()
}
"""Setting -> the variable that sets it. The operator renders the server's environment from
these names, so that a setting renamed here cannot leave it writing one the server ignores."""

READ_VARIABLES = frozenset(
    v for name, info in Settings.model_fields.items() for v in _variables(name, info)
)
"""Every TOKENKEEP_* variable the settings read (older names included)."""

OTHER_VARIABLES = frozenset(
    {
        # The client CLI (`tokenkeep sessions` / `export`), often set in the same shell.
        "TOKENKEEP_URL",
        # Codex's env_key for a session key (docs/harnesses.md, tests/harnesses).
        "TOKENKEEP_SESSION_KEY",
        "TOKENKEEP_KEY",
        # `tokenkeep engine` and `make venv`: the local vLLM's cache, and skipping it.
        "TOKENKEEP_CACHE_DIR",
        "TOKENKEEP_SKIP_VLLM",
        # The operator (its chart sets them on its own pod) and `make images`.
        "TOKENKEEP_IMAGE",
        "TOKENKEEP_OPERATOR_DEBOUNCE_SECONDS",
        "TOKENKEEP_MKIMAGE",
        # Test and benchmark switches, exported for a whole test run.
        "TOKENKEEP_VLLM_URL",
        "TOKENKEEP_VLLM_VISION_URL",
        "TOKENKEEP_RECORD_RESULTS",
        "TOKENKEEP_RECORD_HARNESS_FIXTURES",
        "TOKENKEEP_FUZZ_SECONDS",
        "TOKENKEEP_HEALTHZ_BOUND_S",
        "TOKENKEEP_ARTIFACTS",
        "TOKENKEEP_K8S_DIR",
    }
)
"""TOKENKEEP_* variables of other parts of tokenkeep: `serve` leaves them alone."""

# Kubernetes service links of a Service named tokenkeep-*: FOO_SERVICE_HOST, FOO_SERVICE_PORT
# (_NAME), FOO_PORT and FOO_PORT_<port>_<PROTO>(_PROTO|_PORT|_ADDR), in pods that keep
# enableServiceLinks on (the operator's pods turn it off). FOO_PORT is told apart by its value.
_SERVICE_LINK = re.compile(r"_SERVICE_(HOST|PORT(_\w+)?)|_PORT_\d+_(TCP|UDP|SCTP)(_\w+)?")
_SERVICE_LINK_VALUE = re.compile(r"(tcp|udp|sctp)://")


def unknown_variable(environ: Mapping[str, str]) -> str | None:
    """Why `tokenkeep serve` must not start with this environment: the first TOKENKEEP_*
    variable it would silently ignore (a misspelt setting), with the closest real name."""
    for variable, value in sorted(environ.items()):
        name = variable.upper()  # pydantic-settings matches names case-insensitively
        if (
            not name.startswith(ENV_PREFIX)
            or name in READ_VARIABLES
            or name in OTHER_VARIABLES
            or _SERVICE_LINK.search(name, len(ENV_PREFIX) - 1)
            or (name.endswith("_PORT") and _SERVICE_LINK_VALUE.match(value))
        ):
            continue
        close = difflib.get_close_matches(name, sorted(READ_VARIABLES), n=1, cutoff=0)
        return f"unknown setting {variable}; did you mean {close[0]}?"
    return None


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
