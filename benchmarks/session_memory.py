"""Device memory one Self-Forcing session holds at full size, without weights or a GPU.

    python benchmarks/session_memory.py [--out benchmarks/results/session_memory.json]

Builds the full-size models on the meta device (shapes only, no memory, no weights): the causal
Wan of a converted Self-Forcing 1.3B (`models.convert.self_forcing.model_config`) and its K/V
pool, and the Wan 2.1 VAE's streaming decoder, which is run on meta latents so its cache holds the
real shapes. Reports, in bf16 at 480x832 (60x104 latents, 1560 tokens per frame, 512 text
tokens): the pool row one session owns (allocated buffers vs `CausalWanConfig.kv_bytes`) for the
published window and a rolling window with a sink, and the decoder cache after 1, 2 and 3 chunks.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from diffusers import AutoencoderKLWan

from models.causal_wan import CausalWan
from models.convert import self_forcing, wan_vae
from models.vae import DecoderCache, WanStreamingVAE

H, W = 60, 104  # latents of 480x832
DTYPE = torch.bfloat16
WINDOWS = {
    "published (local_attn_size -1)": {},
    "local_attn_size 12, sink_size 3": {"local_attn_size": 12, "sink_size": 3},
}


def kv_rows() -> list[dict]:
    """One pool row per window setting: allocated bytes (meta buffers) and the formula."""
    rows = []
    for name, original in WINDOWS.items():
        cfg = self_forcing.model_config(original)
        with torch.device("meta"):
            model = CausalWan(cfg).to(DTYPE)
        pool = model.setup_caches(1, H, W, dtype=DTYPE, device="meta")
        tpf = model.tokens_per_frame(H, W)
        rows.append(
            {
                "window": name,
                "window_frames": cfg.window_frames,
                "sink_frames": cfg.sink_frames,
                "text_tokens": cfg.text_tokens,
                "pool_row_bytes": pool.row_nbytes(),
                "formula_bytes": cfg.kv_bytes(tpf, torch.empty(0, dtype=DTYPE).element_size()),
            }
        )
    return rows


def _cache_bytes(cache: DecoderCache) -> int:
    return sum(f.numel() * f.element_size() for f in cache.feats if isinstance(f, torch.Tensor))


def decoder_cache(chunks: int = 3, chunk_frames: int = 3) -> list[dict]:
    """The Wan 2.1 VAE's streaming-decoder cache after each chunk (meta tensors: shapes only)."""
    with torch.device("meta"):
        vae = AutoencoderKLWan(**wan_vae.diffusers_config()).to(DTYPE)
    dec = WanStreamingVAE(vae)
    cache = dec.init_cache()
    rows = []
    for c in range(chunks):
        z = torch.empty(16, chunk_frames, H, W, device="meta", dtype=DTYPE)
        video, cache = dec.decode_float(z, cache)
        rows.append({"chunk": c + 1, "video_frames": video.shape[1], "cache_bytes": _cache_bytes(cache)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/session_memory.json"))
    args = parser.parse_args()
    result = {
        "model": "Self-Forcing 1.3B (converted), Wan 2.1 VAE decoder",
        "dtype": "bfloat16",
        "latents": [H, W],
        "kv": kv_rows(),
        "decoder_cache": decoder_cache(),
        "method": "meta-device shapes (no weights, no GPU)",
    }
    text = json.dumps(result, indent=2)
    print(text)
    args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
