"""Device memory one Matrix-Game 2.0 session holds at the published sizes (no weights needed).

    python benchmarks/mg_memory.py          # prints a table, writes benchmarks/results/mg_memory.json

* pool row: our `CausalWan` built on the meta device from the published config of each variant
  (`matrix_game.serving_config`), `setup_caches(1, 44, 80)` in bf16, `KVPool.row_nbytes()` —
  every layer's self-attention K/V over the window, the 257 image-token K/V, the action module's
  mouse and keyboard K/V, the conditioning latents and the raw action ring; checked against
  `CausalWanConfig.kv_bytes`.
* decoder cache: the Wan 2.1 VAE decoder (random weights, published config) run causally on CPU
  over a small latent grid; the cached tail frames of its causal convs after 3 latent frames,
  scaled to 44x80 latents by area (every cached map is a spatial map) and to bf16.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diffusers import AutoencoderKLWan

from models.causal_wan import CausalWan
from models.convert import matrix_game, wan_vae
from models.vae import WanStreamingVAE

OUT = Path("benchmarks/results/mg_memory.json")
LATENT_HW = (44, 80)
SMALL_HW = (4, 8)


def pool_row_bytes(variant: str) -> dict:
    inf = matrix_game.INFERENCE[variant]
    cfg = matrix_game.serving_config(matrix_game.PUBLISHED[variant], inf)
    with torch.device("meta"):
        model = CausalWan(cfg).to(torch.bfloat16)
    pool = model.setup_caches(1, *LATENT_HW)
    row = pool.row_nbytes()
    assert row == cfg.kv_bytes(cfg.tokens_per_frame(*LATENT_HW), 2), "kv_bytes disagrees with the pool"
    parts = {
        name: b[:, 0].numel() * 2
        for name, b in zip(pool._names_of_rows(), pool._buffers_of_rows(), strict=True)
    }
    return {"variant": variant, "window_frames": cfg.window_frames, "pool_row_bytes": row, "parts": parts}


def decoder_cache_bytes() -> int:
    torch.manual_seed(0)
    vae = WanStreamingVAE(AutoencoderKLWan(**wan_vae.diffusers_config()))
    cache = vae.init_cache()
    with torch.no_grad():
        for _ in range(3):
            _, cache = vae.decode_float(torch.randn(16, 1, *SMALL_HW), cache)
    fp32 = sum(t.numel() * t.element_size() for t in _tensors(cache.feats))
    scale = (LATENT_HW[0] * LATENT_HW[1]) / (SMALL_HW[0] * SMALL_HW[1])
    return int(fp32 * scale / 2)  # bf16


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)


def main() -> None:
    dec = decoder_cache_bytes()
    rows = [pool_row_bytes(v) for v in ("universal", "gta_drive", "templerun")]
    for r in rows:
        r["decoder_cache_bytes"] = dec
        r["total_bytes"] = r["pool_row_bytes"] + dec
        print(
            f"{r['variant']:10s} window {r['window_frames']}: pool row {r['pool_row_bytes'] / 2**30:.3f} GiB"
            f" + decoder cache {dec / 2**30:.3f} GiB = {r['total_bytes'] / 2**30:.3f} GiB per session (bf16)"
        )
    OUT.write_text(json.dumps({"dtype": "bfloat16", "latent_hw": LATENT_HW, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
