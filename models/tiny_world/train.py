"""Train the tiny world from scratch on the built-in game: autoencoder, then the causal DiT.

    python -m models.tiny_world.train --out DIR [--resume] [--seed N] [--minutes M]

Stages (one checkpoint file, DIR/ckpt.pt, records the stage and step; --resume continues)::

    data     simulate `episodes` worlds x `episode_frames` frames of random_policy (seeded, not saved)
    ae       the fast autoencoder on single frames: L1 + MSE, with noise on the latents so the
             decoder tolerates the DiT's small errors; then per-channel latent statistics. With
             `ae_sprite` (tile-aligned only) the cells learn the frame without the player (the
             simulator's layers) and the sprite layer draws the player and its ring over them,
             their place in the latents taken from the game
    latents  every episode frame encoded once, with its action row and camera (DIR/latents.safetensors)
    dit      the causal DiT by flow matching on clips of 1 + clip_chunks * chunk_frames latent
             frames, teacher-forced (CausVid): one sequence holds a clean copy of the clip and a
             noisy copy of its chunks; a noisy chunk attends to the clean copies of the chunks
             before it (inside the serving window) and to itself, exactly as the engine's rollout
             does, with RoPE positions shared by both copies. Every chunk draws its own noise
             level (diffusion-forcing style); the clean copies get a small random noise level of
             their own (noisy-history augmentation, served as `context_noise`). EMA weights ship.
    sf       the second DiT stage (`sf_steps` > 0; the shipped run: 250 steps with the history's
             sprite moved, `sf_sprite_jitter`, and no blur). The EMA weights of `dit` restart
             training with a fresh optimiser and RNGs of their own, teacher-forced as in `dit`,
             but with `sf_blur` a share of the clips see their history frames after the start
             frame blurred (a Gaussian of sigma up to `sf_blur_max` px, optionally
             colour-shifted by `sf_jitter`, re-encoded: DIR/blurred.safetensors) while the
             targets stay the game's sharp frames (L's recipe). The model's
             own rollout leaves such soft frames in its history, and a model that only ever saw
             sharp history slows down and stops on them (exposure bias); this teaches it to keep
             moving and to sharpen. Options measured in the model card's issue 11 experiments:
             `sf_p_self`: a share of the clips gets the model's own rollout as history (the
             serving sampler, no grad, from the clip's ground-truth start frame; DAgger /
             Self-Forcing style). `sf_mask`: a self-rolled clip is supervised only on latent
             pixels whose footprint was in view in its start frame. `sf_target` "own": a
             self-rolled clip's targets are the model's own last frame shifted by the game's
             camera, the sprite repainted where the game has it, re-encoded, the revealed strip
             out of the loss (`own_world_targets`; with `sf_snap` the frame is first redrawn as
             flat tiles on the game's grid, `snap_to_tiles`). `sf_target` "anchor": a
             self-rolled clip's targets are the game's own frames from where the model's world
             is (`anchored_targets`: before each chunk the game's player is moved by the shift
             that matches the model's latest frame to the game's terrain, then plays the clip's
             actions), so they agree with the history and keep the game's rules and sharpness.
             `sf_lead`: self-rolled clips are rolled out that many chunks before the clip, so
             its history is the model's own throughout. `sf_onestep`: a share of the clips not
             blurred see as history the model's own prediction of every chunk from the game's
             frames before it (`onestep_history`), the targets the game's. `sf_adv`: an
             adversarial loss (weight) on the decoded x0 predictions from a patch critic
             (`FrameCritic`, hinge, trained alongside). `sf_warp`: a share
             of the clips' last chunk sees its history slowed (the motion scaled by r in [0, 1)
             up to the true last frame; tile-aligned: those frames re-cut from their own cells)
             and only that chunk is trained. `sf_patch` /
             `sf_window`: the stage's DiT on a finer token grid / another window (`regrid`).
             `sf_layers`: the stage's DiT grown deeper by identity-initialised blocks (`deepen`).
             `sf_focus`: a share of the clips comes from focus episodes (`FOCUS_POLICY`: long
             idle stretches, long holds into walls; DIR/focus.safetensors). `sf_self_idle`: a
             share of the all-idle clips gets the model's own rollout as history, first run
             idle for 0..`sf_idle_lead` chunks; in idle the game's frames stay the right targets.
             `sf_chain`: a loss on fresh clips' own rollouts whose gradient reaches back through
             `sf_chain_depth` chunks of the generated history (`chain_history`).
             `sf_sprite_jitter` (sprite layer): half the clips see their history's sprite moved
             off the game's place by up to that many px, so the rule, not the history, places it;
             with `sf_jitter_centred` only along the axes where the game's camera keeps the
             player at the view's centre throughout the clip (not at the world's border, where
             the camera stops and the history's off-centre place is the rule). `sf_off_centre`:
             a share of the clips starts on a frame where the game's player is off the view's
             centre (the camera stopped at the world's border; `off_centre_starts`).
             `sf_place_start` / `sf_view_start`: the player's place / the view's phase channels
             of each noisy chunk start from the history's latest frame, as served (`carry`).
             `sf_phase_weight`: the view's phase channels (the motion) weigh that much in the
             flow loss. `sf_stop_weight`: the chunks in which a held key starts to be blocked
             (`stop_onsets`: the player walks into a wall) weigh that much. `sf_blocked`: a share
             of the clips starts where a held key is blocked and stays so (`blocked_starts`),
             so no motion in the history tells that the view stands still. `sf_marker_aux` (with
             `--marker`) / `sf_motion_aux`: auxiliary linear heads on the last block's tokens
             (`AuxHeads`, not shipped) predict every cell's sprite marker / every clean frame's
             motions under each key from the game's map (`key_motions`: walls, the world's edge).
    sf2      a second self-forced phase (`sf2_steps` > 0), from the sf stage's EMA with a fresh
             optimiser: the sf stage's settings with `sf2_view_start` and `sf2_jitter_centred`
             in place of theirs. The served world carries what the last phase carried.
    sf3      a third self-forced phase (`sf3_steps` > 0), from the sf2 phase's EMA with a fresh
             optimiser: sf2's settings with the view's phase channels weighted `sf3_phase_weight`
             in the flow loss (`sf_phase_weight`: the motion, against the cells).
             `sf_release_blocked`: the self-forced phases see every movement key released in the
             steps a wall blocks it (`release_blocked`), as the key gate serves the DiT.
    gate     the key gate (`gate_steps` > 0; models/key_gate.py, models/tiny_world/gate.py): a
             small classifier from a latent frame to each movement key's room in the next chunk,
             on every episode frame in the served history's form, labelled by the game's rule on
             each world's map; half the frames see the player moved up to `gate_jitter` px.
    terrain  the terrain prior (`terrain_steps` > 0, with a gate that plans the view: the atlas;
             models/terrain_prior.py, models/tiny_world/terrain.py): a classifier from a tile's
             neighbourhood as a session knows it to the tile, on the training worlds' maps; the
             atlas draws every tile that comes into view for the first time from it.
    export   DIR/model: a model directory (worldserve.json + transformer/ + vae/ [+ gate/] [+ terrain/])
             for load_world

References (read, not copied): CausVid and Self-Forcing (teacher forcing over a block-causal
mask, few-step flow sampling), Diffusion Forcing (independent per-chunk noise), rectified flow
(`x_t = (1 - s) x0 + s noise`, target noise - x0).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm import tqdm

from models.causal_wan import (
    CausalWan,
    CausalWanConfig,
    MarkerConfig,
    frame_attention_mask,
    marker_inputs,
    sprite_marker,
)
from models.game import Game, GameConfig, GameError, generate_world, held_moves, random_policy
from models.kv_pool import ChunkIndex
from models.sampler import FlowSchedule, add_noise
from models.tiny_world import (
    SIZE,
    TRAIN_SCHEDULE,
    ae_config,
    atlas_tiles,
    carried_channels,
    dit_config,
    marker_config,
    world_config,
)
from models.tiny_world.data import FOCUS_POLICY, KEYS, Episodes, make_episodes
from models.tiny_world.fast_decoder import SPRITE_SCALE, FastAutoencoder, FastStreamingDecoder
from models.tiny_world.gate import (
    GateTraining,
    canonical_latents,
    gate_config,
    train_gate,
    world_centres,
    world_walls,
)
from models.tiny_world.key_gate import KeyGate
from models.tiny_world.metrics import KEY_AXES, off_centre
from models.tiny_world.plugin import served_plugin
from models.tiny_world.sampling import carry, pin
from models.tiny_world.terrain import TerrainTrainConfig, class_maps, terrain_config, train_terrain
from models.tiny_world.terrain_prior import TerrainPrior
from models.world import World

STAGES = ("ae", "dit", "sf", "sf2", "sf3", "gate", "terrain", "done")
SF_STAGES = ("sf", "sf2", "sf3")
MOTION_FRAMES = 8  # frames a key is held for `key_motions`: two chunks, past the next one
# Settings whose default changed the recipe when they were added: their value before, so a run
# checkpointed before them resumes (and exports) as it was started.
ABSENT = {"sf2_steps": 0, "sf3_steps": 0, "sf3_release_blocked": False, "gate_steps": 0, "terrain_steps": 0}
# Anchored targets (`sf_target` "anchor"): how far (frame pixels) the model's view may have
# drifted from the game's and still be found, and how well it must match the game's terrain
# there (PSNR, dB) to be trained on; below it the model's world no longer is the game's map.
ANCHOR_MARGIN = 24
ANCHOR_MIN_PSNR = 15.0


@dataclass
class TrainConfig:
    """Everything that shapes a training run (recorded in the checkpoint and the model card).
    The defaults are the shipped model's recipe (MODEL_CARD.md)."""

    seed: int = 0  # torch / numpy seed of the whole run
    episodes: int = 640  # training worlds: seeds world_seed_base .. + episodes - 1
    episode_frames: int = 160  # actions per episode (frames per episode = this + 1)
    world_seed_base: int = 0  # first world seed (evaluation uses seeds >= 1_000_000)
    # autoencoder
    ae_steps: int = 1600  # optimiser steps
    ae_batch: int = 32  # frames per step
    ae_lr: float = 2e-3  # peak AdamW learning rate (cosine decay to 5%)
    ae_latent_noise: float = 0.2  # max latent noise during AE training, relative to the latent std
    ae_l2: float = 1e-4  # weight of mean(z^2), pins the latent scale
    ae_tiled: bool = True  # tile-aligned latents (`ae_config(tiled=True)`), phases from the game's camera
    ae_sprite: bool = True  # with ae_tiled: the player and its ring drawn in view coordinates, not in cells
    # DiT
    dit_steps: int = 2000  # optimiser steps
    dit_batch: int = 8  # clips per step
    dit_lr: float = 1e-3  # peak AdamW learning rate (cosine decay to 5%)
    clip_chunks: int = 4  # noisy chunks per training clip (clip = 1 + clip_chunks * chunk_frames)
    context_sigma: float = 0.1  # max noise level of the clean copies (noisy-history augmentation)
    p_schedule_sigma: float = 0.5  # share of chunks trained exactly at TRAIN_SCHEDULE's sigmas
    loss_weight: str = "flow"  # "flow": MSE on noise - x0; "x0": the same weighted by sigma^2 (x0 error)
    ema: float = 0.999  # EMA decay of the shipped DiT weights
    # self-forced second stage (0 steps: none, and no phase after it)
    sf_steps: int = 250  # optimiser steps (0: no second stage)
    sf_batch: int = 8  # clips per step
    sf_lr: float = 3e-4  # peak AdamW learning rate (cosine decay to 5%)
    sf_warmup: int = 50  # linear warm-up steps
    sf_clip_chunks: int = 4  # chunks per clip; the history of chunk j is the rollout of chunks < j
    sf_p_self: float = 0.0  # share of clips whose history is the model's own rollout
    sf_lead: int = 0  # self-rolled clips: chunks rolled out before the clip, so its history is all own
    sf_mask: bool = False  # self-rolled clips: loss only on latents seen in the start frame
    sf_target: str = "game"  # self-rolled clips' targets: "game", "own" (own_world_targets) or "anchor"
    sf_snap: bool = False  # "own" targets redrawn as flat tiles on the game's grid (snap_to_tiles)
    sf_blur: float = 0.0  # share of non-self-rolled clips whose history frames after the start are blurred
    sf_blur_max: float = 2.0  # largest Gaussian blur sigma (frame pixels) of those history frames
    sf_onestep: float = 0.0  # share of the other clips whose history is the model's one-chunk predictions
    sf_adv: float = 0.0  # weight of the adversarial loss on decoded x0 predictions (FrameCritic; 0: off)
    sf_critic_lr: float = 1e-3  # Adam learning rate of that FrameCritic
    sf_jitter: float = 0.0  # std of the colour gain / offset ([-1, 1] units) of those history frames
    sf_warp: float = 0.0  # share of non-self-rolled clips whose last chunk sees a slowed history
    sf_patch: int = 0  # > 0: the sf stage's DiT patch side on the latent grid (`regrid`); 0: dit_config's
    sf_window: int = 0  # > 0: the sf stage's attention window in latent frames; 0: dit_config's
    sf_layers: int = 0  # > 0: the sf stage's DiT grown to this many blocks (`deepen`); 0: dit_config's
    sf_focus: float = 0.0  # share of sf clips from the focus episodes (long idles and holds: FOCUS_POLICY)
    sf_focus_episodes: int = 160  # focus episodes, in the worlds after the training ones
    sf_self_idle: float = 0.0  # share of the all-idle clips whose history is the model's own rollout
    sf_idle_lead: int = 0  # those rollouts first run idle for 0..this many chunks (drawn per step)
    sf_chain: float = 0.0  # weight of the chain loss (`chain_history` vs the game where the start saw)
    sf_chain_clips: int = 4  # clips per step rolled out for the chain loss
    sf_chain_depth: int = 2  # chunks of generated history the chain loss's gradient reaches through
    sf_sprite_jitter: int = 4  # sprite layer: half the clips' history has its sprite moved up to this many px
    sf_jitter_centred: bool = False  # move it only along axes where the game keeps the player centred
    sf_off_centre: float = 0.0  # share of sf clips starting where the game's player is off the view's centre
    # The player's place channels flow from the history's latest place, not from noise, in
    # training and when served (`world_config(place_start=True)`, `WorldConfig.carry_channels`).
    sf_place_start: bool = False
    # Likewise the view's phase channels (where the frame lies on its canvas): a chunk starts from
    # the latest frame's place on the map, not from a random one (a drawn place jitters by a
    # pixel now and then, and the jitter random-walks the idle view away; model card, AM).
    sf_view_start: bool = False
    # A second self-forced phase, `sf2` (0 steps: none): from the sf stage's EMA, `sf2_steps` more
    # steps with the sf stage's settings, except the view carried and the jitter centred as below
    # (model card, AP-AR: carried from the dit stage's EMA instead, AQ, the view costs the scroll).
    sf2_steps: int = 500
    sf2_view_start: bool = True  # its sf_view_start
    sf2_jitter_centred: bool = True  # its sf_jitter_centred
    # A third self-forced phase, `sf3` (0 steps: none): from the sf2 phase's EMA, `sf3_steps` more
    # steps with sf2's settings, except the view's phase channels weighted in the flow loss, so
    # the view follows a held key at the game's speed (model card, AX; AU: weight 4), and the keys
    # as the key gate serves them (BG).
    sf3_steps: int = 250
    sf3_phase_weight: float = 2.0  # its sf_phase_weight
    sf3_release_blocked: bool = True  # its sf_release_blocked (the key gate serves the DiT so; BG)
    # From this stage on ("dit", "sf", "sf2" or "sf3"; "": never) the DiT also reads, per latent cell,
    # where the player is relative to that cell (`with_marker`, `MarkerConfig`): its input layer
    # grows two zero-initialised channels there.
    marker: str = ""
    # Weight of the view's phase channels (the motion: where each frame lies on the map) in the
    # self-forced phases' flow loss; > 1 stresses moving and stopping (walls) against the cells.
    sf_phase_weight: float = 1.0
    # Loss weight of the self-forced phases' chunks in which a held key starts to be blocked (the
    # player walks into a wall: `stop_onsets`). The view's motion persists in almost every chunk,
    # so a model that continues its history's motion is nearly always right; these chunks are
    # the ones that teach walls.
    sf_stop_weight: float = 1.0
    # Share of the self-forced phases' clips that start where a held key is blocked and stays so
    # (`blocked_starts`: the player pressed against a wall): with no motion in the history, only
    # the wall in view says that the view must stand still.
    sf_blocked: float = 0.0
    # Weight of an auxiliary loss in the self-forced phases of a DiT that reads the marker
    # (`--marker`): a linear head on its last block's tokens predicts every cell's marker of the
    # clean frames (`MarkerHead`, trained alongside, not shipped), so the tokens keep where the
    # player is relative to them, which a wall next to the player needs.
    sf_marker_aux: float = 0.0
    # Weight of an auxiliary loss in the self-forced phases: a linear head on the DiT's last block
    # tokens of every clean frame predicts how far the player and the view would move under each
    # key from there (`key_motions`: the wall rule and the camera's clamp at the world's edge,
    # from the game's map), so the tokens must hold what the motion under a key depends on.
    sf_motion_aux: float = 0.0
    # The self-forced phases see every movement key released in the steps where a wall blocks it
    # (`release_blocked`), as a world with a key gate (`models.key_gate`) serves its DiT: a held
    # key then always moves the player, and a blocked one is an idle frame.
    sf_release_blocked: bool = False
    # The key gate (`models.key_gate`; models/tiny_world/gate.py), trained after the DiT stages on
    # the same episodes' latents (0 steps: no gate). Half its frames see the player moved up to
    # `gate_jitter` px, as a generated frame may draw it.
    gate_steps: int = 3000
    gate_jitter: int = 6
    # The terrain prior (`models.terrain_prior`; models/tiny_world/terrain.py), trained last on the
    # training worlds' maps alone (0 steps, or no atlas: none; the DiT invents new terrain).
    terrain_steps: int = 3000
    warmup: int = 200  # linear warm-up steps of both optimisers
    ckpt_every: int = 250  # steps between checkpoints
    log_every: int = 50  # steps between log lines

    def dit_stages(self) -> tuple[str, ...]:
        """The DiT stages this run trains, in order: a self-forced phase continues the one before
        it, so none runs after one of 0 steps."""
        out = ["dit"]
        for stage, n in (("sf", self.sf_steps), ("sf2", self.sf2_steps), ("sf3", self.sf3_steps)):
            if n <= 0:
                break
            out.append(stage)
        return tuple(out)

    @classmethod
    def from_dict(cls, data: dict) -> TrainConfig:
        """Inverse of `asdict` (unknown keys ignored; a setting newer than `data`, as in an older
        run's checkpoint, takes its value from before it existed, `ABSENT`, else the default)."""
        names = {f.name for f in fields(cls)}
        return cls(**{**ABSENT, **{k: v for k, v in data.items() if k in names}})


