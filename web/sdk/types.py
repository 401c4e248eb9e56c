"""What the SDK hands its users: decoded chunks and one-shot results."""

from dataclasses import dataclass, field

import numpy as np

from web.messages import Done

__all__ = ["Chunk", "Generated"]


@dataclass(frozen=True)
class Chunk:
    """One committed chunk, decoded."""

    chunk: int  # chunk number within the session, from 1
    frame0: int  # index of the chunk's first frame within the session
    frames: np.ndarray = field(repr=False)  # (T, H, W, 3) uint8 RGB (H.264 after a drop: may be fewer)
    action_seq: int | None  # seq of the last action applied (lockstep: the step's seq); None: none yet
    timings: dict[str, float] = field(default_factory=dict, repr=False)  # server ms per stage
    prompt_seq: int | None = None  # the first chunk under the `prompt` switch of this seq (`prompt`)


@dataclass(frozen=True)
class Generated:
    """The result of a one-shot ``generate``."""

    frames: np.ndarray = field(repr=False)  # (N, H, W, 3) uint8, every chunk's frames in order
    chunks: list[Chunk] = field(repr=False)  # the chunks as they arrived
    done: Done  # the server's summary (chunks, frames, timings)
    # (H, W, 3) uint8: the frame the run started from (ready.frame: an image-started world's start
    # image, not among `frames`); None when the world has none
    start: np.ndarray | None = field(default=None, repr=False)
