"""What the parts of the turn core that read sessions and the model share (the planner, the
recorder, the Idempotency-Key claims): one constructor, so that `TurnService` wires them alike."""

from __future__ import annotations

from session_server.metrics import Metrics
from session_server.service_config import ServiceConfig
from session_server.splice import ChatModel
from session_server.store.base import SessionStore
from session_server.turns.sessions import SessionCache


class CorePart:
    def __init__(
        self,
        store: SessionStore,
        model: ChatModel,
        config: ServiceConfig,
        sessions: SessionCache,
        metrics: Metrics,
    ) -> None:
        self.store = store
        self.model = model
        self.config = config
        self.sessions = sessions
        self.metrics = metrics
