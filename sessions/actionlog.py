"""A session's action log: the per-frame actions of each committed chunk of its current world, so
that a client (`GET /v1/sessions/{id}/log`) can re-render the world offline (`worldserve replay`).

Bound and policy: the newest `MAX_LOG_CHUNKS` chunks; older ones are dropped first and the log
says so (`dropped`: such a log cannot be replayed from the world's start). A `reset` starts a
new log (a new world); a `rewind` drops the chunks after its target, so the log is always the
timeline the world is on.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from models.actions import FrameAction

MAX_LOG_CHUNKS = 4096  # chunks of actions kept per session (about 2 MB of actions at 16 frames)


@dataclass(frozen=True)
class LoggedChunk:
    """One committed chunk and the actions its frames were generated with."""

    chunk: int  # session chunk number
    actions: tuple[FrameAction, ...]  # one per video frame of the chunk


class ActionLog:
    """The bounded log of one session's current world (see the module docstring)."""

    def __init__(self, limit: int = MAX_LOG_CHUNKS) -> None:
        if limit < 1:
            raise ValueError("an action log keeps at least one chunk")
        self._chunks: deque[LoggedChunk] = deque(maxlen=limit)
        self.dropped = 0  # chunks of this world dropped from the front (0: complete from its start)

    def __len__(self) -> int:
        return len(self._chunks)

    @property
    def chunks(self) -> list[LoggedChunk]:
        """The logged chunks, oldest first."""
        return list(self._chunks)

    def append(self, chunk: int, actions: list[FrameAction] | tuple[FrameAction, ...]) -> None:
        """Log a committed chunk."""
        if len(self._chunks) == self._chunks.maxlen:
            self.dropped += 1
        self._chunks.append(LoggedChunk(chunk, tuple(actions)))

    def truncate(self, chunk: int) -> None:
        """Forget the chunks after `chunk` (a rewind to it)."""
        while self._chunks and self._chunks[-1].chunk > chunk:
            self._chunks.pop()

    def restart(self) -> None:
        """An empty log for a new world (a reset)."""
        self._chunks.clear()
        self.dropped = 0
