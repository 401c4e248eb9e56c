"""Streaming decode cost per latent frame: the Wan 2.1 VAE vs TAEHV (taew2_1 shape), random weights.

    python benchmarks/decoders.py [--sizes 64x64,128x128] [--chunk 2] [--batch 4] [--threads 1]

For each frame size and decoder: a stream is started with one latent frame (not timed: a Wan
stream's first frames take other cache paths), then one chunk of `--chunk` latent frames is
decoded from that cache, `--repeats` times; the best time is reported as ms per latent frame.
At the first size only, `--batch` started sessions decode one chunk each: looped one session at a
time vs one `models.vae.decode_batch` call (ms per latent frame per session). Both decoders use
their published shapes (diffusers' `AutoencoderKLWan()` defaults are Wan 2.1's VAE;
`TAEHVConfig()` is taew2_1) with random weights: the cost does not depend on the values.

CPU only here: these numbers say how the two compare on this machine, not what a GPU does.
Writes --out (default benchmarks/results/decoders.json).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diffusers import AutoencoderKLWan

from models.taehv import TAEHV, TAEHVConfig, TAEHVDecoder
from models.vae import DecoderCache, StreamingDecoder, WanStreamingVAE, decode_batch


def started(dec: StreamingDecoder, h: int, w: int, seed: int) -> DecoderCache:
    """A stream's cache after its first latent frame."""
    gen = torch.Generator().manual_seed(seed)
    return dec.decode(torch.randn(16, 1, h, w, generator=gen), dec.init_cache())[1]


def best_ms(fn, repeats: int) -> float:
    """Best wall time of `fn()` over `repeats` runs, in ms."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, (time.perf_counter() - t0) * 1000)
    return best


def measure(dec: StreamingDecoder, h: int, w: int, chunk: int, batch: int, repeats: int) -> dict:
    """ms per latent frame of one started stream; with batch > 1, looped vs batched sessions too."""
    cache = started(dec, h, w, 0)
    z = torch.randn(16, chunk, h, w)
    row = {"ms_per_latent_frame": round(best_ms(lambda: dec.decode(z, cache), repeats) / chunk, 1)}
    if batch > 1:
        caches = [started(dec, h, w, s) for s in range(batch)]
        zs = torch.randn(batch, 16, chunk, h, w)

        def looped() -> None:
            for zb, cb in zip(zs, caches, strict=True):
                dec.decode(zb, cb)

        row |= {
            "batch": batch,
            "looped_ms_per_latent_frame_per_session": round(best_ms(looped, repeats) / (batch * chunk), 1),
            "batched_ms_per_latent_frame_per_session": round(
                best_ms(lambda: decode_batch(dec, zs, caches), repeats) / (batch * chunk), 1
            ),
        }
    return row


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="64x64,128x128", help="HxW frame sizes (multiples of 8)")
    parser.add_argument("--chunk", type=int, default=2, help="latent frames per timed chunk")
    parser.add_argument("--batch", type=int, default=4, help="sessions in the batched run (first size)")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per measurement (best kept)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/decoders.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    decoders: dict[str, StreamingDecoder] = {
        "wan2.1_vae": WanStreamingVAE(AutoencoderKLWan()),
        "taehv_taew2_1": TAEHVDecoder(TAEHV(TAEHVConfig())),
    }
    params = {
        "wan2.1_vae": sum(p.numel() for p in decoders["wan2.1_vae"].vae.decoder.parameters()),  # type: ignore[attr-defined]
        "taehv_taew2_1": sum(p.numel() for p in decoders["taehv_taew2_1"].model.decoder.parameters()),  # type: ignore[attr-defined]
    }
    results: list[dict] = []
    for i, size in enumerate(args.sizes.split(",")):
        hh, ww = (int(v) for v in size.split("x"))
        for name, dec in decoders.items():
            row = {"size": size, "decoder": name}
            row |= measure(dec, hh // 8, ww // 8, args.chunk, args.batch if i == 0 else 1, args.repeats)
            print(json.dumps(row), flush=True)
            results.append(row)
    report = {
        "benchmark": "decoders",
        "device": "cpu",
        "threads": args.threads,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "chunk_latent_frames": args.chunk,
        "repeats": args.repeats,
        "decoder_parameters": params,
        "weights": "random (published shapes)",
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
