"""The self-forced DiT stages (`sf`, `sf2`, `sf3`): the EMA of the stage before, trained on
degraded and self-rolled histories (train.py's docstring lists the options)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import torch
from tqdm import tqdm

from models.causal_wan import CausalWan
from models.game import Game, GameConfig, GameError, random_policy
from models.tiny_world import SIZE, TRAIN_SCHEDULE, carried_channels, dit_config
from models.tiny_world.fast_decoder import SPRITE_SCALE
from models.tiny_world.metrics import off_centre
from models.tiny_world.training.clips import (
    blocked_starts,
    idle_clips,
    key_motions,
    off_centre_starts,
    release_blocked,
    stop_chunks,
    stop_onsets,
)
from models.tiny_world.training.config import SF_STAGES, TrainConfig
from models.tiny_world.training.dit import deepen, regrid, teacher_forcing_layout
from models.tiny_world.training.heads import AuxHeads, FrameCritic
from models.tiny_world.training.history import chain_history, onestep_history, rollout_history
from models.tiny_world.training.targets import (
    ANCHOR_MARGIN,
    ANCHOR_MIN_PSNR,
    TileGrid,
    match_shift,
    own_world_targets,
    seen_latent_mask,
    valid_latent_mask,
)


class SelfForcingStage:
    """The trainer's self-forced stages (a part of `Trainer`)."""

    def begin_sf(self) -> None:
        """Enter a self-forced phase (`sf`, then `sf2`, `sf3`): train on from the EMA weights with a fresh
        optimiser and the stage's own RNGs (so a phase does not depend on how the one before it
        was reached: `--init-from` a model with the `sf2` settings as the sf stage's computes
        the same phase)."""
        c = self.cfg
        self.step = 0
        if self.stage == "sf" and (ema := self.sf_arch(self.ema)) is not None:
            self.ema = ema.requires_grad_(False)
            self.dit = CausalWan(self.ema.cfg, self.ema.input_features)
        self.mark()
        self.dit.load_state_dict(self.ema.state_dict())
        self.dit_opt = torch.optim.AdamW(
            self.dit.parameters(), lr=c.sf_lr, betas=(0.9, 0.99), weight_decay=0.01
        )
        self.rng = np.random.default_rng([c.seed, 2])
        self.gen = torch.Generator().manual_seed(c.seed + 2_000_003)
        if c.sf_adv > 0:
            self.new_critic()
        marker = c.sf_marker_aux > 0 and self.dit.cfg.input_features is not None
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
        return carried_channels(c.sf_place_start, c.sf_view_start, c.sf_creature_start)

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
