"""What a session hands its attached client connection (plain data; web/ encodes it)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class FramesEvent:
    """One committed chunk."""

    chunk: int  # chunk number within the session, from 1, never reused (also across resets)
    frame0: int  # index of the chunk's first frame within the session
    frames: np.ndarray = field(repr=False)  # (T, H, W, 3) uint8
    action_seq: int  # seq of the last client action applied to this chunk (-1: none yet)
    timings: dict[str, float] = field(default_factory=dict, repr=False)  # ms per stage
    resent: bool = False  # re-delivered after a resume (the client may have it already)
    prompt_seq: int | None = None  # the `prompt` switch this chunk is the first chunk under


@dataclass(frozen=True)
class CancelledEvent:
    """The client's cancel took effect: `chunk` and everything after it start over."""

    seq: int
    chunk: int
    prompt_seq: int | None = None  # a `prompt` switch the cancelled chunks carried (dropped)


@dataclass(frozen=True)
class ErrorEvent:
    """A failure the client should hear about."""

    code: str  # protocol error code
    message: str
    seq: int | None = None
    fatal: bool = False


@dataclass(frozen=True)
class ReadyEvent:
    """The session (re)started: sent after `reset` (and first by a one-shot); chunks after `chunk`
    belong to the new world."""

    chunk: int
    frame: np.ndarray | None = field(default=None, repr=False)  # (H, W, 3) uint8 start frame, if any


@dataclass(frozen=True)
class DoneEvent:
    """A one-shot run finished."""

    chunks: int
    frames: int
    timings: dict[str, float] = field(default_factory=dict)  # total ms per stage over the run


@dataclass(frozen=True)
class ClosedEvent:
    """The server ended the session."""

    reason: str


SessionEvent = FramesEvent | CancelledEvent | ErrorEvent | ReadyEvent | DoneEvent | ClosedEvent
