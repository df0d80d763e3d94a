"""Session API keys: `tks-<secret>.<session id>`, issued once by `POST /sessions`; the store
keeps only the SHA-256 digest, which the guard (`api/auth.py`) compares in constant time."""

from __future__ import annotations

import hashlib
import hmac
import secrets

SESSION_KEY_PREFIX = "tks-"


def issue_session_key(session_id: str) -> tuple[str, str]:
    """A new session key and the digest the store keeps (the key itself is never stored)."""
    key = f"{SESSION_KEY_PREFIX}{secrets.token_urlsafe(32)}.{session_id}"
    return key, key_digest(key)


def key_digest(key: str) -> str:
    # A fast hash is enough: the secret has 256 random bits, nothing to brute-force.
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def key_opens(key_hash: str, digest: str) -> bool:
    """Whether a session key with this digest opens a session that stores `key_hash`
    (compared in constant time; a session issued no key opens to none)."""
    return bool(key_hash) and hmac.compare_digest(key_hash, digest)
