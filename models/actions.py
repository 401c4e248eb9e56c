"""Actions a world understands, and how one chunk of them becomes a tensor.

A client speaks in `FrameAction`s (keys held, mouse delta, optional continuous vector) — one
per video frame. A model groups video frames under latent frames (the VAE's temporal factor),
so the tensor handed to the model is `(n_latent, frames_per_latent, width)` with the columns laid
out as ``[key multi-hot | mouse dx, dy | vector]``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

# Largest magnitude of a mouse delta or vector component, per frame. Far beyond any real input,
# and small enough that no model dtype (float16 included) overflows on it.
MAX_ACTION_VALUE = 1e4


@dataclass(frozen=True)
class FrameAction:
    """What the player does during one video frame."""

    keys: frozenset[str] = frozenset()  # keys held during the frame
    mouse: tuple[float, float] = (0.0, 0.0)  # mouse movement (dx, dy) during the frame, in pixels
    vector: tuple[float, ...] | None = None  # continuous action (robotics), length = vector_dim

    @staticmethod
    def idle() -> FrameAction:
        """No keys, no mouse movement."""
        return FrameAction()


@dataclass(frozen=True)
class ActionSpace:
    """The inputs a model was trained on (sent to clients in `ready.model.action_space`)."""

    keys: tuple[str, ...] = ()  # key names in multi-hot column order
    mouse: bool = False  # whether the model reads mouse deltas
    vector_dim: int = 0  # length of the continuous action vector (0: none)

    @property
    def width(self) -> int:
        """Columns of one frame's action row: keys, then mouse (dx, dy), then the vector."""
        return len(self.keys) + 2 + self.vector_dim

    def unknown_keys(self, keys: Iterable[str]) -> list[str]:
        """Keys that are not in this space (for a clear client error)."""
        known = set(self.keys)
        return sorted(k for k in keys if k not in known)

    def problem(self, action: FrameAction) -> tuple[str, str] | None:
        """(field, message) saying why `action` does not fit this space, or None if it does."""
        unknown = self.unknown_keys(action.keys)
        if unknown:
            return "keys", f"unknown keys {unknown}; this model knows {list(self.keys)}"
        if action.vector is not None and len(action.vector) != self.vector_dim:
            return "vector", f"vector has length {len(action.vector)}, this model takes {self.vector_dim}"
        for name, values in (("mouse", action.mouse), ("vector", action.vector or ())):
            if not all(math.isfinite(v) and abs(v) <= MAX_ACTION_VALUE for v in values):
                return name, f"{name} values must be finite and within +-{MAX_ACTION_VALUE:g}"
        return None

    def row(self, action: FrameAction) -> np.ndarray:
        """One frame's action as a float32 row of length `width`."""
        out = np.zeros(self.width, dtype=np.float32)
        for i, name in enumerate(self.keys):
            if name in action.keys:
                out[i] = 1.0
        if self.mouse:
            out[len(self.keys)] = action.mouse[0]
            out[len(self.keys) + 1] = action.mouse[1]
        if self.vector_dim:
            if action.vector is None:
                vec = np.zeros(self.vector_dim, dtype=np.float32)
            else:
                vec = np.asarray(action.vector, dtype=np.float32)
                if vec.shape != (self.vector_dim,):
                    raise ValueError(f"vector has length {vec.size}, this model takes {self.vector_dim}")
            out[len(self.keys) + 2 :] = vec
        return out


@dataclass(frozen=True)
class FrameLayout:
    """How video frames map onto latent frames for a causal temporal VAE.

    Wan's VAE maps the very first latent frame of a video to one video frame and every later
    latent frame to `frames_per_latent` video frames.
    """

    frames_per_latent: int = 1  # video frames per latent frame (VAE temporal factor)
    first_is_single: bool = False  # the first latent frame of a stream decodes to one frame

    def video_frames(self, latent_start: int, n_latent: int) -> int:
        """Video frames decoded from latent frames [latent_start, latent_start + n_latent)."""
        if self.first_is_single and latent_start == 0 and n_latent > 0:
            return 1 + (n_latent - 1) * self.frames_per_latent
        return n_latent * self.frames_per_latent


@dataclass
class ActionBatch:
    """Per-latent-frame action tensor for one chunk of one session."""

    tensor: torch.Tensor  # (n_latent, frames_per_latent, ActionSpace.width) float32
    frames: list[FrameAction] = field(default_factory=list)  # the per-video-frame actions applied


def group_actions(
    space: ActionSpace,
    layout: FrameLayout,
    latent_start: int,
    n_latent: int,
    frames: Sequence[FrameAction],
) -> ActionBatch:
    """Lay out per-video-frame actions as the model's `(n_latent, frames_per_latent, width)` tensor.

    `frames` must hold exactly `layout.video_frames(latent_start, n_latent)` entries. A latent
    frame that covers a single video frame repeats it to fill its group.
    """
    expected = layout.video_frames(latent_start, n_latent)
    if len(frames) != expected:
        raise ValueError(f"chunk takes {expected} frame actions, got {len(frames)}")
    rows = [space.row(a) for a in frames]
    tpl = layout.frames_per_latent
    groups: list[np.ndarray] = []
    i = 0
    for f in range(latent_start, latent_start + n_latent):
        if layout.first_is_single and f == 0:
            groups.append(np.stack([rows[i]] * tpl))
            i += 1
        else:
            groups.append(np.stack(rows[i : i + tpl]))
            i += tpl
    tensor = torch.from_numpy(np.stack(groups)) if groups else torch.zeros(0, tpl, space.width)
    return ActionBatch(tensor=tensor, frames=list(frames))
