"""How many latent frames of Matrix-Game conditioning a session must keep (`COND_FRAMES`).

    python benchmarks/mg_cond_frames.py      # ~1 min on 2 CPU cores; writes results/mg_cond_frames.json

The original VAE-encodes the start frame followed by zero frames over the whole video. The Wan 2.1
encoder (published config, random weights; only its architecture matters here) has a finite
causal receptive field: this encodes two different start frames followed by zeros at a small
spatial size and reports, per latent frame, how much the latents still depend on the start frame
and how much they change from the previous frame. From the first frame where both are ~0 on, every
later latent is the same, so keeping that many frames and repeating the last is exact.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diffusers import AutoencoderKLWan

from models.convert import matrix_game, wan_vae

OUT = Path("benchmarks/results/mg_cond_frames.json")
FRAMES = 36


def main() -> None:
    torch.manual_seed(0)
    vae = AutoencoderKLWan(**wan_vae.diffusers_config()).eval()

    def encode(seed: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        video = torch.zeros(1, 3, 1 + 4 * (FRAMES - 1), 16, 16)
        video[:, :, 0] = torch.rand(3, 16, 16, generator=gen) * 2 - 1
        with torch.no_grad():
            return vae.encode(video).latent_dist.mode()[0]

    a, b = encode(1), encode(2)
    rows = []
    for f in range(FRAMES):
        dep = (a[:, f] - b[:, f]).abs().max().item()
        step = (a[:, f] - a[:, f - 1]).abs().max().item() if f else float("nan")
        rows.append({"frame": f, "depends_on_start": dep, "change_from_previous": step})
        print(f"latent frame {f:2d}: depends on the start frame {dep:.2e}, change {step:.2e}")
    settled = next(r["frame"] for r in rows if r["depends_on_start"] == 0.0)
    print(f"settled from latent frame {settled}; COND_FRAMES = {matrix_game.COND_FRAMES}")
    OUT.write_text(
        json.dumps({"settled_from": settled, "cond_frames": matrix_game.COND_FRAMES, "rows": rows}, indent=2)
        + "\n"
    )


if __name__ == "__main__":
    main()
