"""The HTTP front-ends: each translates its wire format and calls the `TurnService`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import Request

if TYPE_CHECKING:
    from session_server.turns.service import TurnService


def turn_service(request: Request) -> TurnService:
    """The app's `TurnService`: how every front-end reaches sessions, the model and the store."""
    service: TurnService = request.app.state.turns
    return service
