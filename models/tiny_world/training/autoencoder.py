"""The autoencoder stage: the fast autoencoder on single frames, then its latent statistics and
(tile-aligned latents) its codebook."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from models.game import GameConfig
from models.tiny_world import SIZE
from models.tiny_world.fast_decoder import corner_cells, place
from models.tiny_world.training.codebook import fit_codebook, flat_colours
from models.tiny_world.training.config import lr_at


class AutoencoderStage:
    """The trainer's `ae` stage (a part of `Trainer`)."""

    def train_ae(self) -> bool:
        """Returns False when the time limit stopped it."""
        c, ae, eps = self.cfg, self.ae, self.data()
        frames = eps.frames.reshape(-1, SIZE, SIZE, 3)  # (E*(N+1), H, W, 3)
        offsets = self.frame_offsets(eps.cameras)  # (E*(N+1), 2) or None
        sprites = self.frame_sprites(eps.players, eps.rings)  # (E*(N+1), 3) or None
        backdrops = None if sprites is None else eps.backdrops.reshape(-1, SIZE, SIZE, 3)
        creatures = self.frame_creatures(eps.creatures)  # (E*(N+1), K, 2) or None
        terrains = None if creatures is None else eps.terrains.reshape(-1, SIZE, SIZE, 3)
        cells = ae.cfg.cell_channels
        ae.train()
        bar = tqdm(total=c.ae_steps, initial=self.step, desc="autoencoder", disable=not self.progress)
        while self.step < c.ae_steps:
            idx = self.rng.integers(0, frames.shape[0], size=c.ae_batch)
            x = torch.from_numpy(frames[idx]).float().div(127.5).sub(1.0)  # (B, H, W, 3)
            x = x.permute(0, 3, 1, 2)[:, :, None]  # (B, 3, 1, H, W)
            off = None if offsets is None else offsets[idx][:, None]  # (B, 1, 2)
            spr = None if sprites is None else sprites[idx][:, None]  # (B, 1, 3)
            crs = None if creatures is None else creatures[idx][:, None]  # (B, 1, K, 2)
            z = ae.encode_raw(x, off, spr, crs)
            rel = torch.rand(z.shape[0], 1, 1, 1, 1, generator=self.gen) * c.ae_latent_noise
            noise = torch.randn(z.shape, generator=self.gen)
            noise[:, cells:] = 0.0  # phase, sprite and creature channels stay exact: they place what is drawn
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
            if crs is not None:
                # The cells draw the terrain alone; the creature layer draws the creatures over it.
                terrain = ae.decode_layers(zn[:, :, 0], creatures=False)[0]
                target = torch.from_numpy(terrains[idx]).float().div(127.5).sub(1.0).permute(0, 3, 1, 2)
                loss = loss + (terrain - target).abs().mean() + (terrain - target).pow(2).mean()
                ce, acc = self.creature_read_loss(x[:, :, 0], off[:, 0], crs[:, 0])
                loss = loss + ce
                extra["creature_acc"] = acc
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
        if self.tune_creatures:
            # Statistics and codebook stay: the DiT, the motion head and the prior read them.
            self.stage = "sf"
            self.begin_sf()
        else:
            self.set_latent_stats(frames, offsets, sprites)
            self.fit_codebook(frames, offsets)
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

    def frame_creatures(self, corners: np.ndarray | None) -> torch.Tensor | None:
        """With a creature layer: every frame's creatures' drawn top-left pixels (N, K, 2) long
        (corners (..., K, 2)); None without a creature layer or without recorded corners."""
        if not self.ae.cfg.creatures or corners is None:
            return None
        return torch.from_numpy(corners.astype(np.int64)).reshape(-1, *corners.shape[-2:])

    def creature_read_loss(
        self, frames: torch.Tensor, offsets: torch.Tensor, corners: torch.Tensor
    ) -> tuple[torch.Tensor, float]:
        """The `CreatureNet`'s loss on frames (B, 3, H, W) at sub-tile offsets (B, 2) whose
        creatures start at `corners` (B, K, 2): per cell, a cross-entropy over "none" and its
        pixels, against the creatures that show in the frame (one off the view cannot be read);
        and the share of cells read right."""
        cfg = self.ae.cfg
        s, g = cfg.spatial, cfg.canvas_cells
        game = GameConfig(size=SIZE)  # the labels come from the game
        side = game.creature_size * game.scale
        shows = ((corners > -side) & (corners < SIZE)).all(dim=-1, keepdim=True)
        far = torch.full_like(corners, -10 * g * s)  # off any canvas: left out
        present, where = corner_cells(torch.where(shows, corners, far), offsets + 2 * s, g, s)
        logits = self.ae.creature_net(place(frames, offsets + 2 * s, g * s))  # (B, g, g, s*s)
        logits = torch.cat([logits.new_zeros(*logits.shape[:-1], 1), logits], dim=-1)
        target = torch.where(present, 1 + where[:, 1] * s + where[:, 0], 0)
        ce = nn.functional.cross_entropy(logits.flatten(0, 2), target.flatten())
        return ce, (logits.argmax(-1) == target).float().mean().item()

    def fit_codebook(self, frames: np.ndarray, offsets: torch.Tensor | None, n: int = 4096) -> None:
        """Tile-aligned latents: fit the autoencoder's codebook (`FastAEConfig.codebook`) on the
        flat cells of `n` frames (fixed sample), `codebook_size` entries; nothing for plain ones."""
        if offsets is None or not self.ae.cfg.frame_size:
            return
        n = min(n, frames.shape[0])
        idx = np.random.default_rng(self.cfg.seed + 2).integers(0, frames.shape[0], size=n)
        colours = flat_colours(self.ae, frames[idx], offsets[idx].numpy())
        if not len(colours):
            raise SystemExit(f"the autoencoder calls no cell of {n} training frames flat: no codebook to fit")
        self.ae.cfg.codebook = fit_codebook(colours, self.cfg.codebook_size, self.cfg.seed)
        self.log({"codebook": self.ae.cfg.codebook, "flat_cells": len(colours)})

    @torch.no_grad()
    def set_latent_stats(
        self,
        frames: np.ndarray,
        offsets: torch.Tensor | None = None,
        sprites: torch.Tensor | None = None,
        n: int = 4096,
    ) -> None:
        """Per-channel mean/std of the raw latents of `n` frames (fixed sample); the sprite and
        creature channels keep their raw scale (mean 0, std 1), whose units the decoder rounds to."""
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
        for layer in (self.ae.cfg.sprite_slice, self.ae.cfg.creature_slice):
            mean[layer], std[layer] = 0.0, 1.0
        self.ae.set_normalisation(mean, std)
