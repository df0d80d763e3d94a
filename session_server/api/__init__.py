"""The HTTP front-ends: each translates its wire format and calls a service: the turn APIs
`TurnService`, the management API and the viewer `SessionService`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import Request

if TYPE_CHECKING:
    from session_server.management import SessionService
    from session_server.turns.service import TurnService


def turn_service(request: Request) -> TurnService:
    """The app's `TurnService`: how every front-end reaches sessions, the model and the store."""
    service: TurnService = request.app.state.turns
    return service


def session_service(request: Request) -> SessionService:
    """The app's `SessionService`: how the management API and the viewer reach sessions."""
    service: SessionService = request.app.state.sessions
    return service
