"""Training data for the tiny world: simulator episodes under the persistent random policy.

An episode is one world (a seed) played for N frames by `random_policy(seed, N)`::

    frames  (N+1, H, W, 3)  frame 0 before any action, frame i after actions[i-1]
    cameras (N+1, 2)        the view's top-left corner (x, y) of frame i in frame pixels (world
                            units times the scale); the self-forced stage's loss mask uses it
    players (N+1, 2)        the player's centre (x, y) on screen in frame pixels (own-world targets)
    backdrops (N+1, H, W, 3), rings (N+1,)   with `layers`: the frames without the player and its
                            ring, and whether the ring is shown (a sprite layer's targets)
    terrains (N+1, H, W, 3), creatures (N+1, C, 2)   with `layers`: the terrain alone and where
                            each creature's square starts in the frame (a creature layer's targets)
    actions (N+1, width)    row i: the keys that *produced* frame i (row 0 is idle), laid out as
                            the model's action rows [key multi-hot in KEYS order | mouse dx, dy = 0]

Row i pairs with latent frame i, which is what the engine does too: the chunk that decodes to
video frame i carries the action of that frame, and a session's first frame (the prefilled start
image) carries an idle action.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from models.actions import ActionSpace
from models.game import KEYS, GameConfig, SimResult, encode_actions, random_policy, simulate

# The action space of the tiny world (keys only); rows are ActionSpace.width wide.
SPACE = ActionSpace(keys=tuple(KEYS), mouse=False, vector_dim=0)

# `random_policy` settings of the focus episodes (the sf stage's `sf_focus`): what the default
# policy seldom plays and the world must get right for minutes: long idle stretches (40 % of the
# segments) and long straight holds (mean 32 frames, up to 96), which walk into walls.
FOCUS_POLICY = {"mean_hold": 32.0, "max_hold": 96, "p_idle": 0.4, "p_diagonal": 0.0}


@dataclass
class Episodes:
    """A batch of simulator episodes of equal length."""

    frames: np.ndarray  # (E, N+1, H, W, 3) uint8
    actions: np.ndarray  # (E, N+1, width) float32 action rows (row 0 idle)
    seeds: np.ndarray  # (E,) int64 world seeds
    cameras: np.ndarray  # (E, N+1, 2) float32 camera top-left (x, y) per frame, frame pixels
    players: np.ndarray  # (E, N+1, 2) float32 player centre (x, y) on screen per frame, frame pixels
    backdrops: np.ndarray | None = None  # (E, N+1, H, W, 3) uint8 frames without the player (layers)
    rings: np.ndarray | None = None  # (E, N+1) bool the space ring is shown (layers)
    terrains: np.ndarray | None = None  # (E, N+1, H, W, 3) uint8 the terrain alone (layers)
    creatures: np.ndarray | None = None  # (E, N+1, C, 2) int64 creatures' drawn top-left px (layers)

    def __len__(self) -> int:
        return self.frames.shape[0]


def action_rows(actions: Sequence[Iterable[str]]) -> np.ndarray:
    """(N+1, width) float32: an idle row for frame 0, then one row per action."""
    keys = encode_actions(actions)  # (N, len(KEYS))
    rows = np.zeros((len(actions) + 1, SPACE.width), dtype=np.float32)
    rows[1:, : len(KEYS)] = keys
    return rows


def sim_cameras(sim: SimResult, config: GameConfig) -> np.ndarray:
    """(N+1, 2) the view's top-left corner (x, y) of every frame of a simulation, frame pixels."""
    # The player's centre in the world and on screen pin the camera: screen = (world - cam) * scale.
    return sim.player_world_pos * config.scale - sim.player_pos


def make_episodes(
    seeds: Sequence[int],
    n_actions: int,
    size: int = 64,
    progress: bool = False,
    policy: dict[str, float] | None = None,
    layers: bool = False,
) -> Episodes:
    """Simulate `random_policy(seed, n_actions, **policy)` in the world of every seed (`layers`:
    with the frames without the player and the ring flags)."""
    config = GameConfig(size=size)
    frames = np.empty((len(seeds), n_actions + 1, size, size, 3), dtype=np.uint8)
    actions = np.empty((len(seeds), n_actions + 1, SPACE.width), dtype=np.float32)
    cameras = np.empty((len(seeds), n_actions + 1, 2), dtype=np.float32)
    players = np.empty((len(seeds), n_actions + 1, 2), dtype=np.float32)
    backdrops = np.empty_like(frames) if layers else None
    rings = np.empty((len(seeds), n_actions + 1), dtype=bool) if layers else None
    terrains = np.empty_like(frames) if layers else None
    creatures: list[np.ndarray] = []
    for i, seed in enumerate(tqdm(seeds, desc="simulate", unit="ep", disable=not progress)):
        keys = random_policy(int(seed), n_actions, **(policy or {}))
        sim = simulate(int(seed), keys, config, layers=layers)
        frames[i] = sim.frames
        actions[i] = action_rows(keys)
        cameras[i] = sim_cameras(sim, config)
        players[i] = sim.player_pos
        if layers:
            backdrops[i], rings[i], terrains[i] = sim.backdrops, sim.rings, sim.terrains
            creatures.append(sim.creature_corners)
    seeds_arr = np.asarray(seeds, dtype=np.int64)
    return Episodes(
        frames=frames,
        actions=actions,
        seeds=seeds_arr,
        cameras=cameras,
        players=players,
        backdrops=backdrops,
        rings=rings,
        terrains=terrains,
        creatures=np.stack(creatures) if layers else None,
    )
