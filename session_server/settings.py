"""Server settings: every flag of `tokenkeep serve` also reads a TOKENKEEP_* variable
(which is how the operator configures pods)."""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TOKENKEEP_", extra="ignore")

    engine_urls: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """vLLM replicas (TOKENKEEP_ENGINE_URLS, comma-separated)."""
    engine_discovery: bool = False
    """Treat every address an engine host name resolves to as a replica, re-resolved over
    time (TOKENKEEP_ENGINE_DISCOVERY; the operator sets it for its headless Service)."""
    model: str = "default"
    """The model name the engine serves (sent to the engine, reported to clients)."""
    tokenizer: str = ""
    """A local tokenizer directory or a Hugging Face id available offline."""
    renderer: str = "auto"
    redis_url: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    context_length: int | None = None
    """Max model length; default: asked from the engine, else the tokenizer's."""
    session_ttl_seconds: int | None = 86400
    create_sessions_on_first_use: bool = True
    routed_experts: bool = False
    """MoE routing replay for every session that does not say otherwise
    (TOKENKEEP_ROUTED_EXPERTS; the engine needs --enable-return-routed-experts)."""
    sampling_overrides: dict[str, Any] = Field(default_factory=dict)
    """Server-wide sampling overrides (JSON), below a session's own."""
    api_key: str | None = None
    """If set, every request must present it (Bearer or x-api-key); the session then
    comes from the path or X-Session-ID."""
    log_level: str = "info"

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
