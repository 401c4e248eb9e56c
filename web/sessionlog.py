"""A session's log as JSON (``GET /v1/sessions/{id}/log``) and back: what `worldserve replay LOG`
needs to re-render the session's world offline through the same engine.

The log is the current world of the session (since its open or its last ``reset``), on the
timeline it is on (a ``rewind`` drops the chunks after its target): the model, the seed, the
prompt, how the world started (``start_image.kind``: ``none`` for a world that is not
image-started, ``seed`` for the world's own start image of that seed, ``image`` for the client's
``open.image``, carried here as base64 of its raw RGB bytes), the mode, the rewind retention
the server ran with (its ring layout: replaying with the same one keeps the frames
bit-identical) and, per committed chunk, the per-frame actions its frames were generated with.
Bound: the stream's action log (runtime/transaction.py, the newest 4096 chunks); ``dropped``
counts chunks of this world that fell off its front, and such a log cannot be replayed.
"""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from models.actions import FrameAction

if TYPE_CHECKING:
    from sessions.session import Session

__all__ = ["LOG_VERSION", "SessionLog", "session_log"]

LOG_VERSION = 1


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LoggedAction(_Model):
    """One video frame's input (as `step.actions[i]`)."""

    keys: tuple[str, ...] = ()
    mouse: tuple[float, float] = (0.0, 0.0)
    vector: tuple[float, ...] | None = None


class LoggedChunk(_Model):
    """One committed chunk: its session chunk number and one action per video frame."""

    chunk: int = Field(ge=1)
    actions: tuple[LoggedAction, ...]


class StartImage(_Model):
    """How the world started (see the module docstring)."""

    kind: Literal["none", "seed", "image"]
    shape: tuple[int, int, int] | None = None  # kind image: (H, W, 3)
    data: str | None = None  # kind image: base64 of the uint8 RGB bytes, C order

    def image(self) -> np.ndarray | None:
        """The client's start image (kind image), else None."""
        if self.kind != "image" or self.shape is None or self.data is None:
            return None
        raw = np.frombuffer(base64.b64decode(self.data), dtype=np.uint8)
        if raw.size != int(np.prod(self.shape)):
            raise ValueError(f"start_image.data holds {raw.size} bytes, not {self.shape}")
        return raw.reshape(self.shape).copy()


class SessionLog(_Model):
    """The JSON body of ``GET /v1/sessions/{id}/log``."""

    version: Literal[1] = LOG_VERSION
    session_id: str
    model: str
    seed: int
    prompt: str | None = None
    start_image: StartImage
    mode: Literal["realtime", "lockstep"]
    retention: int = Field(ge=0)  # the server's rewind retention (its K/V ring layout)
    # the server's --max-batch when it served --deterministic (a replay pads its batches the
    # same, so it matches bit for bit however busy the server was); None: it did not
    deterministic_batch: int | None = Field(default=None, ge=1)
    first_chunk: int  # session chunk number of this world's chunk 1
    dropped: int = Field(ge=0)  # chunks of this world no longer in the log (0: complete)
    chunks: tuple[LoggedChunk, ...]

    def actions(self) -> list[list[FrameAction]]:
        """Each chunk's per-frame actions, ready for `SessionManager.generate`."""
        return [[FrameAction(frozenset(a.keys), a.mouse, a.vector) for a in c.actions] for c in self.chunks]


def _action(a: FrameAction) -> LoggedAction:
    return LoggedAction(keys=tuple(sorted(a.keys)), mouse=a.mouse, vector=a.vector)


def _start_image(session: Session) -> StartImage:
    image = session.cond.image
    if image is not None:
        data = base64.b64encode(np.ascontiguousarray(image, dtype=np.uint8).tobytes()).decode()
        return StartImage(kind="image", shape=tuple(image.shape), data=data)
    return StartImage(kind="seed" if session.spec.image_start else "none")


async def session_log(session: Session, retention: int, deterministic_batch: int | None = None) -> SessionLog:
    """The log of a live session's current world (`retention`, `deterministic_batch`: the
    server's)."""
    first, chunks = await session.action_log()
    return SessionLog(
        session_id=session.id,
        model=session.spec.id,
        seed=session.cond.seed,
        prompt=session.cond.prompt,
        start_image=_start_image(session),
        mode=session.mode,
        retention=retention,
        deterministic_batch=deterministic_batch,
        first_chunk=session.world_base + 1,
        dropped=first - session.world_base - 1,
        chunks=tuple(
            LoggedChunk(chunk=first + i, actions=tuple(map(_action, a))) for i, a in enumerate(chunks)
        ),
    )
