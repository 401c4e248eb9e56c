"""Train the tiny world from scratch on the built-in game: autoencoder, then the causal DiT.

    python -m models.tiny_world.train --out DIR [--resume] [--seed N] [--minutes M]

Stages (one checkpoint file, DIR/ckpt.pt, records the stage and step; --resume continues)::

    data     simulate `episodes` worlds x `episode_frames` frames of random_policy (seeded, not saved)
    ae       the fast autoencoder on single frames: L1 + MSE, with noise on the latents so the
             decoder tolerates the DiT's small errors; then per-channel latent statistics. With
             `ae_sprite` (tile-aligned only) the cells learn the frame without the player (the
             simulator's layers) and the sprite layer draws the player and its ring over them,
             their place in the latents taken from the game. With `ae_creatures` the cells
             learn the terrain alone and a creature layer draws the creatures over them (where
             each square starts, from the game; a small net learns to read it off a frame)
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
             steps a wall blocks it (`release_blocked`), as the motion head serves the DiT.
    motion   the motion head (`motion_steps` > 0; models/tiny_world/motion_head.py,
             models/tiny_world/motion.py): from a latent frame and a chunk's keys, how the view
             and the player move in each frame and which held keys do nothing; on every episode
             chunk in the served history's form, labelled by what the episodes did.
    terrain  the terrain prior (`terrain_steps` > 0, with a motion head: the atlas;
             models/terrain_prior.py, models/tiny_world/terrain.py): a classifier from a tile's
             neighbourhood as a session knows it to the tile, on the training worlds' maps; the
             atlas draws every tile that comes into view for the first time from it.
    creatures the creature head (`creature_steps` > 0, with a creature layer and a terrain prior;
             models/tiny_world/creature_head.py, models/tiny_world/creatures.py): from the latest
             frames' creature layers and terrain, each creature's move into every frame of a
             chunk, labelled by where the episodes' creatures went; and how often a creature is
             met in a new tile of each class, counted on the training frames.
    export   DIR/model: a model directory (worldserve.json + transformer/ + vae/ [+ motion/]
             [+ terrain/] [+ creatures/]) for load_world

This module is the command line; each stage's code is a module of `models.tiny_world.training`:
`config` (TrainConfig, the recipe), `latents` (data), `autoencoder`, `dit`, `self_forcing` (with
`clips`, `targets`, `history` and `heads`), `motion`, `prior` (terrain), `creatures`, and
`trainer`, which runs them in order, checkpoints and exports.

References (read, not copied): CausVid and Self-Forcing (teacher forcing over a block-causal
mask, few-step flow sampling), Diffusion Forcing (independent per-chunk noise), rectified flow
(`x_t = (1 - s) x0 + s noise`, target noise - x0).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, fields
from pathlib import Path

import torch

from models.tiny_world.training.config import TrainConfig
from models.tiny_world.training.trainer import Trainer


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
        help="start at the sf stage from an exported model directory (e.g. the shipped weights); sf2 "
        "and sf3 follow unless their steps are 0. With --ae-creatures true and a directory without a "
        "creature layer: first tune the layer in (the ae stage, ae_steps; the DiT and motion head widened)",
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
    # Tiny Adam moments turn denormal and slow CPU math ~10x (a small head's 3x slower by its
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
    if cfg.motion_steps > 0 and not (cfg.ae_tiled and cfg.ae_sprite):
        parser.error(
            "the motion head (--motion-steps) reads the sprite layer: it needs --ae-tiled true "
            "--ae-sprite true, or --motion-steps 0"
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
