"""Exceptions, error codes and close codes of the web/ package.

:mod:`web.errors` defines the following hierarchy of exceptions.

* :exc:`WebError` — base of everything web/ raises on purpose
    * :exc:`ProtocolError` — a message breaks protocol v1; carries the wire :class:`ErrorCode`
      that the server sends back in an ``error`` message
    * :exc:`ServerError` — the peer sent an ``error`` message (raised by clients such as the
      SDK); carries the same fields as the wire message
    * :exc:`SessionClosed` — the session ended (``closed``) or its socket dropped (SDK)
    * :exc:`StepCancelled` — a lockstep step was rolled back by a ``cancel`` (SDK)
    * :exc:`ServerUnreachable` — no server answered within the connect timeout (SDK; also a
      :exc:`ConnectionError`)
    * :exc:`MediaError` — a frame encoder or decoder failed, or was handed frames it cannot take

The protocol names its error codes (``error.code``) and, for fatal errors, the websocket close
code that follows; both are enums here, and :func:`close_code` is the one mapping between them.
"""

from enum import IntEnum, StrEnum

__all__ = [
    "CloseCode",
    "ErrorCode",
    "MediaError",
    "ProtocolError",
    "ServerError",
    "ServerUnreachable",
    "SessionClosed",
    "StepCancelled",
    "WebError",
    "close_code",
]


class ErrorCode(StrEnum):
    """The ``code`` of an ``error`` message (docs/PROTOCOL.md, "Errors")."""

    BAD_MESSAGE = "bad_message"  # not msgpack / not a map / text frame
    UNKNOWN_TYPE = "unknown_type"  # missing or unknown `type`
    INVALID_FIELD = "invalid_field"  # a field is missing, extra, or out of range; the message names it
    TOO_LARGE = "too_large"  # the message is bigger than the server accepts
    RATE_LIMITED = "rate_limited"  # the client sends faster than allowed
    BUSY = "busy"  # no capacity; retry later
    NOT_FOUND = "not_found"  # unknown model or resume token
    UNAUTHORIZED = "unauthorized"  # missing or wrong server token
    INTERNAL = "internal"  # the server failed; not the client's fault
    NOT_RETAINED = "not_retained"  # a `rewind` to a chunk the session no longer holds (v1 addition)


class CloseCode(IntEnum):
    """Websocket close codes the server uses (RFC 6455 section 7.4.1)."""

    NORMAL = 1000  # the session ended cleanly (``close`` or one-shot ``done``)
    POLICY = 1008  # the client broke the protocol or was refused
    TOO_BIG = 1009  # a message exceeded the size limit
    INTERNAL = 1011  # the server failed
    TRY_AGAIN_LATER = 1013  # no capacity now


_CLOSE_CODES: dict[ErrorCode, CloseCode] = {
    ErrorCode.BAD_MESSAGE: CloseCode.POLICY,
    ErrorCode.UNKNOWN_TYPE: CloseCode.POLICY,
    ErrorCode.INVALID_FIELD: CloseCode.POLICY,
    ErrorCode.TOO_LARGE: CloseCode.TOO_BIG,
    ErrorCode.RATE_LIMITED: CloseCode.POLICY,
    ErrorCode.BUSY: CloseCode.TRY_AGAIN_LATER,
    ErrorCode.NOT_FOUND: CloseCode.POLICY,
    ErrorCode.UNAUTHORIZED: CloseCode.POLICY,
    ErrorCode.INTERNAL: CloseCode.INTERNAL,
    ErrorCode.NOT_RETAINED: CloseCode.POLICY,  # never fatal; here so that every code has one
}


def close_code(code: ErrorCode) -> CloseCode:
    """The websocket close code that follows a *fatal* error with this error code."""
    return _CLOSE_CODES[code]


class WebError(Exception):
    """Base class of the exceptions raised by web/."""


class ProtocolError(WebError):
    """A message breaks protocol v1.

    The server turns it into an ``error`` message (``messages.Error.from_exception``) and, when
    ``fatal``, closes the socket with ``close_code(code)``.
    """

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        *,
        seq: int | None = None,
        fatal: bool = False,
        field: str | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code  # wire error code
        self.message = message  # human-readable reason; for invalid_field it starts with the field
        self.seq = seq  # `seq` of the offending message when it carried a valid one, else None
        self.fatal = fatal  # True: the server closes the session after sending the error
        self.field = field  # dotted path of the bad field ("actions.0.mouse") for invalid_field

    def __str__(self) -> str:
        return f"{self.code.value}: {self.message}"


class ServerError(WebError):
    """The server answered with an ``error`` message; the fields mirror that message."""

    def __init__(self, code: ErrorCode, message: str, *, seq: int | None = None, fatal: bool = False) -> None:
        super().__init__(message)
        self.code = code  # wire error code
        self.message = message  # the server's reason
        self.seq = seq  # `seq` of the client message the error answers, if any
        self.fatal = fatal  # True: the server closes the session after this error

    def __str__(self) -> str:
        return f"{self.code.value}: {self.message}"


class SessionClosed(WebError):
    """The server ended the session (``closed``) or the socket dropped; ``reason`` says which."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"session closed: {reason}")
        self.reason = reason  # `closed.reason` ("closed", "done", "expired", ...) or why the socket went


class StepCancelled(WebError):
    """A lockstep ``step`` was rolled back by a ``cancel`` before it committed."""


class ServerUnreachable(WebError, ConnectionError):
    """No websocket server answered at ``url`` within the client's connect timeout."""

    def __init__(self, url: str, timeout_s: float, cause: BaseException) -> None:
        super().__init__(
            f"no worldserve server at {url} (tried for {timeout_s:g} s: {cause}); "
            "is `worldserve serve` running on that host and port?"
        )
        self.url = url  # the websocket URL dialled
        self.timeout_s = timeout_s  # how long the client kept trying


class MediaError(WebError):
    """A frame encoder or decoder failed, or got frames it cannot take (wrong shape, odd size)."""
