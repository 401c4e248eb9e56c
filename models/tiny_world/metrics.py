"""Measuring generated frames against the game (numpy only): PSNR, the player sprite, scrolling.

* `psnr(a, b)`: per-frame PSNR in dB of uint8 frames (peak 255).
* `player_centroid(frame)`: the centre of the magenta-ish pixels, in the simulator's convention
  (pixel i spans [i, i + 1), so a pixel's centre is i + 0.5), or None when the sprite is missing.
* `scroll_offset(a, b)`: the integer camera move (dx, dy) that best maps frame a onto frame b,
  found by brute force over a small window with the player's box masked out;
* `world_displacement(frames, axis)`: how far the player walked, from the frames alone.
* `sprite_count(frame)`: how many separate player-coloured blobs a frame shows;
* `sharpness(frames)`: per-frame mean absolute horizontal gradient (blur lowers it);
* `creature_pixels(frames)`: per-frame count of pixels in (or near) the creatures' colour;
* `terrain_kind(colours)`: the terrain kind of each colour's nearest terrain shade;
* `terrain_structure(frames)`: the share of each terrain kind and how often water meets grass
  without a shore (the game rings its lakes with sand);
* `free_worlds(n, frames, first_seed)`: game worlds where held keys scroll the view freely;
* `unseen_resampled(seed, other)`: the seed's world with everything its first frame does not
  show drawn afresh from the game's own distribution (what a perfect model of the game, seeing
  only that frame, would play).
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from models.game import Game, GameConfig, Palette, Tile, World, generate_world, simulate

if TYPE_CHECKING:
    import torch

ArrayT = TypeVar("ArrayT", np.ndarray, "torch.Tensor")

# A pixel is "magenta-ish" when red and blue are high and green is low. The simulator draws the
# player in (255, 0, 255) and uses that colour nowhere else; these bounds also accept a
# decoder's slightly-off reconstruction while rejecting creatures (222, 40, 36) and terrain.
MAGENTA_MIN_RB = 150
MAGENTA_MAX_G = 110
MIN_SPRITE_PIXELS = 4  # fewer magenta pixels than this: the sprite is missing
KEY_AXES = (("d", 0, 1), ("a", 0, -1), ("s", 1, 1), ("w", 1, -1))  # key, axis (0 = x), sign


def psnr(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """PSNR (dB) per frame of uint8 frames (..., H, W, 3); identical frames give 100 dB."""
    d = a.astype(np.float64) - b.astype(np.float64)
    mse = (d * d).mean(axis=(-3, -2, -1))
    return np.where(mse > 0, 10.0 * np.log10(255.0**2 / np.maximum(mse, 1e-12)), 100.0)


def magenta_mask(frame: np.ndarray) -> np.ndarray:
    """(H, W) bool: pixels that look like the player's colour."""
    f = frame.astype(np.int16)
    r, g, b = f[..., 0], f[..., 1], f[..., 2]
    return (r >= MAGENTA_MIN_RB) & (b >= MAGENTA_MIN_RB) & (g <= MAGENTA_MAX_G)


def player_centroid(frame: np.ndarray) -> tuple[float, float] | None:
    """(x, y) centre of the magenta pixels in frame pixels, or None when fewer than MIN_SPRITE_PIXELS."""
    ys, xs = np.nonzero(magenta_mask(frame))
    if xs.size < MIN_SPRITE_PIXELS:
        return None
    return float(xs.mean() + 0.5), float(ys.mean() + 0.5)


def position_errors(frames: np.ndarray, truth: np.ndarray) -> np.ndarray:
    """(N,) distance in pixels between each frame's sprite and the true centre (N, 2); inf if missing."""
    out = np.full(len(frames), np.inf)
    for i, frame in enumerate(frames):
        c = player_centroid(frame)
        if c is not None:
            out[i] = float(np.hypot(c[0] - truth[i, 0], c[1] - truth[i, 1]))
    return out


def scroll_offset(
    a: np.ndarray, b: np.ndarray, radius: int = 3, ignore: tuple[float, float] | None = None, box: int = 12
) -> tuple[int, int]:
    """The camera move (dx, dy), |dx|, |dy| <= radius, that best explains frame b from frame a.

    A camera move of +dx (the view goes right) shifts content left: b[y, x] == a[y + dy, x + dx].
    Pixels within `box` / 2 of `ignore` (the player's centre, which the camera follows) are left
    out of the comparison.
    """
    h, w = a.shape[:2]
    af, bf = a.astype(np.float32), b.astype(np.float32)
    keep = np.ones((h, w), dtype=bool)
    if ignore is not None:
        x0, y0 = int(ignore[0] - box / 2), int(ignore[1] - box / 2)
        keep[max(y0, 0) : max(y0 + box, 0), max(x0, 0) : max(x0 + box, 0)] = False
    best, best_err = (0, 0), np.inf
    for dy in range(-radius, radius + 1):
        for dx in range(-radius, radius + 1):
            ys, xs = slice(max(0, -dy), min(h, h - dy)), slice(max(0, -dx), min(w, w - dx))
            ya, xa = slice(ys.start + dy, ys.stop + dy), slice(xs.start + dx, xs.stop + dx)
            m = keep[ys, xs]
            err = float(((bf[ys, xs] - af[ya, xa]) ** 2).sum(-1)[m].mean())
            if err < best_err:
                best, best_err = (dx, dy), err
    return best


