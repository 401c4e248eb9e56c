"""The trainer: runs the stages in order, checkpoints and resumes, exports the model directory."""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from models.causal_wan import CausalWan, CausalWanConfig
from models.tiny_world import SIZE, ae_config, dit_config, marker_config, world_config
from models.tiny_world.creature_head import CreatureHead
from models.tiny_world.data import Episodes
from models.tiny_world.fast_decoder import FastAEConfig, FastAutoencoder, FastStreamingDecoder
from models.tiny_world.marker import dit_features, dit_marker
from models.tiny_world.motion_head import MotionHead
from models.tiny_world.plugin import served_plugin
from models.tiny_world.terrain_prior import TerrainPrior
from models.tiny_world.training.autoencoder import AutoencoderStage
from models.tiny_world.training.config import SF_STAGES, STAGES, TrainConfig
from models.tiny_world.training.creatures import CreatureStage, creature_config
from models.tiny_world.training.dit import DiTStage, widen, with_marker
from models.tiny_world.training.heads import AuxHeads, FrameCritic
from models.tiny_world.training.latents import LatentData
from models.tiny_world.training.motion import MotionStage, motion_config, widen_head
from models.tiny_world.training.prior import PriorStage, terrain_config
from models.tiny_world.training.self_forcing import SelfForcingStage
from models.world import World


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


