"""What the turn core refuses with, each mapped to its HTTP status by `api.errors`."""

from __future__ import annotations


class SessionMissing(LookupError):
    """The session does not exist and sessions are not created on first use (404)."""


class ProofFailed(RuntimeError):
    """The engine reports a prompt other than the one tokenkeep sent (502)."""


class Refused(RuntimeError):
    """A request the core refuses as it stands, nothing stored: `status` (409, 422...),
    `kind` (the error type; None: the API's usual type for the status), `param`, and
    `retry_after_s` when trying again later can succeed."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str | None = None,
        param: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.param = param
        self.retry_after_s = retry_after_s


class Aborted(Refused):
    """The request was cut by `POST /sessions/{id}/abort`: its generation (its cut turn is
    stored with finish_reason "abort"), or, `sent` False, before it reached the engine
    (nothing sampled, nothing stored). 400: an SDK does not resend it by itself."""

    def __init__(self, session_id: str, *, sent: bool = True) -> None:
        cut = (
            "generation aborted by POST /sessions/{id}/abort; the cut turn is stored with "
            "finish_reason abort"
            if sent
            else "request aborted by POST /sessions/{id}/abort before it reached the engine; "
            "nothing was sampled or stored"
        )
        super().__init__(
            400,
            cut.format(id=session_id) + " and the session stays usable",
            kind="aborted",
        )


def session_finished(session_id: str) -> Refused:
    """A turn of a finished session: refused before the engine, or its generation cut by
    the finish (nothing stored either way)."""
    return Refused(
        409,
        f"session {session_id!r} is finished: a finished rollout takes no more turns "
        "(nothing was stored)",
        kind="session_finished",
    )
