"""Errors of the session layer. Each carries the protocol error code it maps to (web/ turns it
into an `error` message) and whether the session survives it.

SessionError
 ├── SessionBusy        no capacity for another session or chunk        busy
 ├── SessionNotFound    unknown model, session or resume token          not_found
 ├── InvalidInput       a field the session cannot accept               invalid_field
 ├── RateLimited        too many requests outstanding                   rate_limited
 ├── NotRetained        a rewind past what the session still holds      not_retained
 └── SessionFailed      the engine failed; the session is over          internal (fatal)
"""

from __future__ import annotations


class SessionError(Exception):
    """Base of session errors."""

    code = "internal"
    fatal = False

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field  # the offending input, for invalid_field


class SessionBusy(SessionError):
    code = "busy"


class SessionNotFound(SessionError):
    code = "not_found"


class InvalidInput(SessionError):
    code = "invalid_field"


class RateLimited(SessionError):
    code = "rate_limited"


class NotRetained(SessionError):
    code = "not_retained"


class SessionFailed(SessionError):
    code = "internal"
    fatal = True