class Trainer(
    LatentData, AutoencoderStage, DiTStage, SelfForcingStage, MotionStage, PriorStage, CreatureStage
):
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
        if (cfg.ae_sprite or cfg.ae_creatures) and not cfg.ae_tiled:
            raise SystemExit("--ae-sprite and --ae-creatures need --ae-tiled true")
        if cfg.sf_creature_start and not cfg.ae_creatures:
            raise SystemExit("--sf-creature-start needs a creature layer (--ae-creatures true)")
        if cfg.creature_weight <= 0:
            raise SystemExit("--creature-weight: a loss weight > 0")
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
        self.ae = FastAutoencoder(ae_config(cfg.ae_tiled, cfg.ae_sprite, cfg.ae_creatures))
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
        self.motion: MotionHead | None = None  # the `motion` stage's motion head, once trained
        self.terrain: TerrainPrior | None = None  # the `terrain` stage's prior, once trained
        self.creatures: CreatureHead | None = None  # the `creatures` stage's head, once trained
        # True: the `ae` stage adds a creature layer to a trained model (`add_creatures`).
        self.tune_creatures = False

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
                "tune_creatures": self.tune_creatures,
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
                **({"motion": self.motion.state_dict()} if self.motion is not None else {}),
                **({"terrain": self.terrain.state_dict()} if self.terrain is not None else {}),
                **({"creatures": self.creatures.state_dict()} if self.creatures is not None else {}),
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
        self.ae.cfg.codebook = FastAEConfig.from_dict(state["ae_cfg"]).codebook
        self.tune_creatures = state.get("tune_creatures", False)
        if self.tune_creatures:
            self.freeze_for_creatures()
        self.ae_opt.load_state_dict(state["ae_opt"])
        ema = self.ema
        if "dit_cfg" in state:
            if (cfg := CausalWanConfig.from_dict(state["dit_cfg"])) != ema.cfg:
                ema = CausalWan(cfg, dit_features(cfg))
        elif self.stage in (*SF_STAGES, "done"):  # a checkpoint from before the shape was recorded
            ema = self.sf_arch(ema) or ema
        if ema is not self.ema:
            # The checkpoint holds the reshaped modules: build their shapes before loading.
            self.ema = ema.requires_grad_(False)
            self.dit = CausalWan(self.ema.cfg, self.ema.input_features)
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
        if "motion" in state:
            self.motion = MotionHead(motion_config(self.ae))
            self.motion.load_state_dict(state["motion"])
        if "terrain" in state:
            self.terrain = TerrainPrior(terrain_config(self.ae.cfg.codebook))
            self.terrain.load_state_dict(state["terrain"])
        if "creatures" in state:
            self.creatures = CreatureHead(creature_config(self.ae))
            self.creatures.load_state_dict(state["creatures"])
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
        self.ae.cfg.codebook = FastAEConfig.from_dict(state["ae_cfg"]).codebook
        if (run / "latents.safetensors").is_file():
            shutil.copyfile(run / "latents.safetensors", self.out / "latents.safetensors")
        self.stage, self.step = "dit", 0
        self.log({"reused_ae_from": str(run)})

    def init_from(self, model_dir: Path) -> None:
        """Take the autoencoder and the DiT of an exported model directory (e.g. the shipped
        weights) and start at the `sf` stage. A run with a creature layer (`ae_creatures`) from
        a directory without one starts with `add_creatures` instead."""
        from models.registry import load_world

        world = load_world(model_dir)
        if world.decoder.ae.cfg.frame_size != self.ae.cfg.frame_size:
            raise SystemExit(
                f"{model_dir}: its latents are {'' if world.decoder.ae.cfg.frame_size else 'not '}"
                f"tile-aligned; pass --ae-tiled {str(not self.cfg.ae_tiled).lower()}"
            )
        if world.decoder.ae.cfg.creatures != self.ae.cfg.creatures:
            if not self.ae.cfg.creatures:
                raise SystemExit(
                    f"{model_dir}: its autoencoder has a creature layer; pass --ae-creatures true"
                )
            self.add_creatures(world)
            self.log({"init_from": str(model_dir), "add_creatures": True})
            return
        self.ae.load_state_dict(world.decoder.ae.state_dict())
        ae_cfg = world.decoder.ae.cfg
        self.ae.set_normalisation(torch.tensor(ae_cfg.latents_mean), torch.tensor(ae_cfg.latents_std))
        self.ae.cfg.codebook = ae_cfg.codebook
        if (marker := dit_marker(world.transformer.cfg)) is not None:
            self.ema = with_marker(self.ema, marker).requires_grad_(False)
        self.ema.load_state_dict(world.transformer.state_dict())
        self.stage = "sf"
        self.begin_sf()
        self.log({"init_from": str(model_dir)})

    def add_creatures(self, world: World) -> None:
        """Start from `world` (a model without a creature layer) at the `ae` stage, tuning only
        the layer in: the autoencoder keeps its weights, statistics and codebook, its cell
        decoder, phase and sprite parts frozen (so its latents mean what the DiT learned they
        mean), while the cell encoder learns to leave the creatures to the new layer; then the
        `sf` stage. The DiT and the motion head are widened to the new channels (`widen`,
        `widen_head`: exactly the old models until trained), the terrain prior kept."""
        if self.cfg.sf_steps <= 0:
            raise SystemExit(
                "adding a creature layer to a model trains its DiT in the sf stage: --sf-steps must be > 0"
            )
        src = world.decoder.ae
        state = {k: v for k, v in src.state_dict().items() if not k.startswith("latents_")}
        missing = self.ae.load_state_dict(state, strict=False).missing_keys
        if any(not k.startswith(("latents_", "creature_")) for k in missing):
            raise SystemExit(f"the autoencoder to add creatures to lacks {missing}")
        n = self.ae.cfg.creature_channels
        self.ae.set_normalisation(
            torch.cat([torch.tensor(src.cfg.latents_mean), torch.zeros(n)]),
            torch.cat([torch.tensor(src.cfg.latents_std), torch.ones(n)]),
        )
        self.ae.cfg.codebook = src.cfg.codebook
        channels = self.ae.cfg.latent_channels
        self.ema = widen(world.transformer, channels).requires_grad_(False)
        self.dit = CausalWan(self.ema.cfg, self.ema.input_features)  # `begin_sf` loads the EMA into it
        plugin = world.plugin
        if getattr(plugin, "motion", None) is not None:
            self.motion = widen_head(plugin.motion, channels)
        self.terrain = getattr(plugin, "terrain", None)
        self.tune_creatures = True
        self.freeze_for_creatures()
        self.stage, self.step = "ae", 0

    def freeze_for_creatures(self) -> None:
        """`add_creatures`' autoencoder: all but the cell encoder and the creature layer frozen,
        and a fresh optimiser over the rest."""
        ae = self.ae
        for part in (ae.decoder, ae.phase, ae.sprite_net, ae.sprite_decoder):
            if part is not None:
                part.requires_grad_(False)
        trainable = [p for p in ae.parameters() if p.requires_grad]
        self.ae_opt = torch.optim.AdamW(trainable, lr=self.cfg.ae_lr, betas=(0.9, 0.99), weight_decay=0.0)

    def mark(self) -> None:
        """Give the DiT (and its EMA) the sprite marker (`with_marker`) if the current stage reads
        it and they do not yet (a fresh optimiser follows in every stage that can start here)."""
        m = self.cfg.marker
        if not m or STAGES.index(self.stage) < STAGES.index(m) or self.ema.cfg.input_features is not None:
            return
        marker = marker_config(self.ae.cfg)
        self.ema = with_marker(self.ema, marker).requires_grad_(False)
        self.dit = with_marker(self.dit, marker)
        self.dit_opt = torch.optim.AdamW(self.dit.parameters(), betas=(0.9, 0.99), weight_decay=0.01)

    def out_of_time(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline

    def step_done(self, bar: tqdm) -> bool:
        """After an optimiser step: checkpoint on schedule; False (checkpointed) when out of time."""
        if self.step % self.cfg.ckpt_every == 0:
            self.checkpoint()
        if self.out_of_time():
            bar.close()
            self.checkpoint()
            return False
        return True

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
            plugin=served_plugin(self.carried(last), self.motion, self.terrain, self.creatures),
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
            if self.stage == "motion":
                self.train_motion()
            if self.stage == "terrain":
                self.train_terrain()
            if self.stage == "creatures":
                self.train_creatures()
            self.export()
            return True
        finally:
            torch.set_flush_denormal(False)
