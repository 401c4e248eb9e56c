"""Realtime input: latest keys win, mouse deltas add up, consumed at the next chunk boundary.

The buffer is written on the event loop and read on the engine thread (when a chunk begins),
so every access holds a lock. A rolled-back chunk returns its mouse motion to the buffer.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from models.actions import MAX_ACTION_VALUE, FrameAction


def _clamp(v: float) -> float:
    return max(-MAX_ACTION_VALUE, min(MAX_ACTION_VALUE, v))


class ActionBuffer:
    """The latest realtime input of one session."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._keys: frozenset[str] = frozenset()
        self._mouse = [0.0, 0.0]  # summed (dx, dy) since the last take
        self._vector: tuple[float, ...] | None = None
        self._seq = -1  # seq of the latest action pushed

    def push(
        self, seq: int, keys: frozenset[str], mouse: tuple[float, float], vector: tuple[float, ...] | None
    ) -> None:
        """Record an `action` message (already validated)."""
        with self._lock:
            self._keys = keys
            # deltas add up; the sum is clamped so that many valid messages stay a valid action
            self._mouse[0] = _clamp(self._mouse[0] + mouse[0])
            self._mouse[1] = _clamp(self._mouse[1] + mouse[1])
            if vector is not None:
                self._vector = vector
            self._seq = max(self._seq, seq)

    def take(self, n_frames: int) -> tuple[list[FrameAction], int]:
        """Actions for the next `n_frames` frames (mouse motion spread evenly) and the seq they include."""
        with self._lock:
            dx, dy = self._mouse[0] / n_frames, self._mouse[1] / n_frames
            self._mouse = [0.0, 0.0]
            action = FrameAction(self._keys, (dx, dy), self._vector)
            return [action] * n_frames, self._seq

    def give_back(self, actions: Sequence[FrameAction]) -> None:
        """Return the mouse motion of a rolled-back chunk."""
        with self._lock:
            self._mouse[0] = _clamp(self._mouse[0] + sum(a.mouse[0] for a in actions))
            self._mouse[1] = _clamp(self._mouse[1] + sum(a.mouse[1] for a in actions))

    def clear(self) -> None:
        """Forget everything (reset)."""
        with self._lock:
            self._keys, self._mouse, self._vector = frozenset(), [0.0, 0.0], None


class ChunkSource:
    """The `ActionSource` of one realtime chunk: remembers which action seq it applied."""

    def __init__(self, buffer: ActionBuffer) -> None:
        self.buffer = buffer
        self.seq = -1  # seq of the last action this chunk applied (set when the chunk begins)

    def take(self, n_frames: int) -> list[FrameAction]:
        actions, self.seq = self.buffer.take(n_frames)
        return actions

    def give_back(self, actions: Sequence[FrameAction]) -> None:
        self.buffer.give_back(actions)