def frame_stats(frames: np.ndarray) -> np.ndarray:
    """(N, 4) per-frame statistics: mean R, G, B and the standard deviation over all values."""
    f = frames.astype(np.float64)
    return np.concatenate([f.mean(axis=(1, 2)), f.reshape(len(f), -1).std(axis=1, keepdims=True)], axis=1)


def world_displacement(frames: np.ndarray, axis: int) -> np.ndarray:
    """(N,) cumulative displacement of the player in the world along `axis` (0: x, 1: y), read
    from frames alone: the camera scroll between consecutive frames plus the sprite's own motion
    on screen (which is what moves when the camera is clamped at the world's edge)."""
    disp = [0.0]
    prev = player_centroid(frames[0])
    for a, b in itertools.pairwise(frames):
        c = player_centroid(b)
        cam = scroll_offset(a, b, radius=2, ignore=prev or (32.0, 32.0))[axis]
        sprite = 0.0 if c is None or prev is None else c[axis] - prev[axis]
        disp.append(disp[-1] + cam + sprite)
        prev = c if c is not None else prev
    return np.array(disp)


def off_centre(players: ArrayT, size: int) -> ArrayT:
    """Player screen positions (..., 2) in a `size`-px view (numpy or torch) -> (..., 2) bool:
    along which axes the game has the player off the view's centre (its camera has stopped at
    the world's border)."""
    return abs(players - size / 2) >= 0.5


def sprite_count(frame: np.ndarray, min_pixels: int = MIN_SPRITE_PIXELS) -> int:
    """Number of 4-connected magenta blobs of at least `min_pixels` pixels (1 for the game)."""
    mask = magenta_mask(frame)
    seen = np.zeros_like(mask)
    h, w = mask.shape
    count = 0
    for y0, x0 in zip(*np.nonzero(mask), strict=True):
        if seen[y0, x0]:
            continue
        seen[y0, x0] = True
        stack, size = [(y0, x0)], 0
        while stack:
            y, x = stack.pop()
            size += 1
            for ny, nx in ((y - 1, x), (y + 1, x), (y, x - 1), (y, x + 1)):
                if 0 <= ny < h and 0 <= nx < w and mask[ny, nx] and not seen[ny, nx]:
                    seen[ny, nx] = True
                    stack.append((ny, nx))
        count += size >= min_pixels
    return count


def creature_pixels(frames: np.ndarray, palette: Palette | None = None, tolerance: int = 48) -> np.ndarray:
    """(N,) the pixels of each frame (N, H, W, 3) within `tolerance` levels of the creatures'
    colour on every channel (a 6 x 6 creature wholly in view is 36; no other colour of the game
    comes that close)."""
    colour = np.array((palette or Palette()).creature, dtype=np.int16)
    near = np.abs(frames.astype(np.int16) - colour).max(axis=-1) <= tolerance
    return near.sum(axis=(-2, -1))


def sharpness(frames: np.ndarray) -> np.ndarray:
    """(N,) mean absolute horizontal gradient of each frame (N, H, W, 3), in intensity levels."""
    f = frames.astype(np.float32)
    return np.abs(np.diff(f, axis=2)).mean(axis=(1, 2, 3))


def terrain_kind(colours: np.ndarray, palette: Palette | None = None) -> tuple[np.ndarray, np.ndarray]:
    """RGB colours (..., 3) -> the terrain kind (a `Tile`) of each one's nearest terrain shade of
    the palette (..., ) and its squared distance to that shade (..., )."""
    shades = (palette or Palette()).terrain().reshape(-1, 3).astype(np.float32)  # kind = index // 2
    dist = ((colours.astype(np.float32)[..., None, :] - shades) ** 2).sum(-1)
    return dist.argmin(-1) // 2, dist.min(-1)


