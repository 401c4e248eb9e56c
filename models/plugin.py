"""The plug-in seam: what one world adds to the shared causal DiT, decoder and schedule.

A `World` is the same machine for every model: a chunk's actions condition K denoising
forwards, the clean estimate goes through the decoder's `canonical`, the clean pass writes its
K/V, the decoder shows it. A world that needs more (the built-in tiny world's motion head, its
sessions' atlases, the latent channels it starts from the last frame; models/tiny_world/plugin.py)
brings a `WorldPlugin`; the runtime calls its hooks and never names what they do:

* `start(latents)` once a session's start frame is committed (the runner's prefill): the
  session's first plug-in state;
* `plan(actions, states)` before a chunk's denoise: the actions the DiT is conditioned on and,
  optionally, a `pin` the sampler applies to every clean estimate (`ChunkPlan`);
* `noise(noise, states)` on every noise draw of the chunk;
* `advance(raw, shown, states, entries)` after the denoise: each entry's next state, staged with
  its transaction and installed only when the chunk commits (a rolled-back chunk leaves the
  committed state as it was).

A plug-in state is a value, opaque to the runtime: a plain object of tensors with `nbytes`.
Hooks never write a state in place (they return new ones), so a fork shares its source's state,
a reset or remove drops it, and a snapshot can copy it out as it is. A session that has committed
nothing yet (or whose world keeps nothing) has the state None.

Snapshots (runtime/snapshot.py) write a state as named tensors plus JSON and read it back:
`state_to_tensors` / `state_from_tensors`. A plug-in whose sessions keep state implements both
(the defaults refuse a state that is not None, naming the plug-in); the tensors come back on the
plug-in's device, so a restored session runs exactly as the one saved. The seam among the rest of
the architecture: docs/ARCHITECTURE.md.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

if TYPE_CHECKING:
    from models.world import World


class PluginState(Protocol):
    """One session's plug-in state: opaque to the runtime, never written in place."""

    @property
    def nbytes(self) -> int:
        """Device bytes the state holds."""


@dataclass
class ChunkPlan:
    """What a plug-in decides before a chunk's denoise (`WorldPlugin.plan`)."""

    actions: torch.Tensor | None  # (B, n, ..., width) the action rows the DiT is conditioned on
    # Latents (B, C, n, h, w) -> the same, with what the plug-in knows of the chunk written in
    # (in place; returned): applied to every clean estimate of the sampler.
    pin: Callable[[torch.Tensor], torch.Tensor] | None = None


class WorldPlugin(ABC):
    """World-specific behaviour behind the seam (see the module docstring). Batched: every hook
    takes the whole batch, `states[i]` being entry i's state (None: padding, or nothing kept)."""

    name: ClassVar[str]  # worldserve.json "plugin.name"

    @abstractmethod
    def bind(self, world: World) -> None:
        """Check that the plug-in fits `world` (raises ValueError) and move it to its device and
        dtype; `World.__init__` calls it."""

    @abstractmethod
    def start(self, latents: torch.Tensor) -> PluginState | None:
        """A session's state once its start latents (C, n, h, w), in canonical form, are committed."""

    @abstractmethod
    def plan(self, actions: torch.Tensor | None, states: Sequence[PluginState | None]) -> ChunkPlan:
        """Before a chunk's denoise: its conditioning actions and optional pin (`ChunkPlan`)."""

    @abstractmethod
    def noise(self, noise: torch.Tensor, states: Sequence[PluginState | None]) -> torch.Tensor:
        """A noise draw (B, C, n, h, w) of the chunk's sampler, adjusted (may be in place; returned)."""

    @abstractmethod
    def advance(
        self,
        raw: torch.Tensor,
        shown: torch.Tensor,
        states: Sequence[PluginState | None],
        entries: Sequence[int],
    ) -> dict[int, PluginState]:
        """After the denoise: entry i's (for i in `entries`) next state from its chunk's clean
        latents before (`raw`) and after (`shown`) the decoder's `canonical`, both (B, C, n, h, w);
        entries left out keep theirs. Installed when the chunk commits."""

    @abstractmethod
    def state_bytes(self) -> int:
        """The most device bytes one session's state holds (admission counts two: the committed
        state and a chunk's in flight)."""

    def state_to_tensors(self, state: PluginState) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """One session's state as named tensors and JSON (a snapshot; see the module docstring).
        The default serves plug-ins whose sessions keep no state: anything else is refused."""
        raise NotImplementedError(f"plug-in {self.name!r} cannot write its session state to a snapshot")

    def state_from_tensors(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> PluginState:
        """Inverse of `state_to_tensors`, on the plug-in's device and dtype (ValueError when the
        tensors do not fit this plug-in)."""
        raise NotImplementedError(f"plug-in {self.name!r} cannot read a session state from a snapshot")

    @abstractmethod
    def save(self, root: Path) -> dict[str, Any]:
        """Write the plug-in's weights under a model directory `root`; returns its worldserve.json
        "plugin" block (with "name")."""
