"""Errors raised by the runtime.

EngineError
 ├── EngineDeadError     the engine thread is gone; every session ends (fatal, `internal`)
 ├── CapacityError       no room for another world or queued chunk (`busy`)
 ├── StreamNotFound      no stream with that id (`not_found`)
 ├── InvalidRequest      a request this world cannot run, e.g. wrong action count (`invalid_field`)
 └── NotRetained         a rewind to a chunk the stream no longer holds (`not_retained`)

A failure inside the model during one chunk is not raised: it is rolled back and reported as a
`ChunkFailed` outcome, and the stream stays usable.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base of runtime errors."""


class EngineDeadError(EngineError):
    """The engine can run nothing more; sessions must close."""


class CapacityError(EngineError):
    """No capacity now; the client may retry later."""


class StreamNotFound(EngineError):
    """Unknown stream id."""


class InvalidRequest(EngineError):
    """The request does not fit the stream's world; `field` names the offending input."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class NotRetained(EngineError):
    """A rewind target outside the stream's retention (runtime/history.py); nothing changed.
    `oldest`: the earliest chunk the stream can go back to now."""

    def __init__(self, message: str, oldest: int) -> None:
        super().__init__(message)
        self.oldest = oldest
