"""The data stage: the episodes (`models.tiny_world.data`) encoded once into latents, with their
actions, cameras and sprites, and the clips and histories the DiT stages cut from them."""

from __future__ import annotations

import json
from collections.abc import Iterator

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from models.tiny_world import SIZE
from models.tiny_world.data import FOCUS_POLICY, Episodes, make_episodes
from models.tiny_world.training.history import gaussian_blur
from models.tiny_world.training.targets import anchored_clips, chunk_anchors, on_anchors


class LatentData:
    """The trainer's data stage (a part of `Trainer`)."""

    def data(self) -> Episodes:
        if self.episodes is None:
            c = self.cfg
            seeds = list(range(c.world_seed_base, c.world_seed_base + c.episodes))
            self.episodes = make_episodes(
                seeds, c.episode_frames, SIZE, progress=self.progress, layers=c.ae_sprite or c.ae_creatures
            )
        return self.episodes

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
        layers = c.ae_sprite or c.ae_creatures
        eps = make_episodes(
            seeds, c.episode_frames, SIZE, progress=self.progress, policy=FOCUS_POLICY, layers=layers
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
        for frames, cams, sprites, creatures in self.each_episode(eps, "encode blurred"):
            frames = frames.permute(0, 3, 1, 2)  # (N+1, 3, H, W)
            n = frames.shape[0]
            soft = gaussian_blur(frames, 0.5 + torch.rand(n, generator=gen) * (c.sf_blur_max - 0.5))
            if c.sf_jitter > 0:
                gain = 1.0 + c.sf_jitter * torch.randn(n, 3, 1, 1, generator=gen)
                soft = (soft * gain + c.sf_jitter * torch.randn(n, 3, 1, 1, generator=gen)).clamp(-1.0, 1.0)
            out.append(self.encode_frames(soft.permute(0, 2, 3, 1), cams, sprites, creatures))
        return torch.stack(out)

    def each_episode(
        self, eps: Episodes, desc: str
    ) -> Iterator[tuple[torch.Tensor, np.ndarray, torch.Tensor | None, torch.Tensor | None]]:
        """Every episode's frames (N+1, H, W, 3) in [-1, 1], cameras (N+1, 2), sprites
        (`frame_sprites`) and creatures (`frame_creatures`), with a progress bar."""
        rings = eps.rings if eps.rings is not None else [None] * len(eps)
        corners = eps.creatures if eps.creatures is not None else [None] * len(eps)
        for ep, cams, players, ring, corner in tqdm(
            zip(eps.frames, eps.cameras, eps.players, rings, corners, strict=True),
            desc=desc,
            unit="ep",
            total=len(eps),
            disable=not self.progress,
        ):
            frames = torch.from_numpy(ep).float() / 127.5 - 1.0
            yield frames, cams, self.frame_sprites(players, ring), self.frame_creatures(corner)

    @torch.no_grad()
    def encode_frames(
        self,
        frames: torch.Tensor,
        cameras: np.ndarray,
        sprites: torch.Tensor | None = None,
        creatures: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One episode's frames (N+1, H, W, 3) in [-1, 1], cameras (N+1, 2), sprites and
        creatures (None: read off the frames) -> normalised latents (N+1, C, h, w) float16;
        tile-aligned latents: the cells around each frame's own anchor (`encode_wide`, its offset
        from the camera) that `clip_latents` cuts clips from."""
        off = self.frame_offsets(cameras)
        if off is not None:
            return self.ae.encode_wide(frames.permute(0, 3, 1, 2), off, sprites, creatures).half()
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