# --- pure helpers (tested) ---------------------------------------------------------------------


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay from `peak` to 5% of it."""
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def teacher_forcing_layout(n_chunks: int, chunk: int, window: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Mask and RoPE positions of a teacher-forced clip of 1 + n_chunks * chunk frames.

    Sequence order: the clean copies of all F frames (the start frame, then the chunks), then
    noisy copies of frames 1..F-1::

        index:    0 .. F-1            F .. 2F-2
                [ clean 0 .. F-1   | noisy 1 .. F-1 ]
        position: 0 .. F-1            1 .. F-1

    Clean copies see each other block-causally (the serving mask, chunk sizes [1, chunk, ...]);
    a noisy chunk sees the clean frames its serving twin would find in the KV cache, plus itself.
    Returns (mask (2F-1, 2F-1) bool, positions (2F-1,) int64, F).
    """
    sizes = [1] + [chunk] * n_chunks
    f = sum(sizes)
    base = frame_attention_mask(sizes, window)  # (F, F)
    total = 2 * f - 1
    mask = torch.zeros(total, total, dtype=torch.bool)
    mask[:f, :f] = base
    s = 1
    for _ in range(n_chunks):
        rows = slice(f + s - 1, f + s - 1 + chunk)
        mask[rows, :f] = base[s : s + chunk]
        mask[rows, s : s + chunk] = False  # not its own clean copy ...
        mask[rows, rows] = True  # ... but itself
        s += chunk
    positions = torch.cat([torch.arange(f), torch.arange(1, f)])
    return mask, positions, f


def seen_latent_mask(cameras: torch.Tensor, size: int, patch: int) -> torch.Tensor:
    """Which latent pixels of every clip frame show only ground the clip's start frame showed.

    `cameras` (B, F, 2) is the view's top-left corner (x, y) in frame pixels for the clip's
    frames; frame pixel p of frame j shows what pixel p + camera_j - camera_0 of frame 0 shows,
    so it was seen iff that pixel lies inside [0, size)^2. A latent pixel covers a `patch` x
    `patch` block of frame pixels and counts as seen iff all of them were. Returns (B, F, h, w)
    float32 of 0/1 with h = w = size // patch (frame 0 is all ones)."""
    d = cameras - cameras[:, :1]  # (B, F, 2) shift relative to the start frame
    lo = torch.arange(0, size, patch, dtype=torch.float32)  # first pixel of each latent row/column
    inside = (lo + d[..., None] >= 0) & (lo + patch + d[..., None] <= size)  # (B, F, 2, n)
    return (inside[:, :, 1, :, None] & inside[:, :, 0, None, :]).float()


