"""Image-to-video conditioning of Matrix-Game 2.0 worlds: start frame -> conditioning latents + CLIP tokens.

What the original (SkyworkAI/Matrix-Game, Matrix-Game-2 inference; read, not copied) does with
the start image, and so what we do once per session (at open / reset):

* crop the image to the frame's aspect ratio around its centre, resize it to the frame size
  (352x640 for the published worlds; PIL bilinear), scale to [-1, 1];
* VAE-encode the frame followed by zero frames (``1 + 4 (F - 1)`` video frames for F latent
  frames) into normalised latents, and prepend 4 mask channels (ones on latent frame 0, zeros
  after): the 20 conditioning channels the DiT reads after its 16 noise channels;
* encode the frame with the CLIP ViT-H/14 visual tower (257 tokens of width 1280), which the
  DiT's image embedder projects into its cross-attention context.

The original encodes the whole video length up front; a session here keeps the first
`CausalWanConfig.cond_frames` latent frames and reuses the last for later frames (the encoder
sees only zero frames there; its causal receptive field makes those latents settle).
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from models.matrix_game.clip_vision import CLIPVision
from models.vae import WanStreamingVAE

MASK_CHANNELS = 4


def resize_crop(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """(H, W, 3) uint8 of any size -> (height, width, 3) uint8: centre crop to the target aspect
    ratio, then a bilinear resize (the original's `_resizecrop` + `Resize`)."""
    h, w = image.shape[:2]
    if h / w > height / width:
        new_w, new_h = w, int(w * height / width)
    else:
        new_w, new_h = int(h * width / height), h
    left, top = (w - new_w) / 2, (h - new_h) / 2
    box = tuple(round(v) for v in (left, top, left + new_w, top + new_h))
    pil = Image.fromarray(image).crop(box).resize((width, height), Image.BILINEAR)
    return np.asarray(pil, dtype=np.uint8)


class ImageConditioner:
    """Start frame -> (conditioning latents (4 + C, F, h, w), CLIP tokens (L, dim)) for one session."""

    def __init__(self, vae: WanStreamingVAE, clip: CLIPVision, frames: int) -> None:
        self.vae = vae
        self.clip = clip.eval()
        self.frames = frames  # latent frames of conditioning to encode

    @torch.no_grad()
    def __call__(self, image: np.ndarray, height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`image` (H, W, 3) uint8, any size; returns tensors on the VAE's device."""
        frame = resize_crop(image, height, width)
        p = self.vae.mean
        x = torch.from_numpy(frame.copy()).to(p.device, torch.float32).permute(2, 0, 1) / 127.5 - 1.0
        tokens = self.clip.encode(x[None].to(next(self.clip.parameters()).dtype))[0]
        n_video = 1 + self.vae.layout.frames_per_latent * (self.frames - 1)
        video = torch.zeros(1, 3, n_video, height, width, device=p.device, dtype=p.dtype)
        video[:, :, 0] = x.to(p.dtype)
        z = self.vae.vae.encode(video).latent_dist.mode()
        latents = ((z - self.vae.mean) / self.vae.std)[0]  # (C, F, h, w)
        mask = torch.zeros(MASK_CHANNELS, *latents.shape[1:], device=p.device, dtype=p.dtype)
        mask[:, 0] = 1.0
        return torch.cat([mask, latents], dim=0), tokens
