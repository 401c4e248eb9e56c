"""Turn what a user writes for an action into protocol ``FrameAction``s.

Accepted for one action: a ``FrameAction``, or a mapping ``{"keys": [...], "mouse": (dx, dy),
"vector": [...]}`` (every entry optional). Accepted for a chunk: one action (used for every frame)
or a sequence of them (one per frame); an empty sequence is one idle action.
"""

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from web.messages import FrameAction

__all__ = ["ActionLike", "frame_action", "frame_actions", "vector_array"]

ActionLike = FrameAction | Mapping[str, Any]


def vector_array(vector: Iterable[float] | np.ndarray | None) -> np.ndarray | None:
    """A continuous action as the float32 array the wire carries (None stays None)."""
    return None if vector is None else np.asarray(vector, dtype=np.float32).reshape(-1)


def frame_action(action: ActionLike) -> FrameAction:
    """One action from a ``FrameAction`` or a mapping with optional keys, mouse, vector."""
    if isinstance(action, FrameAction):
        return action
    unknown = set(action) - {"keys", "mouse", "vector"}
    if unknown:
        raise ValueError(f"unknown action fields {sorted(unknown)}; use keys, mouse, vector")
    keys = action.get("keys", ())
    return FrameAction(
        keys=(keys,) if isinstance(keys, str) else tuple(keys),
        mouse=tuple(float(v) for v in action.get("mouse", (0.0, 0.0))),
        vector=vector_array(action.get("vector")),
    )


def frame_actions(actions: ActionLike | Sequence[ActionLike]) -> tuple[FrameAction, ...]:
    """The ``step.actions`` of one chunk: one action for all frames, or one per frame."""
    if isinstance(actions, FrameAction | Mapping):
        return (frame_action(actions),)
    return tuple(frame_action(a) for a in actions) or (FrameAction(),)