def own_world_targets(
    last: torch.Tensor,
    shifts: torch.Tensor,
    last_player: torch.Tensor,
    players: torch.Tensor,
    player_size: float,
    grid: TileGrid | None = None,
    camera: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Target frames in the model's own world: its latest frame moved as the game's camera moves.

    `last` (B, 3, H, W) in [-1, 1] is the model's latest frame, `shifts` (B, T, 2) the game's
    camera of each target frame minus its camera at `last` (x, y, frame pixels; rounded),
    `last_player` (B, 2) and `players` (B, T, 2) the game's player centre on screen at `last` and
    at each target frame. The sprite is erased from `last` (its box, 1 px wider for the model's
    blur, filled with the pixel row just above it, or below at the top edge), the result shifted
    (target pixel p shows pixel p + shift of `last`), the pixels it does not cover set to 0
    and marked invalid, and a `player_size` magenta square painted at each target's player
    position (pixels whose centres lie in it, as the game draws it). With `grid` and `camera`
    (B, 2) (the game's view corner at `last`), `last` is first redrawn crisply on the game's
    tile grid (`snap_to_tiles`, which also removes the sprite) instead of the box erase.
    Returns (frames (B, 3, T, H, W), valid (B, T, H, W) bool)."""
    b, _, h, w = last.shape
    t = shifts.shape[1]
    half = player_size / 2.0
    if grid is not None:
        clean = snap_to_tiles(last, camera, grid)
    else:
        clean = last.clone()
        for i in range(b):
            (px, py) = last_player[i].tolist()
            x0, x1 = max(math.ceil(px - half - 1.5), 0), min(math.ceil(px + half + 0.5), w)
            y0, y1 = max(math.ceil(py - half - 1.5), 0), min(math.ceil(py + half + 0.5), h)
            if x0 < x1 and y0 < y1:
                src = y0 - 1 if y0 > 0 else min(y1, h - 1)
                clean[i, :, y0:y1, x0:x1] = clean[i, :, src : src + 1, x0:x1]
    d = shifts.round().long()  # (B, T, 2)
    xs = torch.arange(w)[None, None] + d[..., :1]  # (B, T, W)
    ys = torch.arange(h)[None, None] + d[..., 1:]  # (B, T, H)
    valid = ((ys >= 0) & (ys < h))[..., :, None] & ((xs >= 0) & (xs < w))[..., None, :]  # (B, T, H, W)
    pix = clean.permute(0, 2, 3, 1)  # (B, H, W, 3)
    bi = torch.arange(b)[:, None, None, None]
    frames = pix[bi, ys.clamp(0, h - 1)[..., :, None], xs.clamp(0, w - 1)[..., None, :]]  # (B, T, H, W, 3)
    frames = frames * valid[..., None]
    magenta = torch.tensor([1.0, -1.0, 1.0])
    for i in range(b):
        for j in range(t):
            px, py = players[i, j].tolist()
            x0, x1 = max(math.ceil(px - half - 0.5), 0), min(math.ceil(px + half - 0.5), w)
            y0, y1 = max(math.ceil(py - half - 0.5), 0), min(math.ceil(py + half - 0.5), h)
            frames[i, j, y0:y1, x0:x1] = magenta
    return frames.permute(0, 4, 1, 2, 3), valid


def frames_of(video: torch.Tensor) -> torch.Tensor:
    """Decoded video (B, 3, T, H, W) as a batch of frames (B*T, 3, H, W), clamped to [-1, 1]."""
    return video.transpose(1, 2).flatten(0, 1).clamp(-1.0, 1.0)


def match_shift(frame: torch.Tensor, terrain: torch.Tensor, margin: int) -> tuple[int, int, float]:
    """Where `frame` (3, H, W) in [-1, 1] sits in `terrain` (3, H + 2 margin, W + 2 margin), the
    game's terrain around its view: the shift (dx, dy) in frame pixels of the view that `frame`
    shows best (least squared error) relative to the game's, and that error's PSNR (dB, peak 2)."""
    h, w = frame.shape[1:]
    cross = torch.nn.functional.conv2d(terrain[None], frame[None])[0, 0]  # (2m+1, 2m+1)
    box = torch.nn.functional.avg_pool2d(terrain.pow(2).sum(0)[None, None], (h, w), stride=1)[0, 0] * (h * w)
    sse = frame.pow(2).sum() - 2.0 * cross + box
    k = int(sse.argmin())
    dy, dx = divmod(k, sse.shape[1])
    mse = float(sse.flatten()[k].clamp_min(1e-8)) / frame.numel()
    return dx - margin, dy - margin, 10.0 * math.log10(4.0 / mse)


@dataclass(frozen=True)
class TileGrid:
    """The game's drawing rules that a crisp own-world target keeps: square tiles of `tile`
    frame pixels, each one flat shade of `shades` (K, 3) in [-1, 1]."""

    tile: float
    shades: torch.Tensor

    @classmethod
    def of(cls, config: GameConfig) -> TileGrid:
        """The terrain grid and the eight terrain shades of a game config."""
        shades = torch.from_numpy(config.palette.terrain().reshape(-1, 3).astype(np.float32))
        return cls(tile=config.tile * config.scale, shades=shades / 127.5 - 1.0)


def snap_to_tiles(frames: torch.Tensor, camera: torch.Tensor, grid: TileGrid) -> torch.Tensor:
    """Redraw frames (B, 3, H, W) in [-1, 1] as flat tiles: every tile of the game's grid (its
    phase from `camera` (B, 2), the view's top-left corner in frame pixels) takes the shade its
    pixels vote for most, each pixel voting for its nearest shade. Pixels far from every shade
    (sprites, creatures, the space ring) vote only where a tile has no other pixel, so the
    result is terrain alone; blur between two tiles only moves a few boundary votes."""
    b, _, h, w = frames.shape
    k = grid.shades.shape[0]
    pix = frames.permute(0, 2, 3, 1)  # (B, H, W, 3)
    dist = (pix[..., None, :] - grid.shades).pow(2).sum(-1)  # (B, H, W, K)
    near, vote = dist.min(dim=-1)
    weight = torch.where(near < 0.1, 1.0, 1e-3)  # 0.1: ~23 levels RMS per channel from a shade

    def cells(cam: torch.Tensor, n: int) -> torch.Tensor:  # (B, n) tile index of each pixel, from 0
        first = torch.floor((cam[:, None] + torch.arange(n) + 0.5) / grid.tile)
        return (first - first[:, :1]).long()

    cy, cx = cells(camera[:, 1], h), cells(camera[:, 0], w)  # (B, H), (B, W)
    ny, nx = int(cy.max()) + 1, int(cx.max()) + 1
    cell = cy[:, :, None] * nx + cx[:, None, :]  # (B, H, W)
    votes = torch.zeros(b, ny * nx * k)
    votes.scatter_add_(1, (cell * k + vote).view(b, -1), weight.view(b, -1))
    shade = votes.view(b, ny * nx, k).argmax(-1)  # (B, cells)
    return grid.shades[shade.gather(1, cell.view(b, -1))].view(b, h, w, 3).permute(0, 3, 1, 2)


def regrid(dit: CausalWan, patch: int, window: int) -> CausalWan:
    """A copy of `dit` on a `patch` x `patch` token grid with a `window`-frame attention window.

    Every block carries over unchanged; the patch embedding of a finer token is the coarse one's
    response to a flat patch (its kernel summed over the coarse patch), and the head's output of
    a finer token is the mean of the coarse head's outputs over its patch, so a flat region is
    embedded and read out as before. Refining by an integer factor only."""
    old = dit.cfg.patch_size[1]
    if old % patch or dit.cfg.patch_size[1] != dit.cfg.patch_size[2]:
        raise ValueError(f"cannot regrid a {dit.cfg.patch_size} patch to {patch}")
    cfg = replace(dit.cfg, patch_size=(1, patch, patch), window_frames=window)
    out = CausalWan(cfg)
    state = dict(dit.state_dict())
    f = old // patch  # fine tokens per coarse token along each side; coarse row = i * patch + fine row
    w = state["patch_embedding.weight"]  # (D, C, 1, old, old)
    state["patch_embedding.weight"] = w.unflatten(3, (f, patch)).unflatten(5, (f, patch)).sum((3, 5))
    c = cfg.out_channels
    head_w = state["proj_out.weight"].view(f, patch, f, patch, c, -1)  # rows ordered (ph, pw, C)
    head_b = state["proj_out.bias"].view(f, patch, f, patch, c)
    state["proj_out.weight"] = head_w.mean((0, 2)).flatten(0, 2)
    state["proj_out.bias"] = head_b.mean((0, 2)).flatten()
    out.load_state_dict(state)
    return out


def deepen(dit: CausalWan, layers: int, seed: int) -> CausalWan:
    """A copy of `dit` with `layers` blocks: block i of `dit` becomes block i * layers // n
    (spread evenly) and the blocks between are new, with every projection onto the residual
    stream (self- and cross-attention outputs, the action module's output, the feed-forward's
    last layer) zero. A zero projection makes a block the identity, so the deeper model computes
    exactly what `dit` does and training grows into the new capacity. The new blocks' other
    weights are drawn from `seed`. Every block keeps an action module, so `dit` must have one in all."""
    n, cfg = dit.cfg.num_layers, dit.cfg
    if layers <= n:
        raise ValueError(f"deepen: {layers} layers is not more than the model's {n}")
    if cfg.action is None or cfg.action.kind != "worldserve" or cfg.action.blocks < n:
        raise ValueError("deepen needs the worldserve action module in every block")
    new_cfg = replace(cfg, num_layers=layers, action=replace(cfg.action, blocks=layers))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        out = CausalWan(new_cfg)
    place = {i * layers // n: i for i in range(n)}
    state = out.state_dict()
    for key, value in dit.state_dict().items():
        if not key.startswith("blocks."):
            state[key] = value
    residual = ("attn1.to_out.0.", "attn2.to_out.0.", "action.key_out.", "action.motion_out.", "ffn.net.2.")
    for j in range(layers):
        if j in place:
            old = dit.blocks[place[j]].state_dict()
            state.update({f"blocks.{j}.{k}": v for k, v in old.items()})
        else:
            for key in [k for k in state if k.startswith(tuple(f"blocks.{j}.{r}" for r in residual))]:
                state[key] = torch.zeros_like(state[key])
    out.load_state_dict(state)
    return out


def with_marker(dit: CausalWan, marker: MarkerConfig) -> CausalWan:
    """A copy of `dit` that also reads the per-cell sprite marker (`sprite_marker`): the patch
    embedding grows the marker's input channels with zero weights, so the copy computes exactly
    what `dit` does until training gives them weight."""
    if dit.cfg.marker is not None:
        raise ValueError("the DiT already reads a marker")
    out = CausalWan(replace(dit.cfg, marker=marker))
    state = dict(dit.state_dict())
    w = state["patch_embedding.weight"]  # (D, C, 1, ph, pw)
    pad = w.new_zeros(w.shape[0], MarkerConfig.channels, *w.shape[2:])
    state["patch_embedding.weight"] = torch.cat([w, pad], dim=1)
    out.load_state_dict(state)
    return out


def gaussian_blur(frames: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """Blur frames (N, 3, H, W) with a separable Gaussian of per-frame `sigma` (N,) pixels
    (edges replicated; sigma 0 leaves a frame as it is)."""
    radius = max(1, math.ceil(3 * float(sigma.max())))
    d = torch.arange(-radius, radius + 1, dtype=torch.float32)
    k = torch.exp(-0.5 * (d / sigma.clamp_min(1e-3)[:, None]) ** 2)  # (N, 2r+1)
    k = k / k.sum(1, keepdim=True)
    x = torch.nn.functional.pad(frames, (radius,) * 4, mode="replicate")
    rows = x.unfold(3, 2 * radius + 1, 1)  # (N, 3, H+2r, W, 2r+1)
    x = (rows * k[:, None, None, None, :]).sum(-1)
    cols = x.unfold(2, 2 * radius + 1, 1)  # (N, 3, H, W, 2r+1)
    return (cols * k[:, None, None, None, :]).sum(-1)


def chunk_anchors(
    cameras: torch.Tensor, chunk: int, tile: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where the frames of clips (cameras (B, F, 2), frame pixels; F = 1 + whole chunks) lie for
    tile-aligned latents (`FastAutoencoder.canonical`): their sub-tile offsets q (B, F, 2), and how
    many tiles past the anchor each frame's own anchor is (B, F, 2), as history (the anchor of its
    chunk's last frame: a chunk is re-anchored there when it enters the history) and as a target
    (the anchor of the previous chunk's last frame, where the model draws it). The start frame is
    on its own anchor in both."""
    cell = torch.div(cameras.round(), tile, rounding_mode="floor").long()
    q = cameras.round().long() - cell * tile
    f = cameras.shape[1]
    if (f - 1) % chunk:
        raise ValueError(f"{f} frames are not a start frame plus whole chunks of {chunk}")
    i = torch.arange(1, f)
    last = torch.cat([torch.zeros(1, dtype=torch.long), chunk * ((i - 1) // chunk + 1)])
    before = torch.cat([torch.zeros(1, dtype=torch.long), chunk * ((i - 1) // chunk)])
    return q, cell - cell[:, last], cell - cell[:, before]


def on_anchors(ae: FastAutoencoder, wide: torch.Tensor, q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Clips (B, C, F, g, g) of frames `wide` (B, F, C-4, g+2, g+2) with sub-tile offsets q
    (B, F, 2), drawn on the anchors d (B, F, 2) tiles before their own (`chunk_anchors`)."""
    if d.abs().max() > 1:
        raise ValueError("the view moved more than a tile within a chunk")
    b, f = wide.shape[:2]
    z = ae.at_anchor(wide.flatten(0, 1), q.flatten(0, 1), d.flatten(0, 1))
    return z.view(b, f, *z.shape[1:]).permute(0, 2, 1, 3, 4)


def anchored_clips(
    ae: FastAutoencoder, wide: torch.Tensor, cams: torch.Tensor, chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tile-aligned clips as the model sees them, from the cells around each frame's own anchor
    (`FastAutoencoder.encode_wide`: wide (B, F, C-4, g+2, g+2)) and the cameras (B, F, 2): as
    targets and as clean history (B, C, F, g, g) each, on the anchors `chunk_anchors` gives."""
    q, d_hist, d_target = chunk_anchors(cams, chunk, ae.cfg.spatial)
    return on_anchors(ae, wide, q, d_target), on_anchors(ae, wide, q, d_hist)


def valid_latent_mask(valid: torch.Tensor, patch: int) -> torch.Tensor:
    """(B, T, H, W) bool frame pixels -> (B, T, H/patch, W/patch) float 0/1: a latent pixel
    counts iff its whole `patch` x `patch` footprint is valid."""
    b, t, h, w = valid.shape
    blocks = valid.view(b, t, h // patch, patch, w // patch, patch)
    return blocks.all(dim=5).all(dim=3).float()


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
    and blocked (`key_blocked`): what the DiT of a world with a key gate is given."""
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


def sample_sigmas(
    gen: torch.Generator,
    shape: tuple[int, ...],
    schedule_sigmas: Sequence[float],
    shift: float,
    p_schedule: float,
) -> torch.Tensor:
    """Per-chunk noise levels: the unrolled schedule's sigmas with probability `p_schedule`, else
    shifted uniform (`shift * u / (1 + (shift - 1) u)`, as the sampler warps its steps)."""
    u = torch.rand(shape, generator=gen)
    cont = shift * u / (1 + (shift - 1) * u)
    table = torch.tensor(list(schedule_sigmas), dtype=torch.float32)
    pick = table[torch.randint(len(table), shape, generator=gen)]
    use = torch.rand(shape, generator=gen) < p_schedule
    return torch.where(use, pick, cont)


@torch.no_grad()
def rollout_history(
    dit: CausalWan,
    x0: torch.Tensor,
    actions: torch.Tensor,
    schedule: FlowSchedule,
    gen: torch.Generator,
    noise: Callable[[int, int], torch.Tensor] | None = None,
    first: int = 0,
    last_inputs: torch.Tensor | None = None,
    canonical: Callable[[torch.Tensor], torch.Tensor] | None = None,
    carry_channels: Sequence[int] = (),
    gate: KeyGate | None = None,
) -> torch.Tensor:
    """The model's own version of a clip: frame 0 of `x0` (B, C, F, h, w), then chunk after chunk
    generated by the serving sampler (the schedule's steps, clean history at t = 0, the cached
    rollout's block-causal window and sinks) under `actions` (B, F, 1, width). Returns (B, C, F, h, w).
    `noise(chunk, step)` may supply the sampler's noise (B, C, chunk_frames, h, w) (tests: the
    engine's); by default it is drawn from `gen`. Chunks before `first` are kept from `x0`, so
    the later ones are generated on that history instead of the model's own. `last_inputs`
    (B, C, F-1, h, w), if given, receives every generated chunk's input to the sampler's last step.
    `canonical` (the autoencoder's, as `World.context` applies it) snaps every generated chunk
    before it becomes history. `carry_channels` of every noise draw hold the history's latest
    frame, as `World.carry` serves them; a key `gate` releases the keys it finds blocked from
    that frame before each generated chunk and pins the motion it plans into every clean
    estimate, as `World.steer` and `World.pin` do.

    It runs as a session does: every chunk through the model's K/V cache (`forward_chunk`: the
    sampler's forwards, then the clean pass that writes the chunk's K/V), so a chunk costs the same
    at frame 600 as at frame 16. The cache holds the whole clip (no ring): a chunk's slots are its
    frame numbers and what it reads is its row of `frame_attention_mask`. The model's own cache
    (a serving pool, if any) is put back after."""
    cfg = dit.cfg
    chunk, window = cfg.chunk_frames, cfg.window_frames
    b, c, f, h, w = x0.shape
    if (f - 1) % chunk:
        raise ValueError(f"{f} frames are not a start frame plus whole chunks of {chunk}")
    tpf = dit.tokens_per_frame(h, w)
    slack = max(0, f - cfg.sink_frames - window)
    capacity = cfg.sink_frames + window + slack
    mask = frame_attention_mask([1] + [chunk] * ((f - 1) // chunk), window, cfg.sink_frames)
    rows = torch.arange(b)
    shape = (b, c, chunk, h, w)
    if noise is None:
        noise = lambda _chunk, _step: torch.randn(shape, generator=gen)  # noqa: E731

    def index(s: int, n: int) -> ChunkIndex:
        valid = torch.zeros(capacity, dtype=torch.bool)
        valid[:f] = mask[s]
        slots = torch.arange(s * tpf, (s + n) * tpf)
        return ChunkIndex(rows, slots.expand(b, -1), valid.expand(b, -1), torch.full((b,), s))

    out = x0.clone()
    zero = torch.zeros(b)
    served = dit.pool
    dit.setup_caches(b, h, w, dtype=x0.dtype, device=x0.device, slack_frames=slack)
    try:
        for r in range(b):
            dit.set_text(r, dit.null_text(x0.device, x0.dtype))
        dit.forward_chunk(out[:, :, :1], zero, index(0, 1), actions[:, :1], need_output=False)
        for j, s in enumerate(range(1, f, chunk)):
            idx, acts = index(s, chunk), actions[:, s : s + chunk]
            if j >= first:
                last = out[:, :, s - 1 : s]  # the history's latest frame, for the carried channels
                planned = None
                if gate is not None:
                    acts, planned = gate.steer(acts, last[:, :, 0])

                def draw(step: int, j: int = j, last: torch.Tensor = last) -> torch.Tensor:
                    return carry(noise(j, step), last, carry_channels)

                x = draw(0)  # the runner starts from pure noise (the first sigma is 1)
                for k, (tk, sg) in enumerate(zip(schedule.timesteps, schedule.sigmas, strict=True)):
                    if last_inputs is not None and k == len(schedule.sigmas) - 1:
                        last_inputs[:, :, s - 1 : s - 1 + chunk] = x
                    pred = dit.forward_chunk(x, torch.full((b,), float(tk)), idx, acts)
                    x0_hat = schedule.to_x0(pred, x, sg)
                    if planned is not None:
                        x0_hat = pin(x0_hat, marker_inputs(gate.cfg.marker), planned)
                    if k + 1 < len(schedule.sigmas):
                        fresh = lambda k=k: draw(k + 1)  # noqa: E731
                        x = schedule.next_x(x0_hat, x, sg, schedule.sigmas[k + 1], fresh)
                out[:, :, s : s + chunk] = x0_hat if canonical is None else canonical(x0_hat)
            dit.forward_chunk(out[:, :, s : s + chunk], zero, idx, acts, need_output=False)
    finally:
        dit.pool = served
    return out


def teacher_forced_x0(
    dit: CausalWan,
    clean: torch.Tensor,
    noisy: torch.Tensor,
    actions: torch.Tensor,
    schedule: FlowSchedule,
    step: int,
) -> torch.Tensor:
    """Every chunk's clean estimate in one forward of the teacher-forced layout: the noisy copies
    `noisy` (B, C, F-1, h, w) at the schedule's step `step`, each attending to the clean copies
    `clean` (B, C, F, h, w) its serving twin would find in the cache, under `actions` (B, F, 1,
    width). Returns (B, C, F-1, h, w)."""
    chunk = dit.cfg.chunk_frames
    b, f = clean.shape[0], clean.shape[2]
    mask, positions, _ = teacher_forcing_layout((f - 1) // chunk, chunk, dit.cfg.window_frames)
    tk, sg = schedule.timesteps[step], schedule.sigmas[step]
    t = torch.cat([torch.zeros(b, f), torch.full((b, f - 1), float(tk))], dim=1)
    text = [dit.text_kv(dit.null_text(clean.device, clean.dtype))] * b
    seq_a = torch.cat([actions, actions[:, 1:]], dim=1)
    pred = dit.forward_dense(torch.cat([clean, noisy], dim=2), t, text, mask, seq_a, positions)[:, :, f:]
    return schedule.to_x0(pred, noisy, sg)


def chain_history(
    dit: CausalWan,
    x0: torch.Tensor,
    actions: torch.Tensor,
    schedule: FlowSchedule,
    gen: torch.Generator,
    depth: int,
) -> torch.Tensor:
    """The model's own rollout of a clip (frame 0 of `x0` (B, C, F, h, w), `actions` (B, F, 1,
    width)) with a gradient: the rollout runs without one (`rollout_history`), then every chunk's
    last sampler step is re-run `depth` times at once in the teacher-forced layout, each pass on
    the previous pass's outputs as clean history. The values stay the rollout's (its fixed point);
    the gradient reaches one more chunk of generated history with every pass (truncated
    backpropagation through the rollout, as Self-Forcing trains through its own chunks). Returns
    the generated frames 1..F-1 (B, C, F-1, h, w)."""
    last = torch.empty_like(x0[:, :, 1:])
    own = rollout_history(dit, x0, actions, schedule, gen, last_inputs=last)
    hist, out = own, own[:, :, 1:]
    for _ in range(depth):
        out = teacher_forced_x0(dit, hist, last, actions, schedule, len(schedule.steps) - 1)
        hist = torch.cat([own[:, :, :1], out], dim=2)
    return out


@torch.no_grad()
def onestep_history(
    dit: CausalWan,
    x0: torch.Tensor,
    actions: torch.Tensor,
    schedule: FlowSchedule,
    gen: torch.Generator,
    noise: Callable[[int, int], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The model's one-chunk-ahead version of a clip: frame 0 of `x0` (B, C, F, h, w), then every
    chunk generated by the serving sampler from the ground-truth frames before it (all chunks at
    once, in the teacher-forced layout), under `actions` (B, F, 1, width). Chunk j equals what
    `rollout_history(..., first=j)` generates for it; such a history carries the model's own
    one-chunk errors (softness, lag) while each chunk stays next to the truth. `noise(chunk,
    step)` as in `rollout_history`. Returns (B, C, F, h, w)."""
    chunk, f = dit.cfg.chunk_frames, x0.shape[2]
    if noise is None:
        shape = (*x0.shape[:2], f - 1, *x0.shape[3:])
        draw = lambda _step: torch.randn(shape, generator=gen)  # noqa: E731
    else:
        draw = lambda step: torch.cat([noise(j, step) for j in range((f - 1) // chunk)], dim=2)  # noqa: E731
    x = draw(0)
    for k, sg in enumerate(schedule.sigmas):
        x0_hat = teacher_forced_x0(dit, x0, x, actions, schedule, k)
        if k + 1 < len(schedule.sigmas):
            x = schedule.next_x(x0_hat, x, sg, schedule.sigmas[k + 1], lambda k=k: draw(k + 1))
    return torch.cat([x0[:, :, :1], x0_hat], dim=2)


class FrameCritic(nn.Module):
    """A small patch discriminator on 64x64 frames in [-1, 1]: (N, 3, H, W) -> (N, H/8 * W/8)
    logits, one per 8x8 patch (one game tile), spectrally normalised for a stable hinge game
    (PatchGAN / ADD style). It learns the game's look (flat tiles, its palette, crisp edges), so
    its loss asks a prediction to be a sample, where least squares alone asks for a mean."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        sn = nn.utils.parametrizations.spectral_norm
        self.net = nn.Sequential(
            sn(nn.Conv2d(3, width, 4, 2, 1)),
            nn.LeakyReLU(0.2),
            sn(nn.Conv2d(width, 2 * width, 4, 2, 1)),
            nn.LeakyReLU(0.2),
            sn(nn.Conv2d(2 * width, 4 * width, 4, 2, 1)),
            nn.LeakyReLU(0.2),
            sn(nn.Conv2d(4 * width, 1, 3, 1, 1)),
        )

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        return self.net(frames).flatten(1)


# --- checkpoints -------------------------------------------------------------------------------


class AuxHeads(nn.Module):
    """Linear readouts from a DiT's last block tokens (B, F*T, dim), one token per patch of cells,
    for the self-forced phases' auxiliary losses (trained alongside, never shipped): `marker`,
    the sprite marker of the token's cells (`sprite_marker`, `sf_marker_aux`); `motion`, the
    token's frame's `key_motions` (`sf_motion_aux`)."""

    def __init__(self, dim: int, patch: tuple[int, int, int], marker: bool, motion: bool) -> None:
        super().__init__()
        self.patch = patch[1:]
        self.marker = nn.Linear(dim, MarkerConfig.channels * patch[1] * patch[2]) if marker else None
        self.motion = nn.Linear(dim, 2 * len(KEY_AXES)) if motion else None

    def marker_targets(self, marker: torch.Tensor) -> torch.Tensor:
        """The marker (B, 2, F, H, W) laid out as the tokens (B, F*T, 2*ph*pw), frame-major."""
        b, ch, f, h, w = marker.shape
        ph, pw = self.patch
        x = marker.view(b, ch, f, h // ph, ph, w // pw, pw).permute(0, 2, 3, 5, 1, 4, 6)
        return x.reshape(b, f * (h // ph) * (w // pw), ch * ph * pw)


def save_checkpoint(path: Path, state: dict) -> None:
    """Write atomically (a crash mid-write leaves the previous checkpoint)."""
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def rng_state(rng: np.random.Generator, gen: torch.Generator) -> dict:
    """The data-sampling RNG states, for an exact resume."""
    return {"numpy": rng.bit_generator.state, "torch": gen.get_state()}


def set_rng_state(rng: np.random.Generator, gen: torch.Generator, state: dict) -> None:
    rng.bit_generator.state = state["numpy"]
    gen.set_state(state["torch"])


# --- the trainer -------------------------------------------------------------------------------


class Trainer:
    """Runs the stages in order; every `ckpt_every` steps and at the time limit it checkpoints."""

    def __init__(self, cfg: TrainConfig, out: Path, deadline: float | None, progress: bool = True) -> None:
        self.cfg = cfg
        self.out = out
        self.deadline = deadline  # time.monotonic() after which the run checkpoints and stops
        self.progress = progress
        self.ckpt_path = out / "ckpt.pt"
        self.log_path = out / "train_log.jsonl"
        self.stage = "ae"
        self.step = 0
        self.elapsed = 0.0  # training seconds over all sessions of this run
        self._t0 = time.monotonic()
        torch.manual_seed(cfg.seed)
        if cfg.ae_sprite and not cfg.ae_tiled:
            raise SystemExit("--ae-sprite needs --ae-tiled true")
        # Checked before any stage runs, so a run does not train for an hour to stop at its last.
        if cfg.sf_steps and (cfg.sf_sprite_jitter or cfg.sf_place_start) and not cfg.ae_sprite:
            raise SystemExit(
                "--sf-sprite-jitter and --sf-place-start need a sprite layer "
                "(--ae-sprite true; or set them off)"
            )
        if cfg.sf_steps and cfg.sf_view_start and not cfg.ae_tiled:
            raise SystemExit(
                "--sf-view-start needs tile-aligned latents (--ae-tiled true; or --sf-view-start false)"
            )
        stages = cfg.dit_stages()
        if "sf2" in stages and cfg.sf2_view_start and not cfg.ae_tiled:
            raise SystemExit(
                "--sf2-view-start needs tile-aligned latents (--ae-tiled true; or --sf2-view-start false)"
            )
        if cfg.sf_marker_aux > 0 and cfg.marker not in SF_STAGES:
            raise SystemExit(
                "--sf-marker-aux needs a DiT that reads the marker in its self-forced phases (--marker sf)"
            )
        if min(cfg.sf_phase_weight, cfg.sf3_phase_weight, cfg.sf_stop_weight) <= 0:
            raise SystemExit("--sf-phase-weight, --sf3-phase-weight, --sf-stop-weight: loss weights > 0")
        if min(cfg.sf_marker_aux, cfg.sf_motion_aux) < 0:
            raise SystemExit("--sf-marker-aux, --sf-motion-aux: loss weights >= 0")
        phase_weighted = cfg.sf_phase_weight != 1.0 or ("sf3" in stages and cfg.sf3_phase_weight != 1.0)
        if phase_weighted and not cfg.ae_tiled:
            raise SystemExit("--sf-phase-weight weighs the phase of tile-aligned latents (--ae-tiled true)")
        if cfg.marker:
            if cfg.marker not in stages:
                raise SystemExit(f"--marker names a stage this run trains {stages}, not {cfg.marker!r}")
            if not cfg.ae_sprite:
                raise SystemExit("--marker needs a sprite layer (--ae-sprite true; or --marker '')")
        self.ae = FastAutoencoder(ae_config(cfg.ae_tiled, cfg.ae_sprite))
        self.dit = CausalWan(dit_config(self.ae.cfg.latent_channels))
        self.ema = CausalWan(dit_config(self.ae.cfg.latent_channels))
        self.ema.load_state_dict(self.dit.state_dict())
        self.ema.requires_grad_(False)
        self.ae_opt = torch.optim.AdamW(
            self.ae.parameters(), lr=cfg.ae_lr, betas=(0.9, 0.99), weight_decay=0.0
        )
        self.dit_opt = torch.optim.AdamW(
            self.dit.parameters(), lr=cfg.dit_lr, betas=(0.9, 0.99), weight_decay=0.01
        )
        self.rng = np.random.default_rng(cfg.seed)
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.episodes: Episodes | None = None
        self.critic: FrameCritic | None = None  # the sf stage's adversary (`sf_adv` > 0)
        self.critic_opt: torch.optim.Optimizer | None = None
        self.adv_log: dict[str, float] = {}  # the critic's last losses, for the train log
        self.aux_heads: AuxHeads | None = None  # `sf_marker_aux` or `sf_motion_aux` > 0, in an sf phase
        self.aux_opt: torch.optim.Optimizer | None = None
        self.phase_log: dict[str, float] = {}  # the last step's unweighted loss on the phase channels
        self.gate: KeyGate | None = None  # the `gate` stage's key gate, once trained
        self.terrain: TerrainPrior | None = None  # the `terrain` stage's prior, once trained

    # -- bookkeeping ----------------------------------------------------------------------------

    def log(self, record: dict) -> None:
        with self.log_path.open("a") as f:
            f.write(json.dumps({"stage": self.stage, "step": self.step, **record}) + "\n")

    def total_elapsed(self) -> float:
        return self.elapsed + time.monotonic() - self._t0

    def checkpoint(self) -> None:
        save_checkpoint(
            self.ckpt_path,
            {
                "config": asdict(self.cfg),
                "stage": self.stage,
                "step": self.step,
                "elapsed": self.total_elapsed(),
                "ae": self.ae.state_dict(),
                "ae_cfg": self.ae.cfg.to_dict(),
                "ae_opt": self.ae_opt.state_dict(),
                "dit": self.dit.state_dict(),
                "ema": self.ema.state_dict(),
                "dit_cfg": self.ema.cfg.to_dict(),
                "dit_opt": self.dit_opt.state_dict(),
                "rng": rng_state(self.rng, self.gen),
                **(
                    {"critic": self.critic.state_dict(), "critic_opt": self.critic_opt.state_dict()}
                    if self.critic is not None and self.critic_opt is not None
                    else {}
                ),
                **(
                    {"aux_heads": self.aux_heads.state_dict(), "aux_opt": self.aux_opt.state_dict()}
                    if self.aux_heads is not None and self.aux_opt is not None
                    else {}
                ),
                **({"gate": self.gate.state_dict()} if self.gate is not None else {}),
                **({"terrain": self.terrain.state_dict()} if self.terrain is not None else {}),
            },
        )

    def resume(self) -> None:
        state = torch.load(self.ckpt_path, weights_only=False)
        if state["config"] != {k: v for k, v in asdict(self.cfg).items() if k in state["config"]}:
            raise SystemExit(f"{self.ckpt_path} was written with another config: {state['config']}")
        self.stage, self.step, self.elapsed = state["stage"], state["step"], state["elapsed"]
        self.ae.load_state_dict(state["ae"])
        mean, std = state["ae_cfg"]["latents_mean"], state["ae_cfg"]["latents_std"]
        if mean:
            self.ae.set_normalisation(torch.tensor(mean), torch.tensor(std))
        self.ae_opt.load_state_dict(state["ae_opt"])
        ema = self.ema
        if "dit_cfg" in state:
            if (cfg := CausalWanConfig.from_dict(state["dit_cfg"])) != ema.cfg:
                ema = CausalWan(cfg)
        elif self.stage in (*SF_STAGES, "done"):  # a checkpoint from before the shape was recorded
            ema = self.sf_arch(ema) or ema
        if ema is not self.ema:
            # The checkpoint holds the reshaped modules: build their shapes before loading.
            self.ema = ema.requires_grad_(False)
            self.dit = CausalWan(self.ema.cfg)
            self.dit_opt = torch.optim.AdamW(self.dit.parameters(), betas=(0.9, 0.99), weight_decay=0.01)
        self.dit.load_state_dict(state["dit"])
        self.ema.load_state_dict(state["ema"])
        self.dit_opt.load_state_dict(state["dit_opt"])
        if "critic" in state:
            self.new_critic()
            self.critic.load_state_dict(state["critic"])
            self.critic_opt.load_state_dict(state["critic_opt"])
        if "aux_heads" in state:
            heads = state["aux_heads"]
            self.new_aux_heads(marker="marker.weight" in heads, motion="motion.weight" in heads)
            self.aux_heads.load_state_dict(heads)
            self.aux_opt.load_state_dict(state["aux_opt"])
        if "gate" in state:
            self.gate = KeyGate(gate_config(self.ae))
            self.gate.load_state_dict(state["gate"])
        if "terrain" in state:
            self.terrain = TerrainPrior(terrain_config(self.ae.cfg.palette))
            self.terrain.load_state_dict(state["terrain"])
        set_rng_state(self.rng, self.gen, state["rng"])

    def reuse_ae(self, run: Path) -> None:
        """Take the trained autoencoder (and its latents) of another run; start at the DiT stage."""
        state = torch.load(run / "ckpt.pt", weights_only=False)
        data_keys = ("episodes", "episode_frames", "world_seed_base")
        if state["stage"] == "ae" or any(state["config"][k] != getattr(self.cfg, k) for k in data_keys):
            raise SystemExit(f"{run}: no finished autoencoder for this data config")
        self.ae.load_state_dict(state["ae"])
        self.ae.set_normalisation(
            torch.tensor(state["ae_cfg"]["latents_mean"]), torch.tensor(state["ae_cfg"]["latents_std"])
        )
        if (run / "latents.safetensors").is_file():
            shutil.copyfile(run / "latents.safetensors", self.out / "latents.safetensors")
        self.stage, self.step = "dit", 0
        self.log({"reused_ae_from": str(run)})

    def init_from(self, model_dir: Path) -> None:
        """Take the autoencoder and the DiT of an exported model directory (e.g. the shipped
        weights, which are the `dit` stage's EMA) and start at the `sf` stage."""
        from models.registry import load_world

        world = load_world(model_dir)
        if world.decoder.ae.cfg.frame_size != self.ae.cfg.frame_size:
            raise SystemExit(
                f"{model_dir}: its latents are {'' if world.decoder.ae.cfg.frame_size else 'not '}"
                f"tile-aligned; pass --ae-tiled {str(not self.cfg.ae_tiled).lower()}"
            )
        self.ae.load_state_dict(world.decoder.ae.state_dict())
        ae_cfg = world.decoder.ae.cfg
        self.ae.set_normalisation(torch.tensor(ae_cfg.latents_mean), torch.tensor(ae_cfg.latents_std))
        if world.transformer.cfg.marker is not None:
            self.ema = with_marker(self.ema, world.transformer.cfg.marker).requires_grad_(False)
        self.ema.load_state_dict(world.transformer.state_dict())
        self.stage = "sf"
        self.begin_sf()
        self.log({"init_from": str(model_dir)})

    def begin_sf(self) -> None:
        """Enter a self-forced phase (`sf`, then `sf2`, `sf3`): train on from the EMA weights with a fresh
        optimiser and the stage's own RNGs (so a phase does not depend on how the one before it
        was reached: `--init-from` a model with the `sf2` settings as the sf stage's computes
        the same phase)."""
        c = self.cfg
        self.step = 0
        if self.stage == "sf" and (ema := self.sf_arch(self.ema)) is not None:
            self.ema = ema.requires_grad_(False)
            self.dit = CausalWan(self.ema.cfg)
        self.mark()
        self.dit.load_state_dict(self.ema.state_dict())
        self.dit_opt = torch.optim.AdamW(
            self.dit.parameters(), lr=c.sf_lr, betas=(0.9, 0.99), weight_decay=0.01
        )
        self.rng = np.random.default_rng([c.seed, 2])
        self.gen = torch.Generator().manual_seed(c.seed + 2_000_003)
        if c.sf_adv > 0:
            self.new_critic()
        marker = c.sf_marker_aux > 0 and self.dit.cfg.marker is not None
        self.aux_heads = self.aux_opt = None
        if marker or c.sf_motion_aux > 0:
            self.new_aux_heads(marker, c.sf_motion_aux > 0)

    def new_aux_heads(self, marker: bool, motion: bool) -> None:
        """Freshly initialised `AuxHeads` (seeded) for the DiT's width and patch, and their optimiser."""
        state = torch.random.get_rng_state()
        torch.manual_seed(self.cfg.seed + 5_000_011)
        cfg = self.dit.cfg
        self.aux_heads = AuxHeads(
            cfg.num_attention_heads * cfg.attention_head_dim, cfg.patch_size, marker, motion
        )
        torch.random.set_rng_state(state)
        self.aux_opt = torch.optim.Adam(self.aux_heads.parameters(), lr=self.cfg.sf_lr, betas=(0.9, 0.99))

    def new_critic(self) -> None:
        """A freshly initialised `FrameCritic` (seeded) and its optimiser."""
        state = torch.random.get_rng_state()
        torch.manual_seed(self.cfg.seed + 3_000_017)
        self.critic = FrameCritic()
        torch.random.set_rng_state(state)
        self.ae.requires_grad_(False)  # its decoder only carries the critic's gradient to the DiT
        lr = self.cfg.sf_critic_lr
        self.critic_opt = torch.optim.Adam(self.critic.parameters(), lr=lr, betas=(0.5, 0.99))

    def sf_config(self, stage: str | None = None) -> TrainConfig:
        """The settings a self-forced phase (default: the current stage) trains by: the run's, or
        in `sf2` the run's with that phase's steps, view start and jitter, in `sf3` sf2's with
        its own steps, phase weight and released blocked keys."""
        c = self.cfg
        stage = stage or self.stage
        if stage not in ("sf2", "sf3"):
            return c
        sf2 = replace(
            c, sf_steps=c.sf2_steps, sf_view_start=c.sf2_view_start, sf_jitter_centred=c.sf2_jitter_centred
        )
        if stage == "sf2":
            return sf2
        return replace(
            sf2,
            sf_steps=c.sf3_steps,
            sf_phase_weight=c.sf3_phase_weight,
            sf_release_blocked=c.sf3_release_blocked,
        )

    def carried(self, stage: str | None = None) -> tuple[int, ...]:
        """The latent channels a stage (default: the current one) starts from the history's
        latest frame (`carried_channels`); none outside the self-forced phases."""
        stage = stage or self.stage
        if stage not in SF_STAGES:
            return ()
        c = self.sf_config(stage)
        return carried_channels(c.sf_place_start, c.sf_view_start)

    def sf_arch(self, dit: CausalWan) -> CausalWan | None:
        """The sf stage's DiT made from `dit` when `sf_patch` / `sf_window` (`regrid`) or
        `sf_layers` (`deepen`) change its shape, else None."""
        c, base = self.cfg, dit_config()
        if c.sf_steps == 0:
            return None
        out = None
        if c.sf_patch or c.sf_window:
            out = regrid(dit, c.sf_patch or base.patch_size[1], c.sf_window or base.window_frames)
        if c.sf_layers:
            out = deepen(out or dit, c.sf_layers, seed=c.seed + 4_000_037)
        return out

    def mark(self) -> None:
        """Give the DiT (and its EMA) the sprite marker (`with_marker`) if the current stage reads
        it and they do not yet (a fresh optimiser follows in every stage that can start here)."""
        m = self.cfg.marker
        if not m or STAGES.index(self.stage) < STAGES.index(m) or self.ema.cfg.marker is not None:
            return
        marker = marker_config(self.ae.cfg)
        self.ema = with_marker(self.ema, marker).requires_grad_(False)
        self.dit = with_marker(self.dit, marker)
        self.dit_opt = torch.optim.AdamW(self.dit.parameters(), betas=(0.9, 0.99), weight_decay=0.01)

    def out_of_time(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline

    # -- stages ---------------------------------------------------------------------------------

    def data(self) -> Episodes:
        if self.episodes is None:
            c = self.cfg
            seeds = list(range(c.world_seed_base, c.world_seed_base + c.episodes))
            self.episodes = make_episodes(
                seeds, c.episode_frames, SIZE, progress=self.progress, layers=c.ae_sprite
            )
        return self.episodes

    def step_done(self, bar: tqdm) -> bool:
        """After an optimiser step: checkpoint on schedule; False (checkpointed) when out of time."""
        if self.step % self.cfg.ckpt_every == 0:
            self.checkpoint()
        if self.out_of_time():
            bar.close()
            self.checkpoint()
            return False
        return True

    def train_ae(self) -> bool:
        """Returns False when the time limit stopped it."""
        c, ae, eps = self.cfg, self.ae, self.data()
        frames = eps.frames.reshape(-1, SIZE, SIZE, 3)  # (E*(N+1), H, W, 3)
        offsets = self.frame_offsets(eps.cameras)  # (E*(N+1), 2) or None
        sprites = self.frame_sprites(eps.players, eps.rings)  # (E*(N+1), 3) or None
        backdrops = None if sprites is None else eps.backdrops.reshape(-1, SIZE, SIZE, 3)
        cells = ae.cfg.cell_channels
        ae.train()
        bar = tqdm(total=c.ae_steps, initial=self.step, desc="autoencoder", disable=not self.progress)
        while self.step < c.ae_steps:
            idx = self.rng.integers(0, frames.shape[0], size=c.ae_batch)
            x = torch.from_numpy(frames[idx]).float().div(127.5).sub(1.0)  # (B, H, W, 3)
            x = x.permute(0, 3, 1, 2)[:, :, None]  # (B, 3, 1, H, W)
            off = None if offsets is None else offsets[idx][:, None]  # (B, 1, 2)
            spr = None if sprites is None else sprites[idx][:, None]  # (B, 1, 3)
            z = ae.encode_raw(x, off, spr)
            rel = torch.rand(z.shape[0], 1, 1, 1, 1, generator=self.gen) * c.ae_latent_noise
            noise = torch.randn(z.shape, generator=self.gen)
            noise[:, cells:] = 0.0  # phase and sprite channels stay exact: they place what is drawn
            zn = z + rel * z[:, :cells].detach().std() * noise
            extra: dict[str, float] = {}
            if spr is None:
                rec = ae.decode_raw(zn)
                loss = 0.0
            else:
                # The cells draw the frame without the sprite; the sprite layer draws it over them.
                back, rec = ae.decode_layers(zn[:, :, 0])
                rec = rec[:, :, None]
                target = torch.from_numpy(backdrops[idx]).float().div(127.5).sub(1.0).permute(0, 3, 1, 2)
                loss = (back - target).abs().mean() + (back - target).pow(2).mean()
                heat, state = ae.sprite_net(x[:, :, 0])
                where = spr[:, 0, 1] * SIZE + spr[:, 0, 0]  # (B,) index of the centre pixel
                on = spr[:, 0, 2].float()
                loss = loss + nn.functional.cross_entropy(heat, where)
                loss = loss + nn.functional.binary_cross_entropy_with_logits(state, on)
                extra["sprite_acc"] = (
                    ((heat.argmax(1) == where) & ((state > 0) == (on > 0))).float().mean().item()
                )
            l1 = (rec - x).abs().mean()
            mse = (rec - x).pow(2).mean()
            loss = loss + l1 + mse + c.ae_l2 * z[:, :cells].pow(2).mean()
            if ae.phase is not None:
                # Logit k of an axis means "tile edges at k mod s": a frame at offset o has them at -o.
                logits = ae.phase(x[:, :, 0])  # (B, 2, s)
                target = (ae.cfg.spatial - off[:, 0]) % ae.cfg.spatial  # (B, 2)
                loss = loss + nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())
                extra["phase_acc"] = (logits.argmax(-1) == target).float().mean().item()
            for group in self.ae_opt.param_groups:
                group["lr"] = lr_at(self.step, c.ae_steps, c.ae_lr, c.warmup)
            self.ae_opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ae.parameters(), 1.0)
            self.ae_opt.step()
            self.step += 1
            bar.update(1)
            if self.step % c.log_every == 0 or self.step == c.ae_steps:
                psnr = 10 * math.log10(4.0 / max(mse.item(), 1e-10))  # [-1, 1] range: peak-to-peak 2
                bar.set_postfix(loss=f"{loss.item():.4f}", psnr=f"{psnr:.1f}")
                self.log(
                    {"loss": loss.item(), "l1": l1.item(), "psnr": psnr, "t": self.total_elapsed(), **extra}
                )
            if not self.step_done(bar):
                return False
        bar.close()
        ae.eval()
        self.set_latent_stats(frames, offsets, sprites)
        self.stage, self.step = "dit", 0
        self.checkpoint()
        return True

    def frame_offsets(self, cameras: np.ndarray) -> torch.Tensor | None:
        """Tile-aligned latents: every frame's sub-tile offset (..., 2) long, from the game's
        camera (whole frame pixels); None for plain latents."""
        if not self.ae.cfg.frame_size:
            return None
        s = self.ae.cfg.spatial
        return torch.from_numpy(np.rint(cameras).astype(np.int64) % s).reshape(-1, 2)

    def frame_sprites(self, players: np.ndarray, rings: np.ndarray | None) -> torch.Tensor | None:
        """With a sprite layer: every frame's player centre (x, y) in view pixels (players
        (..., 2)) and ring flag (rings (...,)), (N, 3) long; None without a sprite layer or
        without recorded rings (the encoder then reads them off the frames)."""
        if not self.ae.cfg.sprite or rings is None:
            return None
        centre = torch.from_numpy(np.rint(players).astype(np.int64))
        ring = torch.from_numpy(rings.astype(np.int64))[..., None]
        return torch.cat([centre, ring], dim=-1).reshape(-1, 3)

    @torch.no_grad()
    def set_latent_stats(
        self,
        frames: np.ndarray,
        offsets: torch.Tensor | None = None,
        sprites: torch.Tensor | None = None,
        n: int = 4096,
    ) -> None:
        """Per-channel mean/std of the raw latents of `n` frames (fixed sample); the sprite
        channels keep their raw scale (mean 0, std 1), whose units the decoder rounds to."""
        n = min(n, frames.shape[0])
        idx = np.random.default_rng(self.cfg.seed + 1).integers(0, frames.shape[0], size=n)
        x = torch.from_numpy(frames[idx]).float().div(127.5).sub(1.0).permute(0, 3, 1, 2)[:, :, None]
        off = None if offsets is None else offsets[idx][:, None]
        spr = None if sprites is None else sprites[idx][:, None]
        z = torch.cat(
            [
                self.ae.encode_raw(
                    x[i : i + 256],
                    None if off is None else off[i : i + 256],
                    None if spr is None else spr[i : i + 256],
                )
                for i in range(0, n, 256)
            ]
        )  # (n, C, 1, h, w)
        mean, std = z.mean(dim=(0, 2, 3, 4)), z.std(dim=(0, 2, 3, 4))
        # A channel constant over the sample (the phase, when no sampled frame's camera moved)
        # keeps its raw scale: dividing by a zero std would make every latent inf or NaN.
        std = torch.where(std > 1e-6, std, torch.ones_like(std))
        sp = self.ae.cfg.sprite_slice
        mean[sp], std[sp] = 0.0, 1.0
        self.ae.set_normalisation(mean, std)

    @torch.no_grad()
    def latents(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Every episode frame encoded (E, N+1, C, h, w) float16, its action rows, the camera
        and the player's screen position of every frame (E, N+1, 2) (None in caches written
        before they were recorded), cached in DIR/latents.safetensors."""
        path = self.out / "latents.safetensors"
        if path.is_file():
            data = load_file(str(path))
            return data["latents"], data["actions"], data.get("cameras"), data.get("players")
        tensors = self.encode_episodes(self.data())
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
        return tensors["latents"], tensors["actions"], tensors["cameras"], tensors["players"]

    @torch.no_grad()
    def encode_episodes(self, eps: Episodes) -> dict[str, torch.Tensor]:
        """Episodes as the DiT stages read them: latents (E, N+1, C, h, w) float16, action rows,
        cameras and players' screen positions (E, N+1, 2)."""
        self.ae.eval()
        out = [self.encode_frames(*ep) for ep in self.each_episode(eps, "encode")]
        return {
            "latents": torch.stack(out),
            "actions": torch.from_numpy(eps.actions),
            "cameras": torch.from_numpy(eps.cameras),
            "players": torch.from_numpy(eps.players),
        }

    def focus_latents(self) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        """The focus episodes (`sf_focus_episodes` worlds after the training ones, played by
        `FOCUS_POLICY`) encoded as `encode_episodes` does, and blurred as `blurred_latents` does
        when `sf_blur` > 0 (else None); cached in DIR/focus.safetensors with its settings."""
        c = self.cfg
        path = self.out / "focus.safetensors"
        blur = c.sf_blur > 0
        meta = {
            "seed": str(c.seed),
            "episodes": str(c.sf_focus_episodes),
            "policy": json.dumps(FOCUS_POLICY, sort_keys=True),
            "blur_max": str(c.sf_blur_max) if blur else "",
            "jitter": str(c.sf_jitter),
        }
        if path.is_file():
            with safe_open(str(path), "pt") as f:
                if f.metadata() == meta:
                    tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a dict)
                    return tensors, tensors.pop("blurred", None)
        first = c.world_seed_base + c.episodes
        seeds = list(range(first, first + c.sf_focus_episodes))
        eps = make_episodes(
            seeds, c.episode_frames, SIZE, progress=self.progress, policy=FOCUS_POLICY, layers=c.ae_sprite
        )
        tensors = self.encode_episodes(eps)
        if blur:
            tensors["blurred"] = self.encode_blurred(eps, torch.Generator().manual_seed(c.seed + 5_000_011))
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=meta)
        return tensors, tensors.pop("blurred", None)

    def blurred_latents(self) -> torch.Tensor:
        """Every episode frame degraded as the model's own rollout leaves its history: blurred
        (`gaussian_blur`, sigma uniform in [0.5, sf_blur_max] per frame) and, with `sf_jitter`,
        its colours shifted (per frame and channel: gain 1 + N(0, jitter), offset N(0, jitter)),
        then encoded; (E, N+1, C, h, w) float16, seeded. Cached in DIR/blurred.safetensors with
        the settings that made it (a cache made otherwise is rebuilt)."""
        c = self.cfg
        path = self.out / "blurred.safetensors"
        meta = {"seed": str(c.seed), "blur_max": str(c.sf_blur_max), "jitter": str(c.sf_jitter)}
        if path.is_file():
            with safe_open(str(path), "pt") as f:
                if f.metadata() == meta:
                    return f.get_tensor("latents")
        lat = self.encode_blurred(self.data(), torch.Generator().manual_seed(c.seed + 3_000_017))
        save_file({"latents": lat.contiguous()}, str(path), metadata=meta)
        return lat

    @torch.no_grad()
    def encode_blurred(self, eps: Episodes, gen: torch.Generator) -> torch.Tensor:
        """Every frame of `eps` blurred (and jittered) as `blurred_latents` describes, drawing
        from `gen`, then encoded: (E, N+1, C, h, w) float16."""
        c = self.cfg
        self.ae.eval()
        out = []
        for frames, cams, sprites in self.each_episode(eps, "encode blurred"):
            frames = frames.permute(0, 3, 1, 2)  # (N+1, 3, H, W)
            n = frames.shape[0]
            soft = gaussian_blur(frames, 0.5 + torch.rand(n, generator=gen) * (c.sf_blur_max - 0.5))
            if c.sf_jitter > 0:
                gain = 1.0 + c.sf_jitter * torch.randn(n, 3, 1, 1, generator=gen)
                soft = (soft * gain + c.sf_jitter * torch.randn(n, 3, 1, 1, generator=gen)).clamp(-1.0, 1.0)
            out.append(self.encode_frames(soft.permute(0, 2, 3, 1), cams, sprites))
        return torch.stack(out)

    def each_episode(
        self, eps: Episodes, desc: str
    ) -> Iterator[tuple[torch.Tensor, np.ndarray, torch.Tensor | None]]:
        """Every episode's frames (N+1, H, W, 3) in [-1, 1], cameras (N+1, 2) and sprites
        (`frame_sprites`), with a progress bar."""
        rings = eps.rings if eps.rings is not None else [None] * len(eps)
        for ep, cams, players, ring in tqdm(
            zip(eps.frames, eps.cameras, eps.players, rings, strict=True),
            desc=desc,
            unit="ep",
            total=len(eps),
            disable=not self.progress,
        ):
            yield torch.from_numpy(ep).float() / 127.5 - 1.0, cams, self.frame_sprites(players, ring)

    @torch.no_grad()
    def encode_frames(
        self, frames: torch.Tensor, cameras: np.ndarray, sprites: torch.Tensor | None = None
    ) -> torch.Tensor:
        """One episode's frames (N+1, H, W, 3) in [-1, 1], cameras (N+1, 2) and sprites (None:
        read off the frames) -> normalised latents (N+1, C, h, w) float16; tile-aligned latents:
        the cells around each frame's own anchor (`encode_wide`, its offset from the camera) that
        `clip_latents` cuts clips from."""
        off = self.frame_offsets(cameras)
        if off is not None:
            return self.ae.encode_wide(frames.permute(0, 3, 1, 2), off, sprites).half()
        z = self.ae.encode_float(frames.permute(3, 0, 1, 2)[None])  # from (1, 3, N+1, H, W)
        return z[0].transpose(0, 1).half()

    def clip_latents(
        self, source: torch.Tensor, cams: torch.Tensor | None, e: np.ndarray, idx: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Clips of episodes `e`, frames `idx` (B, F) from `source` (`latents` or
        `blurred_latents`) as the model's targets and as its clean history, (B, C, F, h, w) each:
        the same latents, but for tile-aligned ones, whose targets lie on the anchor the model
        draws them on and whose history on the one the session re-anchors them to
        (`chunk_anchors`)."""
        x = source[e[:, None], idx].float()  # (B, F, C, h, w)
        if not self.ae.cfg.frame_size:
            x = x.permute(0, 2, 1, 3, 4)
            return x, x
        return anchored_clips(self.ae, x, cams[e[:, None], idx], self.dit.cfg.chunk_frames)

    def history_latents(
        self, source: torch.Tensor, cams: torch.Tensor | None, e: np.ndarray, idx: np.ndarray
    ) -> torch.Tensor:
        """`clip_latents`' clean history alone, for frames `idx` that need not be a path the view
        could take (a slowed history: its targets' anchors may lie out of reach)."""
        x = source[e[:, None], idx].float()
        if not self.ae.cfg.frame_size:
            return x.permute(0, 2, 1, 3, 4)
        q, d_hist, _ = chunk_anchors(cams[e[:, None], idx], self.dit.cfg.chunk_frames, self.ae.cfg.spatial)
        return on_anchors(self.ae, x, q, d_hist)

    def train_dit(self) -> bool:
        """Returns False when the time limit stopped it."""
        lat, acts, cams, _ = self.latents()
        self.mark()
        c, dit = self.cfg, self.dit
        self.episodes = None  # the frames are no longer needed
        dcfg = dit.cfg
        mask, positions, f = teacher_forcing_layout(c.clip_chunks, dcfg.chunk_frames, dcfg.window_frames)
        n_eps, n_frames = lat.shape[:2]
        dit.train()
        bar = tqdm(total=c.dit_steps, initial=self.step, desc="dit", disable=not self.progress)
        while self.step < c.dit_steps:
            e = self.rng.integers(0, n_eps, size=c.dit_batch)
            s = self.rng.integers(0, n_frames - f + 1, size=c.dit_batch)
            idx = s[:, None] + np.arange(f)[None, :]  # (B, F)
            x0, hist = self.clip_latents(lat, cams, e, idx)  # (B, C, F, h, w) each
            a = acts[e[:, None], idx].clone()  # (B, F, width)
            a[:, 0] = 0.0  # the start frame is prefilled with an idle action when served
            a = a[:, :, None]  # (B, F, 1, width): one video frame per latent frame
            loss, gnorm = self.flow_step(x0, hist, a, mask, positions, f, c.dit_lr, c.dit_steps, c.warmup)
            self.step += 1
            bar.update(1)
            if self.step % c.log_every == 0 or self.step == c.dit_steps:
                bar.set_postfix(loss=f"{loss:.4f}")
                self.log({"loss": loss, "grad_norm": gnorm, "t": self.total_elapsed(), **self.phase_log})
            if not self.step_done(bar):
                return False
        bar.close()
        if self.cfg.sf_steps > 0:
            self.stage = "sf"
            self.begin_sf()
        else:
            self.end_dit()
        self.checkpoint()
        return True

    def end_dit(self) -> None:
        """After the last DiT stage: the key gate's stage, or done."""
        self.stage, self.step = ("gate" if self.cfg.gate_steps > 0 else "done"), 0

    def train_gate(self) -> bool:
        """The `gate` stage: a key gate (`models.key_gate`) on every episode frame as the served
        history holds it (on its own anchor, `canonical`), labelled by the game's rule on each
        world's map (`free_walk`). Records its held-out accuracy in the log; always finishes."""
        c = self.cfg
        self.stage = "gate"  # also when entered from `init_from` (models/tiny_world/gate.py)
        lat, acts, cams, players = self.latents()
        if cams is None or players is None or not self.ae.cfg.sprite:
            raise SystemExit(
                "the key gate needs tile-aligned latents with a sprite layer, cameras and players"
            )
        t0 = time.monotonic()
        q = self.frame_offsets(cams.numpy()).view(*cams.shape[:2], 2)
        own = torch.cat(  # every frame on its own anchor, 32 episodes at a time
            [
                on_anchors(self.ae, lat[i : i + 32].float(), q[i : i + 32], torch.zeros_like(q[i : i + 32]))
                .transpose(1, 2)
                .half()
                for i in range(0, len(lat), 32)
            ]
        )
        z = canonical_latents(self.ae, own)
        game = GameConfig(size=SIZE)
        walls = world_walls(range(c.world_seed_base, c.world_seed_base + lat.shape[0]), game)
        tr = GateTraining(steps=c.gate_steps, jitter=c.gate_jitter, seed=c.seed)
        gate, record = train_gate(
            gate_config(self.ae),
            z,
            walls,
            world_centres(cams, players, game),
            self.ae.cfg.sprite_slice.start,
            tr,
            game,
            progress=self.progress,
            cameras=cams,
            actions=acts,
        )
        self.gate = gate
        self.log({**record, "seconds": round(time.monotonic() - t0, 1), "t": self.total_elapsed()})
        self.stage = "terrain" if c.terrain_steps > 0 and atlas_tiles(self.gate) else "done"
        self.step = 0
        self.checkpoint()
        return True

    def train_terrain(self) -> None:
        """The `terrain` stage: the terrain prior (`models.terrain_prior`) on the training worlds'
        maps in the autoencoder's palette (`class_maps`). Records its held-out figures in the log."""
        c = self.cfg
        t0 = time.monotonic()
        maps = class_maps(
            range(c.world_seed_base, c.world_seed_base + c.episodes), self.ae.cfg.palette, GameConfig()
        )
        self.terrain, record = train_terrain(
            maps, self.ae.cfg.palette, TerrainTrainConfig(steps=c.terrain_steps), seed=c.seed
        )
        self.log({**record, "seconds": round(time.monotonic() - t0, 1), "t": self.total_elapsed()})
        self.stage, self.step = "done", 0
        self.checkpoint()

    def train_sf(self) -> bool:
        """The current self-forced phase (`sf`, `sf2` or `sf3`); False when the time limit stopped it."""
        c, dit = self.sf_config(), self.dit
        lat, acts, cams, players = self.latents()
        if c.sf_target not in ("game", "own", "anchor"):
            raise SystemExit(f"sf_target must be 'game', 'own' or 'anchor', not {c.sf_target!r}")
        if (c.sf_mask or c.sf_target == "own") and cams is None:
            raise SystemExit(f"{self.out}/latents.safetensors has no cameras; sf_mask needs a fresh encode")
        if c.sf_lead and (c.sf_mask or c.sf_target == "own"):
            raise SystemExit("sf_lead leaves no ground-truth start frame for sf_mask or sf_target 'own'")
        if c.sf_chain > 0 and cams is None:
            raise SystemExit(f"{self.out}/latents.safetensors has no cameras; sf_chain needs a fresh encode")
        tiled_off = {
            "sf_mask": c.sf_mask,
            "sf_target": c.sf_target != "game",
            "sf_onestep": c.sf_onestep > 0,
            "sf_chain": c.sf_chain > 0,
        }
        if self.ae.cfg.frame_size and any(tiled_off.values()):
            raise SystemExit(f"tile-aligned latents do not support {[k for k, v in tiled_off.items() if v]}")
        carried = self.carried()
        needs_players = (
            c.sf_target == "own"
            or c.sf_jitter_centred
            or c.sf_off_centre > 0
            or c.sf_blocked > 0
            or c.sf_motion_aux > 0
            or c.sf_stop_weight != 1.0
            or c.sf_release_blocked
        )
        if needs_players and players is None:
            raise SystemExit(f"{self.out}/latents.safetensors has no player positions; needs a fresh encode")
        sched = TRAIN_SCHEDULE
        chunk = dit.cfg.chunk_frames
        mask, positions, f = teacher_forcing_layout(c.sf_clip_chunks, chunk, dit.cfg.window_frames)
        n_eps, n_frames = lat.shape[:2]
        blurred = self.blurred_latents() if c.sf_blur > 0 else None
        n_focus = 0
        if c.sf_focus > 0:
            # The focus episodes go after the training ones; a clip picks them with odds sf_focus.
            focus, focus_blurred = self.focus_latents()
            n_focus = focus["latents"].shape[0]
            lat, acts = torch.cat([lat, focus["latents"]]), torch.cat([acts, focus["actions"]])
            if cams is not None:
                cams, players = torch.cat([cams, focus["cameras"]]), torch.cat([players, focus["players"]])
            if blurred is not None:
                blurred = torch.cat([blurred, focus_blurred])
        self.episodes = None
        onsets = stop_onsets(acts, cams, players) if c.sf_stop_weight != 1.0 else None
        motions = None
        if c.sf_motion_aux > 0:  # the focus episodes' worlds follow the training ones'
            motions = key_motions(c.world_seed_base + np.arange(lat.shape[0]), cams, players)
        lead = c.sf_lead * chunk
        border = np.zeros((0, 2), dtype=np.int64)
        if c.sf_off_centre > 0:
            border = off_centre_starts(players[:n_eps], lead, n_frames - f)
            if not len(border):
                raise SystemExit(
                    "--sf-off-centre: no clip of the training episodes starts with the player off the "
                    "view's centre"
                )
        walls = np.zeros((0, 2), dtype=np.int64)
        if c.sf_blocked > 0:
            walls = blocked_starts(acts[:n_eps], cams[:n_eps], players[:n_eps], lead, n_frames - f)
            if not len(walls):
                raise SystemExit(
                    "--sf-blocked: no clip of the training episodes starts pressed against a wall"
                )
        if c.sf_release_blocked:  # after the onsets and blocked starts, which read the pressed keys
            acts = release_blocked(acts, cams, players)

        def clips(idx: np.ndarray, e: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
            """Latents (B, C, F, h, w) and action rows (B, F, 1, width) of episode frames `idx`
            (B, F); the start frame's action is idle, as a session's first frame."""
            x, _ = self.clip_latents(lat, cams, e, idx)
            rows = acts[e[:, None], idx].clone()
            rows[:, 0] = 0.0
            return x, rows[:, :, None]

        desc = "self-forced" if self.stage == "sf" else "self-forced 2"
        bar = tqdm(total=c.sf_steps, initial=self.step, desc=desc, disable=not self.progress)
        while self.step < c.sf_steps:
            e = self.rng.integers(0, n_eps, size=c.sf_batch)
            if n_focus:
                pick = self.rng.random(c.sf_batch) < c.sf_focus
                e = np.where(pick, n_eps + self.rng.integers(0, n_focus, size=c.sf_batch), e)
            s = self.rng.integers(0, n_frames - f - lead + 1, size=c.sf_batch) + lead
            drawn = {}
            for name, starts, share in (
                ("off_centre", border, c.sf_off_centre),
                ("blocked", walls, c.sf_blocked),
            ):
                if len(starts):
                    pick = self.rng.random(c.sf_batch) < share
                    at = starts[self.rng.integers(0, len(starts), size=c.sf_batch)]
                    e, s = np.where(pick, at[:, 0], e), np.where(pick, at[:, 1], s)
                    drawn[f"{name}_clips"] = float(pick.mean())
            idx = s[:, None] + np.arange(f)[None, :]
            x0, a = clips(idx, e)
            b = x0.shape[0]
            own = torch.rand(b, generator=self.gen) < c.sf_p_self
            idle = torch.zeros(b, dtype=torch.bool)
            if c.sf_self_idle > 0:
                # No key in the clip: the game's frames stay the right targets whatever the model's
                # own history drifted to, so its rollout can be corrected back toward them.
                idle = idle_clips(a) & (torch.rand(b, generator=self.gen) < c.sf_self_idle) & ~own
            centred = None
            if c.sf_jitter_centred:
                centred = ~off_centre(players[e[:, None], idx], SIZE).any(dim=1)  # (B, 2): centred throughout
            hist, warp = self.degraded_history(x0, a, e, idx, ~(own | idle), blurred, lat, cams, centred)
            if own.any():
                # Rolled out from the ground truth `lead` frames before the clip, then cut to it.
                sel = own.numpy()
                x_own, a_own = clips(idx[sel, :1] - lead + np.arange(f + lead)[None, :], e[sel])
                dit.eval()
                hist[own] = rollout_history(
                    dit, x_own, a_own, sched, self.gen, canonical=self.ae.canonical, carry_channels=carried
                )[:, :, lead:]
                dit.train()
            n_idle = 0
            if idle.any():
                # Rolled out idle from the clip's start frame for a drawn number of chunks first
                # (the game's world stands still meanwhile), then through the idle clip.
                n_idle = chunk * int(self.rng.integers(0, c.sf_idle_lead + 1))
                x_idle = torch.zeros(int(idle.sum()), x0.shape[1], n_idle + f, *x0.shape[3:])
                x_idle[:, :, :1] = x0[idle, :, :1]
                a_idle = torch.zeros(x_idle.shape[0], n_idle + f, *a.shape[2:])
                dit.eval()
                hist[idle] = rollout_history(
                    dit, x_idle, a_idle, sched, self.gen, canonical=self.ae.canonical, carry_channels=carried
                )[:, :, n_idle:]
                dit.train()
            own |= idle
            weight, extra = None, dict(drawn)
            if c.sf_self_idle > 0:
                extra.update(self_rolled=own.float().mean().item(), idle_lead=n_idle)
            if c.sf_target == "anchor":
                # Self-rolled clips: the game re-anchored to the model's world; others as usual.
                weight = torch.ones_like(x0[:, :1, 1:])
                if own.any():
                    sel = own.numpy()
                    tgt, weight[own], shift = self.anchored_targets(hist[own], x0[own], e[sel], s[sel])
                    x0 = x0.clone()
                    x0[own] = tgt
                    anchored = shift[..., 0].isfinite()
                    extra = {
                        "anchored": anchored.float().mean().item(),
                        "anchor_shift": shift[anchored].abs().mean().item() if anchored.any() else 0.0,
                    }
            elif c.sf_target == "own":
                # Self-rolled clips: targets from the model's own world; ground-truth clips as usual.
                weight = torch.ones_like(x0[:, :1, 1:])
                if own.any():
                    sel = e[:, None][own.numpy()], idx[own.numpy()]
                    tgt, w_own = self.own_targets(hist[own], cams[sel], players[sel])
                    x0 = x0.clone()
                    x0[own], weight[own] = tgt, w_own
            elif c.sf_mask:
                # Ground-truth clips keep the full loss; self-rolled ones only where it is determined.
                seen = seen_latent_mask(cams[e[:, None], idx], SIZE, SIZE // x0.shape[-1])  # (B, F, h, w)
                weight = torch.where(own[:, None, None, None], seen, torch.ones_like(seen))[:, None, 1:]
            if onsets is not None:
                # The chunks in which a held key starts to be blocked weigh sf_stop_weight.
                stops = stop_chunks(onsets, e, idx, chunk)
                weight = torch.ones_like(x0[:, :1, 1:]) if weight is None else weight
                per_frame = torch.where(stops, c.sf_stop_weight, 1.0).repeat_interleave(chunk, 1)
                weight = weight * per_frame[:, None, :, None, None]
                extra["stop_chunks"] = stops.float().mean().item()
            if warp.any():  # slowed clips train only their last chunk
                weight = torch.ones_like(x0[:, :1, 1:]) if weight is None else weight
                weight[warp, :, : f - 1 - chunk] = 0.0
            chain = self.chain_loss(lat, cams, clips) if c.sf_chain > 0 else None
            if chain is not None:
                extra["chain_loss"] = chain.item()
            loss, gnorm = self.flow_step(
                x0,
                hist,
                a,
                mask,
                positions,
                f,
                c.sf_lr,
                c.sf_steps,
                c.sf_warmup,
                weight,
                None if chain is None else c.sf_chain * chain,
                None if motions is None else motions[e[:, None], idx],
            )
            self.step += 1
            bar.update(1)
            if self.step % c.log_every == 0 or self.step == c.sf_steps:
                drift = (hist[own] - x0[own]).pow(2).mean().item() if own.any() else 0.0
                bar.set_postfix(loss=f"{loss:.4f}", drift=f"{drift:.3f}")
                record = {"loss": loss, "grad_norm": gnorm, "history_mse": drift, "t": self.total_elapsed()}
                record.update(extra)
                record.update(self.adv_log)
                record.update(self.phase_log)
                if weight is not None:
                    record["supervised"] = (weight > 0).float().mean().item()  # noisy latents in the loss
                self.log(record)
            if not self.step_done(bar):
                return False
        bar.close()
        stages = self.cfg.dit_stages()
        if stages[-1] != self.stage:
            self.stage = stages[stages.index(self.stage) + 1]
            self.begin_sf()
        else:
            self.end_dit()
        self.checkpoint()
        return True

    def chain_loss(
        self,
        lat: torch.Tensor,
        cams: torch.Tensor,
        clips: Callable[[np.ndarray, np.ndarray], tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """The chain loss of `sf_chain_clips` fresh clips: their own rollout with the gradient
        through `sf_chain_depth` chunks of it (`chain_history`), squared error against the
        game's latents where the clip's start frame saw them (`seen_latent_mask`)."""
        c = self.cfg
        f = 1 + c.sf_clip_chunks * self.dit.cfg.chunk_frames
        e = self.rng.integers(0, lat.shape[0], size=c.sf_chain_clips)
        idx = self.rng.integers(0, lat.shape[1] - f + 1, size=c.sf_chain_clips)[:, None] + np.arange(f)
        x0, a = clips(idx, e)
        self.dit.eval()
        out = chain_history(self.dit, x0, a, TRAIN_SCHEDULE, self.gen, c.sf_chain_depth)
        self.dit.train()
        seen = seen_latent_mask(cams[e[:, None], idx], SIZE, SIZE // x0.shape[-1])[:, None, 1:]
        err = (out - x0[:, :, 1:]).pow(2) * seen
        return err.sum() / (seen.sum().clamp_min(1.0) * x0.shape[1])

    def degraded_history(
        self,
        x0: torch.Tensor,
        a: torch.Tensor,
        e: np.ndarray,
        idx: np.ndarray,
        eligible: torch.Tensor,
        blurred: torch.Tensor | None,
        lat: torch.Tensor,
        cams: torch.Tensor | None,
        centred: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The clean history of clips `x0` (B, C, F, h, w) (episodes `e`, frames `idx`, action rows
        `a`), degraded as the model's own rollout degrades it, for `eligible` clips only. Returns
        (history, which clips were slowed). The start frame always stays as served (sharp).
        `lat` and `blurred` are the episodes' latents (`clip_latents` cuts the history from them).

        * blurred (`sf_blur` of the clips): the frames after the start from `blurred`;
        * one-step (`sf_onestep` of the clips not blurred): every chunk the model's own
          prediction from the ground truth before it (`onestep_history`);
        * slowed (`sf_warp`): the history frames of the last chunk show the motion slowed by r in
          [0, 1) (r = 0: frozen) up to their true last frame, under the same held keys, so the
          keys and not the history's apparent speed must carry the motion;
        * sprite moved (`sf_sprite_jitter`, half the eligible clips): every history frame's
          sprite, the start frame's too, one offset of up to that many px off the game's place,
          so the game's rule and not the history must place the sprite (it drifts otherwise);
          given `centred` (B, 2) bool, only along the axes where the game keeps the player at
          the view's centre (elsewhere the camera is clamped and the history's place is right)."""
        c, b, f = self.cfg, x0.shape[0], x0.shape[2]
        hist = self.clip_latents(lat, cams, e, idx)[1]
        if blurred is not None:
            soft = (torch.rand(b, generator=self.gen) < c.sf_blur) & eligible
            if soft.any():
                sel = soft.numpy()
                hist[soft, :, 1:] = self.clip_latents(blurred, cams, e[sel], idx[sel])[1][:, :, 1:]
        else:
            soft = torch.zeros(b, dtype=torch.bool)
        if c.sf_onestep > 0:
            one = (torch.rand(b, generator=self.gen) < c.sf_onestep) & eligible & ~soft
            if one.any():
                self.dit.eval()
                hist[one] = onestep_history(self.dit, x0[one], a[one], TRAIN_SCHEDULE, self.gen)
                self.dit.train()
        warp = torch.zeros(b, dtype=torch.bool)
        if c.sf_warp > 0:
            warp = (torch.rand(b, generator=self.gen) < c.sf_warp) & eligible
            r = torch.rand(b, generator=self.gen)
            last = f - 1 - self.dit.cfg.chunk_frames  # the last chunk's last history frame
            frames = torch.arange(1, last + 1, dtype=torch.float32)
            src = (last - r[:, None] * (last - frames)).round().long()  # (B, last): frames shown
            if self.ae.cfg.frame_size:
                # Tile-aligned: the slowed frames cut from their own cells and re-anchored as a
                # session would, not moved as latents (the canvas' cells would not match).
                slowed = idx.copy()
                slowed[:, 1 : last + 1] = np.take_along_axis(idx, src.numpy(), axis=1)
                for rows, source in ((warp & soft, blurred), (warp & ~soft, lat)):
                    if rows.any():
                        sel = rows.numpy()
                        cut = self.history_latents(source, cams, e[sel], slowed[sel])
                        hist[rows, :, 1 : last + 1] = cut[:, :, 1 : last + 1]
            else:
                for k in warp.nonzero().flatten().tolist():
                    hist[k, :, 1 : last + 1] = hist[k, :, src[k]]
        if c.sf_sprite_jitter > 0:
            moved = (torch.rand(b, generator=self.gen) < 0.5) & eligible
            j = c.sf_sprite_jitter
            d = torch.randint(-j, j + 1, (b, 2), generator=self.gen) / SPRITE_SCALE  # raw channel units
            if centred is not None:
                d = torch.where(centred, d, 0.0)
            xy = self.ae.cfg.sprite_slice.start + torch.arange(2)
            std = self.ae.latents_std[xy, 0, 0, 0]
            hist[:, xy] += torch.where(moved[:, None], d / std, 0.0)[:, :, None, None, None]
        return hist, warp

    @torch.no_grad()
    def anchored_targets(
        self, hist: torch.Tensor, x0: torch.Tensor, e: np.ndarray, start: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Targets of self-rolled clips `hist` (B, C, F, h, w) re-anchored to where the model's
        own world is (episodes `e`, clips from episode frame `start`): before every chunk the
        game, replayed to the chunk's last history frame, has its player moved by the shift that
        makes its view match the model's latest frame best (`match_shift`, within ANCHOR_MARGIN
        px), then plays the clip's own actions; the chunk's targets are those sharp game frames,
        encoded. They are consistent with the model's history (same place, same terrain) and
        still the game's rules (walls, speed, sharp tiles). A chunk whose latest frame matches no
        view of the map (below ANCHOR_MIN_PSNR), or whose moved player would stand in a wall or
        past a clamped camera, keeps `x0` and gets no loss. Returns (latents (B, C, F, h, w);
        weight (B, 1, F-1, h, w); shift (B, chunks, 2) in frame pixels, NaN where not anchored)."""
        c, chunk, f = self.cfg, self.dit.cfg.chunk_frames, hist.shape[2]
        config = GameConfig(size=SIZE)
        starts = list(range(1, f, chunk))
        self.ae.eval()
        last = torch.stack([self.ae.decode_float(hist[:, :, k - 1 : k])[:, :, 0] for k in starts], 1)
        last = last.clamp(-1.0, 1.0)  # (B, chunks, 3, H, W)
        b = hist.shape[0]
        frames = torch.zeros(b, 3, f - 1, SIZE, SIZE)
        weight = torch.zeros(b, 1, f - 1, *hist.shape[3:])
        shift = torch.full((b, len(starts), 2), float("nan"))
        half = config.player_size / 2.0
        for i in range(b):
            seed = c.world_seed_base + int(e[i])
            policy = random_policy(seed, c.episode_frames)
            game = Game(config)
            game.reset(seed)
            for j, k in enumerate(starts):
                t0 = int(start[i]) + k - 1  # episode frame of the chunk's last history frame
                while game.frame_index < t0:
                    game.step(policy[game.frame_index])
                terrain = torch.from_numpy(game.terrain(ANCHOR_MARGIN)).permute(2, 0, 1).float() / 127.5 - 1.0
                dx, dy, quality = match_shift(last[i, j], terrain, ANCHOR_MARGIN)
                if quality < ANCHOR_MIN_PSNR:
                    continue
                fork = copy.deepcopy(game)
                px, py = fork.player_world_pos
                cam = np.array(fork.camera)
                try:
                    fork.place_player(px - half + dx / config.scale, py - half + dy / config.scale)
                except GameError:
                    continue
                if not np.allclose(np.array(fork.camera) - cam, (dx / config.scale, dy / config.scale)):
                    continue  # the camera is clamped at the world's edge: the view cannot follow
                clip = np.stack([fork.step(policy[t0 + n]) for n in range(chunk)])  # (chunk, H, W, 3)
                frames[i, :, k - 1 : k - 1 + chunk] = torch.from_numpy(clip).permute(3, 0, 1, 2) / 127.5 - 1.0
                weight[i, :, k - 1 : k - 1 + chunk] = 1.0
                shift[i, j] = torch.tensor([float(dx), float(dy)])
        out = x0.clone()
        if weight.any():
            enc = self.ae.encode_float(frames)
            out[:, :, 1:] = torch.where(weight > 0, enc, x0[:, :, 1:])
        return out, weight, shift

    @torch.no_grad()
    def own_targets(
        self, hist: torch.Tensor, cams: torch.Tensor, players: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Own-world targets of self-rolled clips `hist` (B, C, F, h, w) given the game's cameras
        and player positions (B, F, 2): every chunk's frames come from the clip's frame just
        before the chunk (`own_world_targets`), re-encoded. Returns (latents (B, C, F, h, w),
        frame 0 copied from `hist`; loss weight (B, 1, F-1, h, w))."""
        chunk, f = self.dit.cfg.chunk_frames, hist.shape[2]
        patch = SIZE // hist.shape[-1]
        size = GameConfig(size=SIZE)
        self.ae.eval()
        out = hist.clone()
        weight = torch.ones_like(hist[:, :1, 1:])
        for s in range(1, f, chunk):
            last = self.ae.decode_float(hist[:, :, s - 1 : s])[:, :, 0].clamp(-1.0, 1.0)
            frames, valid = own_world_targets(
                last,
                cams[:, s : s + chunk] - cams[:, s - 1 : s],
                players[:, s - 1],
                players[:, s : s + chunk],
                size.player_size * size.scale,
                grid=TileGrid.of(size) if self.cfg.sf_snap else None,
                camera=cams[:, s - 1],
            )
            out[:, :, s : s + chunk] = self.ae.encode_float(frames)
            weight[:, 0, s - 1 : s - 1 + chunk] = valid_latent_mask(valid, patch)
        return out, weight

    def flow_step(
        self,
        x0: torch.Tensor,
        hist: torch.Tensor,
        a: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        f: int,
        peak_lr: float,
        total: int,
        warmup: int,
        weight: torch.Tensor | None = None,
        extra: torch.Tensor | None = None,
        motions: torch.Tensor | None = None,
    ) -> tuple[float, float]:
        """One optimiser step of the teacher-forced flow loss: the noisy chunks are the
        ground truth `x0` (B, C, F, h, w), the clean copies they attend to are `hist` (the
        ground truth itself, or the model's rollout). `weight` (B, 1, F-1, h, w) weights the
        noisy frames' squared errors (normalised by its sum; None: the plain mean). `extra`, a
        loss with its graph (the chain loss), joins the step; `motions` (B, F, 8) are the clip
        frames' `key_motions`, for the motion head. Updates the EMA; returns (flow
        loss, grad norm)."""
        c, dit = self.cfg, self.dit
        sched = TRAIN_SCHEDULE
        chunk = dit.cfg.chunk_frames
        n_chunks = (f - 1) // chunk
        b = x0.shape[0]
        sig_c = torch.rand(b, 1 + n_chunks, generator=self.gen) * c.context_sigma
        sig_n = sample_sigmas(self.gen, (b, n_chunks), sched.sigmas, sched.shift, c.p_schedule_sigma)
        sig_c_f = torch.cat([sig_c[:, :1], sig_c[:, 1:].repeat_interleave(chunk, dim=1)], dim=1)
        sig_n_f = sig_n.repeat_interleave(chunk, dim=1)
        eps_c = torch.randn(x0.shape, generator=self.gen)
        eps_n = torch.randn(x0[:, :, 1:].shape, generator=self.gen)
        carried = self.carried()
        if carried:
            # As served (`World.carry`): each chunk's carried channels start from the latest
            # history frame before it, so the model learns to move the player / the view from there.
            for j in range(n_chunks):
                a0 = j * chunk
                carry(eps_n[:, :, a0 : a0 + chunk], hist[:, :, a0 : a0 + 1], carried)
        xc = add_noise(hist, eps_c, sig_c_f[:, None, :, None, None])
        xn = add_noise(x0[:, :, 1:], eps_n, sig_n_f[:, None, :, None, None])
        seq = torch.cat([xc, xn], dim=2)
        t = torch.cat([sig_c_f, sig_n_f], dim=1) * sched.num_train
        seq_a = torch.cat([a, a[:, 1:]], dim=1)
        text = [dit.text_kv(dit.null_text("cpu", torch.float32))] * b
        heads = self.aux_heads if self.stage in SF_STAGES else None
        last: list[torch.Tensor] = []
        hook = dit.blocks[-1].register_forward_hook(lambda _m, _i, out: last.append(out)) if heads else None
        pred = dit.forward_dense(seq, t, text, mask, seq_a, positions)[:, :, f:]
        if hook is not None:
            hook.remove()
        err = (pred - (eps_n - x0[:, :, 1:])).pow(2)
        phase = self.ae.cfg.phase_slice if self.ae.cfg.frame_size else None
        if phase is not None:
            self.phase_log = {"phase_loss": err[:, phase].mean().item()}
        phase_weight = self.sf_config().sf_phase_weight if self.stage in SF_STAGES else 1.0
        if phase_weight != 1.0:
            scale = torch.ones(err.shape[1])
            scale[phase] = phase_weight
            err = err * scale[:, None, None, None]
        if c.loss_weight == "x0":
            err = err * sig_n_f[:, None, :, None, None].pow(2)
        if weight is None:
            loss = err.mean()
        else:
            weight = weight.expand_as(err)
            loss = (err * weight).sum() / weight.sum().clamp_min(1.0)
        total_loss, fake = (loss if extra is None else loss + extra), None
        if heads is not None and heads.marker is not None:
            # Every token of both copies predicts the marker of its cells in the clean frames.
            clean = torch.cat([hist, x0[:, :, 1:]], dim=2)
            want = heads.marker_targets(sprite_marker(clean, dit.cfg.marker))
            aux = (heads.marker(last[0]) - want).pow(2).mean()
            total_loss = total_loss + c.sf_marker_aux * aux
            self.phase_log["marker_aux"] = aux.item()
        if heads is not None and heads.motion is not None and motions is not None:
            # Every token of the clean copy predicts its frame's motions under each key.
            tokens = last[0][:, : last[0].shape[1] * f // (2 * f - 1)]
            got = heads.motion(tokens).view(b, f, -1, motions.shape[-1])
            aux = (got - motions[:, :, None]).pow(2).mean()
            total_loss = total_loss + c.sf_motion_aux * aux
            self.phase_log["motion_aux"] = aux.item()
        if self.critic is not None and self.stage in SF_STAGES:
            # One frame per noisy chunk: its x0 prediction decoded (through the frozen decoder)
            # and scored by the critic; the hinge generator loss joins the flow loss.
            pick = torch.randint(0, chunk, (b, n_chunks), generator=self.gen) + torch.arange(n_chunks) * chunk
            rows = torch.arange(b)[:, None]
            sig = sig_n_f[rows, pick][:, :, None, None, None]  # (B, chunks, 1, 1, 1)
            x0_hat = (xn[rows, :, pick] - sig * pred[rows, :, pick]).permute(0, 2, 1, 3, 4)
            fake = frames_of(self.ae.decode_float(x0_hat))
            self.critic.requires_grad_(False)
            adv_g = -self.critic(fake).mean()
            self.critic.requires_grad_(True)
            total_loss = total_loss + c.sf_adv * adv_g
        for group in self.dit_opt.param_groups:
            group["lr"] = lr_at(self.step, total, peak_lr, warmup)
        self.dit_opt.zero_grad(set_to_none=True)
        if heads is not None:
            self.aux_opt.zero_grad(set_to_none=True)
        total_loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(dit.parameters(), 1.0)
        self.dit_opt.step()
        if heads is not None:
            self.aux_opt.step()
        if fake is not None:
            with torch.no_grad():
                real = frames_of(self.ae.decode_float(x0[:, :, 1:][rows, :, pick].permute(0, 2, 1, 3, 4)))
            d_real, d_fake = self.critic(real), self.critic(fake.detach())
            adv_d = torch.relu(1.0 - d_real).mean() + torch.relu(1.0 + d_fake).mean()
            self.critic_opt.zero_grad(set_to_none=True)
            adv_d.backward()
            self.critic_opt.step()
            self.adv_log = {"adv_g": adv_g.item(), "adv_d": adv_d.item()}
        with torch.no_grad():
            decay = min(c.ema, (1 + self.step) / (10 + self.step))
            for pe, p in zip(self.ema.parameters(), dit.parameters(), strict=True):
                pe.lerp_(p, 1 - decay)
        return loss.item(), gnorm.item()

    def export(self) -> Path:
        """Write DIR/model (EMA DiT weights + the autoencoder) and DIR/train_summary.json."""
        from models.registry import save_world

        # Served as the last trained phase carries (exported mid-run: as the current one).
        last = self.stage if self.stage in self.cfg.dit_stages() else self.cfg.dit_stages()[-1]
        world = World(
            world_config(),
            self.ema.eval(),
            FastStreamingDecoder(self.ae.eval()),
            start_image=None,
            plugin=served_plugin(self.carried(last), self.gate, self.terrain),
        )
        model_dir = self.out / "model"
        save_world(world, model_dir, start_image={"kind": "game", "size": SIZE})
        summary = {"config": asdict(self.cfg), "train_seconds": round(self.total_elapsed(), 1)}
        (self.out / "train_summary.json").write_text(json.dumps(summary, indent=2))
        return model_dir

    def run(self) -> bool:
        """All remaining stages; True when the model was exported."""
        # Tiny Adam moments turn denormal and slow CPU math ~10x; the flag is process-wide, so
        # it is restored for whoever runs after us (tests share the process).
        torch.set_flush_denormal(True)
        try:
            if self.stage == "ae" and not self.train_ae():
                return False
            if self.stage == "dit" and not self.train_dit():
                return False
            while self.stage in SF_STAGES:
                if not self.train_sf():
                    return False
            if self.stage == "gate":
                self.train_gate()
            if self.stage == "terrain":
                self.train_terrain()
            self.export()
            return True
        finally:
            torch.set_flush_denormal(False)


def parse_bool(text: str) -> bool:
    """A command-line boolean (`bool("false")` would be True)."""
    value = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}.get(text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m models.tiny_world.train", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--out", type=Path, required=True, help="run directory (checkpoint, logs, model/)")
    parser.add_argument("--resume", action="store_true", help="continue from DIR/ckpt.pt")
    parser.add_argument("--seed", type=int, default=0, help="seed of the whole run (default 0)")
    parser.add_argument(
        "--minutes", type=float, default=None, help="stop (with a checkpoint) after this long"
    )
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument(
        "--reuse-ae",
        type=Path,
        default=None,
        help="experiments: start at the DiT stage with the autoencoder and latents of another run directory",
    )
    parser.add_argument(
        "--init-from",
        type=Path,
        default=None,
        help="experiments: start at the sf stage from an exported model directory (e.g. the shipped "
        "weights); sf2 and sf3 follow unless their steps are 0",
    )
    parser.add_argument(
        "--export-only",
        action="store_true",
        help="with --resume: write DIR/model from the checkpoint as it is",
    )
    for f in fields(TrainConfig):
        if f.name != "seed":
            flag = "--" + f.name.replace("_", "-")
            kind = parse_bool if isinstance(f.default, bool) else type(f.default)
            parser.add_argument(flag, type=kind, default=None, help=f"override {f.name} ({f.default})")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    # Tiny Adam moments turn denormal and slow CPU math ~10x (the key gate's 3x slower by its
    # thousandth step). The flag is per thread and torch's workers take it from the thread that
    # starts them, so it is set before any exist; restored for whoever runs after (tests).
    torch.set_flush_denormal(True)
    try:
        return run_cli(parser, args)
    finally:
        torch.set_flush_denormal(False)


def run_cli(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """`main` after the arguments are parsed and the threads set."""
    overrides = {
        f.name: getattr(args, f.name)
        for f in fields(TrainConfig)
        if f.name != "seed" and getattr(args, f.name) is not None
    }
    ckpt = args.out / "ckpt.pt"
    if args.resume:
        if not ckpt.is_file():
            parser.error(f"--resume: no checkpoint at {ckpt}")
        if overrides:
            parser.error("--resume continues the checkpoint's own config; drop the overrides")
        cfg = TrainConfig.from_dict(torch.load(ckpt, weights_only=False)["config"])
    elif ckpt.is_file():
        parser.error(f"{ckpt} exists; pass --resume or use a new --out")
    else:
        cfg = TrainConfig.from_dict({**asdict(TrainConfig()), **overrides, "seed": args.seed})
    if cfg.gate_steps > 0 and not (cfg.ae_tiled and cfg.ae_sprite):
        parser.error(
            "the key gate (--gate-steps) reads the sprite layer: it needs --ae-tiled true --ae-sprite true, "
            "or --gate-steps 0"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    deadline = None if args.minutes is None else time.monotonic() + args.minutes * 60
    trainer = Trainer(cfg, args.out, deadline, progress=not args.no_progress)
    if args.reuse_ae is not None and not args.resume:
        trainer.reuse_ae(args.reuse_ae)
    if args.init_from is not None and not args.resume:
        trainer.init_from(args.init_from)
    if args.resume:
        trainer.resume()
        print(f"resumed at stage {trainer.stage}, step {trainer.step} ({trainer.elapsed:.0f} s trained)")
        if args.export_only:
            print(f"exported {trainer.export()} (stage {trainer.stage}, step {trainer.step})")
            return 0
    (args.out / "config.json").write_text(json.dumps(asdict(cfg), indent=2))
    if trainer.run():
        print(f"done in {trainer.total_elapsed() / 60:.1f} min of training; model at {args.out / 'model'}")
    else:
        print(
            f"time limit: checkpoint at {trainer.ckpt_path} (stage {trainer.stage}, step {trainer.step}); "
            "run again with --resume"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
