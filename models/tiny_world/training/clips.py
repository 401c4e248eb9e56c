"""Which clips the self-forced stages draw, from the game's record of each episode: idle clips,
keys a wall blocks, stop onsets, off-centre starts, the motions under each key."""

from __future__ import annotations

import numpy as np
import torch

from models.game import GameConfig, generate_world, held_moves
from models.tiny_world import SIZE
from models.tiny_world.data import KEYS
from models.tiny_world.metrics import KEY_AXES, off_centre

MOTION_FRAMES = 8  # frames a key is held for `key_motions`: two chunks, past the next one


def idle_clips(actions: torch.Tensor) -> torch.Tensor:
    """(B,) bool: which clips of action rows (B, F, 1, width) hold no key after their start frame."""
    return actions[:, 1:].flatten(1).abs().sum(1) == 0


def key_blocked(actions: torch.Tensor, cameras: torch.Tensor, players: torch.Tensor) -> torch.Tensor:
    """(4, E, N) bool, per movement key (`KEY_AXES` order): in which steps (frame t-1 -> t) it is
    held and blocked: the player's place in the world (camera + screen position) does not advance
    in its direction. `actions` (E, N+1, width) rows (frame t's row is the action that led to
    it), `cameras` and `players` (E, N+1, 2) in frame pixels."""
    world = (cameras + players).float()
    step = world[:, 1:] - world[:, :-1]  # (E, N, 2): frame t-1 -> t
    return torch.stack(
        [
            (actions[:, 1:, KEYS.index(key)] > 0) & (step[..., axis] * sign <= 0)
            for key, axis, sign in KEY_AXES
        ]
    )


def release_blocked(actions: torch.Tensor, cameras: torch.Tensor, players: torch.Tensor) -> torch.Tensor:
    """Action rows (E, N+1, width) with every movement key released in the steps where it is held
    and blocked (`key_blocked`): what the DiT of a world with a motion head is given."""
    out = actions.clone()
    blocked = key_blocked(actions, cameras, players)
    for k, (key, _, _) in enumerate(KEY_AXES):
        out[:, 1:, KEYS.index(key)] *= (~blocked[k]).to(out.dtype)
    return out


def stop_onsets(actions: torch.Tensor, cameras: torch.Tensor, players: torch.Tensor) -> torch.Tensor:
    """(E, N+1) bool: the episode frames in which a held movement key starts to be blocked
    (`key_blocked`), though it was not in the frame before or the key was not held then (frame
    0: never)."""
    blocked = key_blocked(actions, cameras, players)
    onset = torch.zeros(actions.shape[:2], dtype=torch.bool)
    onset[:, 1] = blocked[:, :, 0].any(0)
    onset[:, 2:] = (blocked[:, :, 1:] & ~blocked[:, :, :-1]).any(0)
    return onset


def blocked_starts(
    actions: torch.Tensor, cameras: torch.Tensor, players: torch.Tensor, first: int, last: int
) -> np.ndarray:
    """(K, 2) (episode, frame) of every frame s in [first, last] at which a held movement key is
    blocked and stays held and blocked into frame s + 1 (`key_blocked`): a clip that starts there
    stands still under that key, which only the wall in view, not any motion, can tell."""
    blocked = key_blocked(actions, cameras, players)
    stays = (blocked[:, :, :-1] & blocked[:, :, 1:]).any(0)  # (E, N-1): frame s = index + 1
    at = np.argwhere(stays[:, max(first, 1) - 1 : last].numpy())
    at[:, 1] += max(first, 1)
    return at


def key_motions(
    seeds: np.ndarray, cameras: torch.Tensor, players: torch.Tensor, frames: int = MOTION_FRAMES
) -> torch.Tensor:
    """(E, N+1, 8): from every frame of the episodes of world `seeds` (E,), per movement key
    (`KEY_AXES` order), how far the player (0-3) and then the view (4-7) move in the key's
    direction when that key alone is held for `frames` frames (`held_moves`: the game's rule on
    the world's map), as a share of the free walk: 1 free, 0 against a wall (the view: also
    where the camera clamps at the world's edge). `cameras`, `players` (E, N+1, 2), frame px."""
    config = GameConfig(size=SIZE)
    out = torch.zeros(*cameras.shape[:2], 2 * len(KEY_AXES))
    free = frames * config.player_speed
    for i, seed in enumerate(seeds):
        world = generate_world(int(seed), config)
        centres = ((cameras[i] + players[i]).double() / config.scale).numpy()
        for k, (_, axis, sign) in enumerate(KEY_AXES):
            player, view = held_moves(world, centres, axis, sign, frames, config)
            out[i, :, k] = torch.from_numpy(player / free)
            out[i, :, len(KEY_AXES) + k] = torch.from_numpy(view / free)
    return out


def stop_chunks(onsets: torch.Tensor, e: np.ndarray, idx: np.ndarray, chunk: int) -> torch.Tensor:
    """(B, chunks) bool: which noisy chunks of clips (episode `e` (B,), frames `idx` (B, F), a
    start frame then whole chunks) hold a frame of `onsets` (E, N+1) (`stop_onsets`)."""
    return onsets[e[:, None], idx[:, 1:]].view(len(e), -1, chunk).any(-1)


def off_centre_starts(players: torch.Tensor, first: int, last: int) -> np.ndarray:
    """(K, 2) (episode, frame) of every frame in [first, last] of episodes whose player's screen
    positions are `players` (E, N, 2) where the game has the player off the view's centre."""
    at = np.argwhere(off_centre(players[:, first : last + 1], SIZE).any(dim=-1).numpy())
    at[:, 1] += first
    return at
