"""How long a UMT5-XXL prompt encode takes on this CPU, measured on one full-size layer.

    OMP_NUM_THREADS=1 python benchmarks/umt5_encode.py [--threads 1] [--out PATH.json]

The published encoder (24 layers, 4096 wide, 5.7 B parameters) needs 23 GB in float32; this
builds ONE full-size layer with random weights (`models.umt5.model.Block`, 0.19 B parameters,
0.77 GB) and times it on prompts of 32 and 512 tokens, float32, then projects the whole encode as
24 x the layer (the embedding lookup and final norm are negligible). The model runs only a prompt's
own tokens (models/umt5/load.py), so a short prompt costs what its tokens cost, not 512.
Reported: median of `--repeats` runs after one warm-up.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from models.umt5.model import Block, UMT5Config

LENGTHS = (32, 128, 512)


def time_layer(block: Block, tokens: int, repeats: int) -> float:
    """Median seconds of one layer's forward on `tokens` tokens."""
    x = torch.randn(1, tokens, block.attn_norm.weight.shape[0])
    runs = []
    with torch.inference_mode():
        block(x, None)
        for _ in range(repeats):
            start = time.perf_counter()
            block(x, None)
            runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def main() -> None:
    """Time one full-size layer and write the projection."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/umt5_encode.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = UMT5Config()
    block = Block(cfg).eval()
    rows = []
    for n in LENGTHS:
        layer = time_layer(block, n, args.repeats)
        rows.append(
            {"tokens": n, "layer_s": round(layer, 4), "encode_s_projected": round(layer * cfg.layers, 2)}
        )
        print(rows[-1], flush=True)
    result = {
        "what": "one full-size UMT5-XXL layer, float32, random weights; encode = layers x layer",
        "cpu": platform.processor() or platform.machine(),
        "threads": args.threads,
        "torch": torch.__version__,
        "params": cfg.params(),
        "bytes_bf16": cfg.params() * 2,
        "bytes_fp32": cfg.params() * 4,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
