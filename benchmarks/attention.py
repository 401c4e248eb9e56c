"""Self-attention over the K/V pool: 4-D SDPA with a per-row prefix mask vs FlexAttention.

What `models/kv_pool.py` chose between: every batch entry attends over its row's slots with
`slot < n_valid[b]` (windows at different fill levels). SDPA takes a dense (B, 1, 1, slots)
boolean; FlexAttention a block mask from the same predicate, compiled. Best of `--reps` calls,
rows at different fill levels, and the max difference between the two outputs.

    python benchmarks/attention.py                                   # CPU: tiny-world + a small Wan shape
    python benchmarks/attention.py --device cuda --dtype bfloat16 --shapes mg sf

Prints and writes benchmarks/results/attention.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

# name -> (heads, head_dim, tokens per frame, chunk frames, slots in frames)
SHAPES = {
    "tiny-world": (4, 32, 16, 4, 16),
    "wan-small": (12, 128, 64, 3, 6),
    "mg": (12, 128, 880, 3, 6),  # Wan2.1-1.3B, 352x640, window 6
    "sf": (12, 128, 1560, 3, 21),  # Wan2.1-1.3B, 480x832, window 21
}


def best_ms(fn, device: torch.device, reps: int) -> float:
    for _ in range(2):
        fn()
    best = float("inf")
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best * 1000


def measure(shape: str, batch: int, device: torch.device, dtype: torch.dtype, reps: int) -> dict:
    """SDPA-with-mask and FlexAttention ms for one shape and batch size."""
    heads, hd, tpf, n, frames = SHAPES[shape]
    lq, cap = n * tpf, frames * tpf
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, heads, length, hd, generator=gen) for length in (lq, cap, cap))
    q, k, v = (t.to(device, dtype) for t in (q, k, v))
    filled = [min(frames, n * (1 + i % (frames // n + 1))) * tpf for i in range(batch)]  # mixed fills
    fill = torch.tensor(filled, device=device)
    mask = (torch.arange(cap, device=device)[None] < fill[:, None])[:, None, None, :]

    def keep(b, h, q_idx, kv_idx):
        return kv_idx < fill[b]

    block = create_block_mask(keep, batch, None, lq, cap, device=str(device))
    flex = torch.compile(flex_attention, dynamic=False)
    sdpa_out = F.scaled_dot_product_attention(q, k, v, mask)
    flex_out = flex(q, k, v, block_mask=block)
    return {
        "shape": shape,
        "batch": batch,
        "q_tokens": lq,
        "slots": cap,
        "sdpa_ms": round(best_ms(lambda: F.scaled_dot_product_attention(q, k, v, mask), device, reps), 3),
        "flex_ms": round(best_ms(lambda: flex(q, k, v, block_mask=block), device, reps), 3),
        "max_diff": float((sdpa_out.float() - flex_out.float()).abs().max()),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--shapes", nargs="+", default=["tiny-world", "wan-small"], choices=sorted(SHAPES))
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "attention.json")
    args = p.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    rows = []
    for shape in args.shapes:
        for b in args.batch:
            row = measure(shape, b, device, dtype, args.reps)
            print(json.dumps(row), flush=True)
            rows.append(row)
    meta = {"device": args.device, "dtype": args.dtype, "torch": torch.__version__}
    meta["command"] = " ".join(sys.argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "results": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
