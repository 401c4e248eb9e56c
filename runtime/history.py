"""What a rewind needs: a bounded per-stream history of committed positions (`rewind`).

A commit moves a stream's world forward by swapping in new values (docs/ARCHITECTURE.md, "One
chunk, one transaction"): the K/V length grows, the decoder cache and the plug-in state are
replaced, the chunk and frame counters advance, the action log grows by one entry (a rewind pops
them again). Every one of those values is immutable (a decoder cache and a plug-in state are
never written in place) and the noise of a chunk is a function of (seed, chunk, step), so the
world at the end of chunk N is fully described by a `Checkpoint` of references plus the K/V of
its frames.

The K/V is the one thing a commit overwrites: the ring of a pool row (runtime/kv_cache.py) evicts
a chunk's worth of frames per chunk. A world set up with `retention` R gets R chunks of extra
ring slack, so the frames the last R chunks evicted are still in the ring: rewinding to any of
the last R chunks only sets the committed length back, nothing is copied.

Which positions are retained is a matter of the highest chunk whose K/V was ever written into
the row (`high`), not of the current position: after a rewind from chunk C to N, the slots of
chunks N+1..C still hold their frames and a later chunk writes the same slots again, so the ring
holds the frames of chunk j iff j >= high - R. Bound and policy: at most R + 1 checkpoints per
stream (the current position and R back), the oldest dropped first.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from models.plugin import PluginState
from models.vae import DecoderCache
from models.world import WorldState


@dataclass(frozen=True)
class Checkpoint:
    """A stream's committed position at the end of one chunk (references, never copies)."""

    chunk: int  # engine chunk number (0: the world's start, before any chunk)
    frames: int  # committed latent frames (the K/V length)
    video_frames: int  # committed video frames
    decoder: DecoderCache
    plugin_state: PluginState | None
    frame: np.ndarray | None  # (H, W, 3) uint8 last frame shown at that point (None: none yet)


class ChunkHistory:
    """The last `retention` chunks' checkpoints of one stream (see the module docstring)."""

    def __init__(self, retention: int) -> None:
        if retention < 0:
            raise ValueError(f"retention must be >= 0 chunks, not {retention}")
        self.retention = retention
        self.high = 0  # the highest chunk whose K/V was ever written into the row
        self._entries: deque[Checkpoint] = deque()

    def __len__(self) -> int:
        return len(self._entries)

    def copy(self) -> ChunkHistory:
        """The same history for a fork (the fork's row is a copy of the whole ring)."""
        other = ChunkHistory(self.retention)
        other.high = self.high
        other._entries = deque(self._entries)
        return other

    def clear(self) -> None:
        """Forget everything (a reset builds a new world in a fresh row)."""
        self.high = 0
        self._entries.clear()

    def record(self, state: WorldState, frame: np.ndarray | None) -> None:
        """Note the committed position `state` is at now (after a commit or a prefill)."""
        self.high = max(self.high, state.chunks)
        self._entries.append(
            Checkpoint(
                chunk=state.chunks,
                frames=state.frames,
                video_frames=state.video_frames,
                decoder=state.decoder,
                plugin_state=state.plugin_state,
                frame=None if frame is None else frame.copy(),  # not a view that keeps a chunk alive
            )
        )
        while self._entries and self._entries[0].chunk < self.high - self.retention:
            self._entries.popleft()

    def oldest(self) -> int | None:
        """The earliest chunk a rewind can reach (None: none)."""
        return self._entries[0].chunk if self._entries else None

    def get(self, chunk: int) -> Checkpoint | None:
        """The checkpoint of `chunk`, None when it is not retained."""
        return next((c for c in self._entries if c.chunk == chunk), None)

    def truncate(self, chunk: int) -> None:
        """Drop the checkpoints after `chunk` (those chunks are gone after a rewind to it)."""
        while self._entries and self._entries[-1].chunk > chunk:
            self._entries.pop()
