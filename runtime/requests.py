"""What callers hand the engine (chunk requests) and what they get back (outcomes)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from models.actions import FrameAction


class ActionSource(Protocol):
    """Realtime input, read on the engine thread when a chunk begins (the chunk boundary)."""

    def take(self, n_frames: int) -> list[FrameAction]:
        """The actions for the next `n_frames` video frames; consumes buffered mouse motion."""
        ...

    def give_back(self, actions: Sequence[FrameAction]) -> None:
        """Return actions of a rolled-back chunk so that their mouse motion is not lost."""
        ...


@dataclass(frozen=True)
class DebugHooks:
    """Test hooks (only when the server runs with --debug-hooks)."""

    step_delay_ms: float = 0.0  # sleep at every denoise-step boundary
    fail_at_chunk: int | None = None  # raise inside the model while running this chunk number (once)


@dataclass
class ChunkRequest:
    """Run one chunk for one stream.

    Exactly one of `actions` (lockstep / one-shot: per video frame, or a single entry for the
    whole chunk) and `source` (realtime) is set.
    """

    stream_id: str
    request_id: int  # unique per engine; outcomes carry it
    actions: Sequence[FrameAction] | None = None
    source: ActionSource | None = None
    # A prompt switch this chunk carries (text worlds): it is generated under `prompt`, which is
    # in force from its commit on; a cancelled / rolled-back chunk leaves the old one.
    prompt: str | None = None
    submitted_at: float = 0.0  # time.perf_counter() at submit, for the queue timing
    scheduled_at: float = 0.0  # time.perf_counter() when first put in a batch (0: not yet)


@dataclass(frozen=True)
class ChunkTimings:
    """Milliseconds per stage of one chunk."""

    queue: float  # submit -> begin
    denoise: float  # all denoising steps
    context: float  # the clean pass
    decode: float  # latents -> uint8 frames on the host
    total: float  # begin -> commit

    def as_dict(self) -> dict[str, float]:
        """For the protocol's `timings` map."""
        return {k: round(v, 3) for k, v in self.__dict__.items()}


@dataclass(frozen=True)
class ChunkCommitted:
    """A committed chunk: its frames are now part of the world."""

    request_id: int
    stream_id: str
    chunk: int  # 1-based chunk number within the stream
    frame0: int  # index of the first video frame of the chunk within the stream
    frames: np.ndarray  # (T, H, W, 3) uint8, on the host
    actions: list[FrameAction] = field(repr=False)  # per-frame actions applied
    timings: ChunkTimings = field(repr=False)


@dataclass(frozen=True)
class ChunkCancelled:
    """The chunk was aborted before commit (or never started); the world is unchanged."""

    request_id: int
    stream_id: str
    chunk: int  # the chunk number that was not committed
    started: bool  # False: dropped from the queue before it began


@dataclass(frozen=True)
class ChunkFailed:
    """The model raised during the chunk; it was rolled back and the stream is still usable."""

    request_id: int
    stream_id: str
    chunk: int
    message: str


Outcome = ChunkCommitted | ChunkCancelled | ChunkFailed
