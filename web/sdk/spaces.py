"""Gymnasium spaces for a world, and the checks that turn a gym action into protocol actions.

A world's ``ready.model.action_space`` becomes a ``Dict``: ``keys`` ``MultiBinary(len(keys))``
(1 = held), ``mouse`` ``Box(-1e4, 1e4, (2,))`` when the world takes mouse, ``vector``
``Box(-1e4, 1e4, (vector_dim,))`` when it has one (the server refuses larger values).
``per_frame`` adds a leading axis of ``chunk_frames``: one action per video frame instead of one
for the whole chunk. Observations
are the last frame ``(H, W, 3)`` or the whole chunk ``(chunk_frames, H, W, 3)`` uint8.
"""

from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
from gymnasium import spaces

from web import messages as m

__all__ = ["ObsMode", "action_space", "observation", "observation_space", "to_wire", "wire_json"]

ObsMode = Literal["frame", "chunk"]
MAX_ACTION_VALUE = 1e4  # the server's bound on a mouse delta or vector component (models.actions)


def action_space(space: m.ActionSpace, frames: int | None = None) -> spaces.Dict:
    """The gym action space of a world; ``frames``: one action per video frame of a chunk."""
    lead = () if frames is None else (frames,)
    fields: dict[str, spaces.Space[Any]] = {}
    if space.keys:
        fields["keys"] = spaces.MultiBinary([*lead, len(space.keys)])
    if space.mouse:
        fields["mouse"] = spaces.Box(-MAX_ACTION_VALUE, MAX_ACTION_VALUE, (*lead, 2), np.float32)
    if space.vector_dim:
        fields["vector"] = spaces.Box(
            -MAX_ACTION_VALUE, MAX_ACTION_VALUE, (*lead, space.vector_dim), np.float32
        )
    return spaces.Dict(fields)


def observation_space(model: m.ModelInfo, obs: ObsMode = "frame") -> spaces.Box:
    """``Box(0, 255, (H, W, 3), uint8)``, or ``(chunk_frames, H, W, 3)`` for ``obs="chunk"``."""
    frame = (model.height, model.width, 3)
    shape = frame if obs == "frame" else (model.chunk_frames, *frame)
    return spaces.Box(0, 255, shape, np.uint8)


def observation(frames: np.ndarray, obs: ObsMode, chunk_frames: int) -> np.ndarray:
    """The observation of a chunk's frames (T, H, W, 3): its last frame, or the chunk padded at
    the front with copies of its first frame to ``chunk_frames`` (a world's first chunk may be
    shorter)."""
    if obs == "frame":
        return frames[-1].copy()
    missing = chunk_frames - len(frames)
    if missing <= 0:
        return frames[-chunk_frames:].copy()
    return np.concatenate([np.repeat(frames[:1], missing, axis=0), frames])


def _field(action: Mapping[str, Any], name: str, shape: tuple[int, ...]) -> np.ndarray | None:
    if name not in action:
        return None
    try:
        value = np.asarray(action[name], dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"action field {name!r}: not numeric ({exc})") from None
    if value.shape != shape:
        raise ValueError(f"action field {name!r}: shape must be {shape}, got {value.shape}")
    if not np.isfinite(value).all():
        raise ValueError(f"action field {name!r}: values must be finite")
    if name != "keys" and (np.abs(value) > MAX_ACTION_VALUE).any():
        raise ValueError(f"action field {name!r}: values must be within +-{MAX_ACTION_VALUE:g}")
    return value


def to_wire(action: Any, space: m.ActionSpace, frames: int | None = None) -> tuple[m.FrameAction, ...]:
    """Protocol actions for one chunk from a gym action of :func:`action_space` (missing fields
    are idle). Raises ValueError naming the field for anything outside the space, before any
    message is built."""
    if not isinstance(action, Mapping):
        raise ValueError(f"an action is a dict of {sorted(action_space(space).spaces)}, got {type(action)}")
    allowed = set(action_space(space).spaces)
    unknown = sorted(set(action) - allowed)
    if unknown:
        raise ValueError(f"action field {unknown[0]!r} is not in this world's action space {sorted(allowed)}")
    lead = () if frames is None else (frames,)
    keys = _field(action, "keys", (*lead, len(space.keys)))
    if keys is not None and not np.isin(keys, (0, 1)).all():
        raise ValueError("action field 'keys': values must be 0 or 1")
    mouse = _field(action, "mouse", (*lead, 2))
    vector = _field(action, "vector", (*lead, space.vector_dim))
    out = []
    for t in range(frames or 1):
        index = () if frames is None else (t,)
        held = () if keys is None else tuple(k for k, on in zip(space.keys, keys[index], strict=True) if on)
        out.append(
            m.FrameAction(
                keys=held,
                mouse=(0.0, 0.0) if mouse is None else (float(mouse[index][0]), float(mouse[index][1])),
                vector=None if vector is None else vector[index].astype(np.float32),
            )
        )
    return tuple(out)


def wire_json(actions: tuple[m.FrameAction, ...]) -> list[dict[str, Any]]:
    """Protocol actions as JSON-ready dicts (``web.sdk.actions.frame_action`` reads them back)."""
    return [
        {
            "keys": list(a.keys),
            "mouse": list(a.mouse),
            **({} if a.vector is None else {"vector": a.vector.tolist()}),
        }
        for a in actions
    ]
