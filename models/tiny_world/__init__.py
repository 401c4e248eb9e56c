"""The embedded default world: a tiny causal Wan trained on the built-in game (`models.game`).

Everything that defines the shipped model lives here as code, so the trainer, the registry and
the benchmarks agree on it:

* `ae_config()`    the fast autoencoder (models/tiny_world/fast_decoder.py): per-frame 8x8x8
  latents of a 64x64 frame;
* `dit_config()`   the causal Wan DiT with the keyboard action module (the game's KEYS, no mouse);
* `marker_config()` the DiT's per-cell sprite marker on those latents (a DiT trained with `--marker`);
* `TRAIN_SCHEDULE` the few-step schedule the DiT's self-forced stages unroll; `SERVE_STEPS`
  the steps it is served with (that schedule without its 500 step);
* `world_config()` serving settings: 30 fps, image start, the served schedule, context noise;
  the world's own behaviour is its plug-in (models/tiny_world/plugin.py: the sampler's carried
  channels, `carried_channels()`; the motion head; the sessions' atlas, `atlas_tiles()`);
* `start_image(seed)` the simulator's first frame for a session seed (what a session starts from);
* `WEIGHTS_DIR`    the shipped model directory (worldserve.json + transformer/ + vae/).

Training: ``python -m models.tiny_world.train --out DIR`` (see train.py and MODEL_CARD.md).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from models.causal_wan import ActionConfig, CausalWanConfig
from models.game import FPS, KEYS, Game, GameConfig
from models.sampler import FlowSchedule
from models.tiny_world.fast_decoder import (
    CREATURE_CHANNELS,
    PHASE_CHANNELS,
    SPRITE_CHANNELS,
    SPRITE_SCALE,
    FastAEConfig,
)
from models.tiny_world.marker import MarkerConfig
from models.tiny_world.motion_head import MotionHead
from models.world import WorldConfig

NAME = "tiny-world"
SIZE = 64  # frame height and width, pixels (the game's default)
WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
# Tiles across a session's atlas (models/tiny_world/atlas.py): the game's worlds are 40 tiles across, so a
# session remembers all of one (a world the model invents may run further; the atlas then keeps
# the 64 x 64 tiles around the view).
ATLAS_TILES = 64


def ae_config(tiled: bool = False, sprite: bool = False, creatures: bool = False) -> FastAEConfig:
    """Per-frame latents: 8x spatial, 8 channels (a 64x64 frame -> 8x8x8), no temporal mixing.

    `tiled`: tile-aligned latents instead (`FastAEConfig.frame_size`): 8 channels per cell of the
    game's 8-px tile grid on a canvas two cells wider than the frame on every side (12x12 cells),
    every cell encoded and drawn from its own pixels, plus 4 phase channels -> 12x12x12.
    `sprite` (with `tiled`): the player and its ring in 3 more channels, drawn in view
    coordinates over the cells -> 12x12x15. `creatures` (with `tiled`): the wandering creatures
    in 3 more channels per cell, drawn on the canvas over the cells -> 12x12x18. The codebook that
    tile-aligned latents snap flat cells to (`FastAutoencoder.snap_cells`) starts empty: the
    recipe's `ae` stage fits it on the training frames once the autoencoder is trained
    (`models.tiny_world.training.codebook`).
    """
    return FastAEConfig(
        latent_channels=8
        + (PHASE_CHANNELS if tiled else 0)
        + (SPRITE_CHANNELS if sprite else 0)
        + (CREATURE_CHANNELS if creatures else 0),
        frame_size=SIZE if tiled else 0,
        sprite=sprite,
        creatures=creatures,
        spatial=8,
        temporal=1,
        first_is_single=False,
        temporal_kernel=1,
        # Tile-aligned latents use only the last encoder and first decoder width (per-cell layers).
        enc_channels=(16, 32, 64, 256 if tiled else 96),
        dec_channels=(256 if tiled else 128, 64, 32, 16),
        dec_mid_blocks=1,
        dec_up_blocks=(1, 1, 0),
    )


def dit_config(latent_channels: int = 8) -> CausalWanConfig:
    """A 6-layer, 128-wide causal Wan; 4x4 tokens per latent frame (6x6 on tile-aligned
    latents); chunks of 4 frames."""
    return CausalWanConfig(
        patch_size=(1, 2, 2),
        num_attention_heads=4,
        attention_head_dim=32,
        in_channels=latent_channels,
        out_channels=latent_channels,
        text_dim=16,  # no prompts: sessions use the null text (one zero token)
        freq_dim=64,
        ffn_dim=512,
        num_layers=6,
        chunk_frames=4,
        window_frames=16,
        sink_frames=0,
        null_text_len=1,
        action=ActionConfig(
            keys=tuple(KEYS),
            mouse=False,
            vector_dim=0,
            frames_per_latent=1,
            blocks=6,
            key_dim=64,
            motion_dim=64,  # unused (no mouse, no vector)
            heads=4,
        ),
    )


def place_channels() -> tuple[int, ...]:
    """The latent channels of the player's place (its centre x, y in view pixels) in the shipped
    latents (`ae_config(tiled=True, sprite=True)`)."""
    start = ae_config(tiled=True, sprite=True).sprite_slice.start
    return (start, start + 1)


def view_channels() -> tuple[int, ...]:
    """The latent channels of the view's phase (cos, sin of its place on the canvas, x then y) in
    the shipped latents."""
    ph = ae_config(tiled=True, sprite=True).phase_slice
    return tuple(range(ph.start, ph.stop))


def marker_config(ae: FastAEConfig) -> MarkerConfig:
    """The DiT's per-cell sprite marker (`MarkerConfig`) for tile-aligned latents with a sprite
    layer whose statistics are set (`FastAutoencoder.set_normalisation`)."""
    if not (ae.frame_size and ae.sprite and ae.latents_mean):
        raise ValueError("the sprite marker needs tile-aligned latents with a sprite layer, normalised")
    ph, sp = ae.phase_slice, ae.sprite_slice
    idx = [*range(ph.start, ph.stop), sp.start, sp.start + 1]
    return MarkerConfig(
        phase=ph.start,
        place=sp.start,
        mean=tuple(float(ae.latents_mean[i]) for i in idx),
        std=tuple(float(ae.latents_std[i]) for i in idx),
        spatial=ae.spatial,
        frame_size=ae.frame_size,
        scale=SPRITE_SCALE,
    )


def creature_channels() -> tuple[int, ...]:
    """The latent channels of the creature layer (`ae_config(tiled=True, sprite=True,
    creatures=True)`): after all the others."""
    cs = ae_config(tiled=True, sprite=True, creatures=True).creature_slice
    return tuple(range(cs.start, cs.stop))


def carried_channels(place: bool = False, view: bool = False, creatures: bool = False) -> tuple[int, ...]:
    """The channels a DiT trained with `--sf-place-start` / `--sf-view-start` /
    `--sf-creature-start` carries from the history's latest frame."""
    chosen = (
        (place_channels() if place else ())
        + (view_channels() if view else ())
        + (creature_channels() if creatures else ())
    )
    return tuple(sorted(chosen))


