"""The published policy as the store keeps it: one JSON document every session-server
replica reads, so all of them fence the same engine replicas."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from session_server.versions import version_number

PAUSE_MODES = ("keep", "wait", "abort")


@dataclass(frozen=True, slots=True)
class PublishedPolicy:
    version: str
    source: dict[str, Any]
    """`{"path": DIR}`: a checkpoint every engine reads (replicas that fall behind are
    reloaded from it); `{"transfer": {...}}`: sent by the trainer (they stay fenced)."""
    published_at: float
    pause: str
    checksum: str | None
    """The weight checksum the replicas reported after the publish (None: none reported)."""
    pending: str | None = None
    """The version a publish in progress is moving the replicas to: a replica already there
    is not behind."""

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def decode(cls, document: bytes) -> PublishedPolicy:
        return cls(**json.loads(document))

    def accepts(self, version: str) -> bool:
        """Whether a replica reporting `version` (or a generation stamped with it) serves
        this policy: the published version, the one being published, or a newer number
        (published by another server a moment ago)."""
        if version in (self.version, self.pending):
            return True
        return not not_newer(version, self.version) and version_number(version) is not None

    @property
    def path(self) -> str | None:
        """The checkpoint folder of a `path` source (None for a transfer)."""
        path = self.source.get("path")
        return path if isinstance(path, str) else None


def not_newer(candidate: str, published: str) -> bool:
    """Whether publishing `candidate` over `published` goes back or nowhere: equal versions,
    or both numeric and `candidate` not greater. Names that are not numbers have no order:
    any other name is accepted."""
    if candidate == published:
        return True
    new, old = version_number(candidate), version_number(published)
    return new is not None and old is not None and new <= old
