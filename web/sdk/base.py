"""The one small interface a world client offers (openpi's ``BasePolicy``: ``infer``/``reset``)."""

from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np

from web.messages import Ready
from web.sdk.actions import ActionLike

__all__ = ["BaseWorld"]


class BaseWorld(ABC):
    """A world you drive one chunk at a time (lockstep)."""

    @abstractmethod
    def step(self, actions: ActionLike | Sequence[ActionLike]) -> np.ndarray:
        """Run one chunk with these actions (one for all frames, or one per frame); its frames,
        (T, H, W, 3) uint8."""

    @abstractmethod
    def reset(self, seed: int | None = None, prompt: str | None = None) -> Ready:
        """Start a fresh world (None: the same seed / prompt, for text worlds); the server's new
        ``ready``."""
