"""Self-attention over the K/V pool, three ways, one layer: what `models/kv_pool.py` chose between.

* `in_place`  (eager, kept): one SDPA per run of consecutive rows over a view of the pool cut at
  the run's longest filled prefix, unmasked when every entry fills it (no K/V copied);
* `bucket`: the filled prefix rounded up to a fill bucket (multiples of `--bucket` frames, a
  handful of static shapes for a compiler), gathered from each entry's row (`index_select`)
  and read under a mask;
* `whole`: the whole row gathered and read under a mask (before; the compiled path keeps it).

Entries sit on rows 0..B-1 at the same fill level (sessions that started together), at every
fill level a window passes through. Best CPU time of `--reps` rounds, in ms, and max |difference|.

    python benchmarks/pool_attention.py [--batch 1 4] [--threads 2] [--reps 5]

Prints and writes benchmarks/results/pool_attention.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.kv_pool import KVPool, PoolAttention
from runtime.kv_cache import KVLayout

RESULTS = Path(__file__).parent / "results"
HEADS, HEAD_DIM, TOKENS, CHUNK, WINDOW = 8, 64, 64, 3, 21  # the peer benchmark's shape


def best_ms(fns: dict, reps: int) -> dict[str, float]:
    """Best CPU time (ms, the process's: a shared machine inflates it less than wall time) of each
    function over `reps` rounds that call each once in turn, after one warm-up."""
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(reps + 1):
        for name, fn in fns.items():
            t0 = time.process_time()
            fn()
            best[name] = min(best[name], time.process_time() - t0)
    return {f"{name}_ms": ms * 1000 for name, ms in best.items()}


def measure(batch: int, filled: int, bucket: int, reps: int) -> dict:
    """One layer's attention for `batch` entries after `filled` committed frames."""
    layout = KVLayout(0, WINDOW, TOKENS)
    pool = KVPool(batch, 1, layout.capacity_frames * TOKENS, HEADS, HEAD_DIM, text_tokens=1)
    gen = torch.Generator().manual_seed(0)
    pool.k.copy_(torch.randn(pool.k.shape, generator=gen))
    pool.v.copy_(torch.randn(pool.v.shape, generator=gen))
    index = layout.index(list(range(batch)), [filled] * batch, CHUNK, pool.pad_row)
    q = torch.randn(batch, CHUNK * TOKENS, HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(q.shape, generator=gen)
    rope = (torch.ones(1), torch.zeros(1))
    attn = PoolAttention(pool, index, TOKENS, rope, None)
    span = index.host.spans[0]
    frames = min(layout.capacity_frames, -(-span // bucket) * bucket)
    mask_b = index.valid[:, :frames].repeat_interleave(TOKENS, 1)[:, None, None]
    mask_w = index.valid.repeat_interleave(TOKENS, 1)[:, None, None]

    def gathered(n_frames: int, mask: torch.Tensor) -> torch.Tensor:
        kb, vb = pool.k[0], pool.v[0]
        kb.index_put_((index.rows[:, None], index.write), k)
        vb.index_put_((index.rows[:, None], index.write), k)
        kk = kb[:, : n_frames * TOKENS].index_select(0, index.rows)
        vv = vb[:, : n_frames * TOKENS].index_select(0, index.rows)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2), mask
        )
        return out.transpose(1, 2)

    with torch.no_grad():
        ref = attn.self_attn(0, q, k, k)
        diff = max(
            (gathered(frames, mask_b) - ref).abs().max().item(),
            (gathered(WINDOW, mask_w) - ref).abs().max().item(),
        )
        return {
            "batch": batch,
            "filled_frames": filled,
            "read_frames": {"in_place": span, "bucket": frames, "whole": layout.capacity_frames},
            **best_ms(
                {
                    "in_place": lambda: attn.self_attn(0, q, k, k),
                    "bucket": lambda: gathered(frames, mask_b),
                    "whole": lambda: gathered(layout.capacity_frames, mask_w),
                },
                reps,
            ),
            "max_abs_diff": diff,
        }


def main() -> None:
    """Measure, print, write."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--bucket", type=int, default=6, help="fill bucket, in frames")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=RESULTS / "pool_attention.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    measure(args.batch[0], 0, args.bucket, args.reps)  # warm-up: the process's first calls pay for setup
    rows = [measure(b, f, args.bucket, args.reps) for b in args.batch for f in range(0, WINDOW + 1, CHUNK)]
    print("batch filled | read frames in_place/bucket/whole | ms in_place  bucket  whole | max diff")
    for r in rows:
        rf, ms = r["read_frames"], [r["in_place_ms"], r["bucket_ms"], r["whole_ms"]]
        reads = f"{rf['in_place']:8d} {rf['bucket']:6d} {rf['whole']:5d}"
        print(
            f"{r['batch']:5d} {r['filled_frames']:6d} | {reads}            | "
            f"{ms[0]:11.2f} {ms[1]:7.2f} {ms[2]:6.2f} | {r['max_abs_diff']:.1e}"
        )
    report = {
        "threads": args.threads,
        "bucket_frames": args.bucket,
        "shape": [HEADS, HEAD_DIM, TOKENS, CHUNK, WINDOW],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report | {"rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
