"""A training run's settings (`TrainConfig`, the shipped recipe's defaults) and its stages."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

STAGES = ("ae", "dit", "sf", "sf2", "sf3", "motion", "terrain", "creatures", "done")


SF_STAGES = ("sf", "sf2", "sf3")


# Settings whose default changed the recipe when they were added: their value before, so a run
# checkpointed before them resumes (and exports) as it was started.
ABSENT = {
    "sf2_steps": 0,
    "sf3_steps": 0,
    "sf3_release_blocked": False,
    "motion_steps": 0,
    "terrain_steps": 0,
    "ae_creatures": False,
    "sf_creature_start": False,
    "creature_weight": 1.0,
    "creature_steps": 0,
}


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
    # with ae_tiled: the wandering creatures drawn from a per-cell layer (where a square starts),
    # not by the cells (`FastAEConfig.creatures`); the cells are trained on the terrain alone
    ae_creatures: bool = True
    # with ae_tiled: entries of the codebook fit on the training frames' flat cells once the
    # autoencoder is trained (`models.tiny_world.training.codebook`): a hyper-parameter (the game
    # draws its terrain in 8 shades, which the fit recovers), not a constant read from the game
    codebook_size: int = 8
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
    # Likewise the creature layer's channels (with ae_creatures): a chunk's creatures start from
    # where the latest frame has them, so the model moves them on rather than drawing them anew.
    sf_creature_start: bool = True
    # Weight of the creature layer's channels in every DiT stage's flow loss: a creature is a few
    # of a frame's 144 cells, and a cell that loses it loses the whole creature.
    creature_weight: float = 4.0
    # A second self-forced phase, `sf2` (0 steps: none): from the sf stage's EMA, `sf2_steps` more
    # steps with the sf stage's settings, except the view carried and the jitter centred as below
    # (model card, AP-AR: carried from the dit stage's EMA instead, AQ, the view costs the scroll).
    sf2_steps: int = 500
    sf2_view_start: bool = True  # its sf_view_start
    sf2_jitter_centred: bool = True  # its sf_jitter_centred
    # A third self-forced phase, `sf3` (0 steps: none): from the sf2 phase's EMA, `sf3_steps` more
    # steps with sf2's settings, except the view's phase channels weighted in the flow loss, so
    # the view follows a held key at the game's speed (model card, AX; AU: weight 4), and the keys
    # as the motion head (before it, the key gate) serves them (BG).
    sf3_steps: int = 250
    sf3_phase_weight: float = 2.0  # its sf_phase_weight
    sf3_release_blocked: bool = True  # its sf_release_blocked (the motion head serves the DiT so; BG)
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
    # (`release_blocked`, the game's rule on its map: training data), as the motion head serves the DiT
    # the keys it finds without effect: a held key then always moves the player, a blocked one is idle.
    sf_release_blocked: bool = False
    # The motion head (`models.tiny_world.motion_head`; models/tiny_world/motion.py), trained after the
    # DiT stages on the same episodes' latents, labelled by what the episodes did (0 steps: none).
    motion_steps: int = 8000
    # The terrain prior (`models.tiny_world.terrain_prior`; models/tiny_world/terrain.py), trained last on the
    # training worlds' maps alone (0 steps, or no atlas: none; the DiT invents new terrain).
    terrain_steps: int = 3000
    # The creature head (`models.tiny_world.creature_head`; models/tiny_world/creatures.py), trained
    # last on the episodes' latents and creature tracks (0 steps, no creature layer or no terrain
    # prior: none; the DiT moves the creatures).
    creature_steps: int = 4000
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


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay from `peak` to 5% of it."""
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