def atlas_tiles(motion: MotionHead | None) -> int:
    """`WorldConfig.atlas_tiles` of a tiny world served with `motion`: sessions keep an atlas when
    a motion head plans each frame's place on the tile grid (its pose files the tiles), else none."""
    return ATLAS_TILES if motion is not None else 0


# The schedule the DiT's self-forced stages unroll (train.py). Served without its 500 step: on
# the eval every target came out equal or better, the memory probes within 0.5 dB, at 1.13-1.23x
# the frames per second (MODEL_CARD.md, "Experiments": BM).
TRAIN_SCHEDULE = FlowSchedule(steps=(1000, 750, 500, 250), shift=1.0, num_train=1000, prediction="flow")
SERVE_STEPS = (1000, 750, 250)


def world_config() -> WorldConfig:
    """Serving settings of the shipped world (its plug-in's: `plugin.served_plugin`)."""
    return WorldConfig(
        id=NAME,
        fps=float(FPS),
        width=SIZE,
        height=SIZE,
        schedule=replace(TRAIN_SCHEDULE, steps=SERVE_STEPS),
        context_noise=0.0,
        image_start=True,
        description="tiny causal Wan trained on the built-in game (WASD + space), from the seed's world",
    )


def start_image(seed: int, size: int = SIZE) -> np.ndarray:
    """(size, size, 3) uint8: the simulator's first frame for `seed` (before any action)."""
    return Game(GameConfig(size=size)).reset(int(seed))