def terrain_structure(frames: np.ndarray, palette: Palette | None = None) -> dict[str, float]:
    """Frames (N, H, W, 3) -> the share of their pixels of each terrain kind (the nearest of the
    palette's colours, within 30 levels; sprites and blends count for none), and of the pixel
    pairs one tile apart across a kind boundary that touch water, the share where grass meets the
    water without sand between (the game's lakes have shores: a few percent)."""
    kinds = np.zeros(len(Tile))
    water = grass = 0
    for i in range(0, len(frames), 64):  # 64 frames at a time: the distances take 8 floats a pixel
        kind, dist = terrain_kind(frames[i : i + 64], palette)
        kind[dist > 30.0**2] = -1
        kinds += np.bincount(kind[kind >= 0], minlength=len(Tile))
        a, b = kind[..., :, :-8], kind[..., :, 8:]  # one tile apart horizontally
        edge = (a >= 0) & (b >= 0) & ((a == Tile.WATER) != (b == Tile.WATER))
        water += int(edge.sum())
        grass += int((edge & ((a == Tile.GRASS) | (b == Tile.GRASS))).sum())
    out = {t.name.lower(): float(kinds[t] / max(1, frames[..., 0].size)) for t in Tile}
    out["water_meets_grass"] = grass / max(1, water)
    return out


def free_worlds(n: int, frames: int, first_seed: int, keys: str = "dasw") -> list[int]:
    """The first `n` seeds from `first_seed` where holding each key of `keys` alone for `frames`
    frames scrolls the game's view freely: the player walks one pixel every frame (no wall) and
    the camera follows it (the sprite keeps its screen position, no clamp at the world's edge)."""
    seeds, seed = [], first_seed
    while len(seeds) < n:
        free = True
        for key, axis, sign in (k for k in KEY_AXES if k[0] in keys):
            sim = simulate(seed, [frozenset({key})] * frames)
            moved = (sim.player_world_pos[-1, axis] - sim.player_world_pos[0, axis]) * sign
            free = bool(moved == frames and np.all(sim.player_pos == sim.player_pos[0]))
            if not free:
                break
        if free:
            seeds.append(seed)
        seed += 1
    return seeds


def unseen_resampled(seed: int, other: int, config: GameConfig | None = None) -> World:
    """World `seed` as far as its first frame shows it, the rest from world `other`: the tiles
    the first view covers are pasted into `other`'s map, and along each axis where that view
    shows no border the paste lands at a place drawn uniformly (by `other`) from every place
    where the view would show none either, since the game's spawn is uniform. Creatures in view
    stay; the rest are `other`'s. A perfect model of the game that sees only the first frame
    plays a world drawn like this one; over many such worlds, the likeliest outcome is the best
    guess any model can make."""
    config = config or GameConfig()
    t, n = config.tile, config.world_tiles
    game = Game(config)
    game.reset(seed)
    a, b = game.world, generate_world(other, config)
    camera = np.array(game.camera)  # the first view's top-left corner, world units (x, y)
    lo = (camera // t).astype(int)  # first and last tile column / row in view, (x, y)
    hi = (np.ceil((camera + config.view) / t) - 1).astype(int)
    spawn = (a.spawn // t).astype(int)
    rng = np.random.default_rng([other, seed])
    shift = np.zeros(2, dtype=int)
    for axis in (0, 1):
        if lo[axis] == 0 or hi[axis] == n - 1:
            continue  # the border is in view: where the world ends is known
        moves = np.arange(-n, n + 1)
        fits = (lo[axis] + moves >= 1) & (hi[axis] + moves <= n - 2)
        fits &= (spawn[axis] + moves >= 2) & (spawn[axis] + moves <= n - 3)
        shift[axis] = int(rng.choice(moves[fits]))
    src = np.s_[lo[1] : hi[1] + 1, lo[0] : hi[0] + 1]
    dst = np.s_[lo[1] + shift[1] : hi[1] + shift[1] + 1, lo[0] + shift[0] : hi[0] + shift[0] + 1]
    kind, rgb, wall = b.kind.copy(), b.rgb.copy(), b.wall.copy()
    kind[dst], rgb[dst], wall[dst] = a.kind[src], a.rgb[src], a.wall[src]
    box_lo, box_hi = lo * t, (hi + 1) * t  # the pasted tiles, world units (x, y), in a's frame

    def inside(c: np.ndarray, off: np.ndarray) -> np.ndarray:
        return ((c + config.creature_size > box_lo + off) & (c < box_hi + off)).all(axis=1)

    move = shift * float(t)
    keep_a, keep_b = inside(a.creatures, 0), ~inside(b.creatures, move)
    return World(
        kind=kind,
        rgb=rgb,
        wall=wall,
        spawn=a.spawn + move,
        creatures=np.concatenate([a.creatures[keep_a] + move, b.creatures[keep_b]]),
        velocities=np.concatenate([a.velocities[keep_a], b.velocities[keep_b]]),
    )
