"""Cross-attention to a one-token text: the block reads the token's V (no query, no SDPA) vs the
full cross-attention, in one session, alternating chunk by chunk.

A world without prompts (the tiny world) holds one null text token per session; softmax over one
key weighs it 1, so every query's output is that token's V (`PoolAttention.one_text_value`).
Both paths give the same bits (checked here on every chunk's frames); the question is what
skipping the norm, the query projection and the SDPA saves per chunk. Chunks alternate between
the paths in one session, so load drifting over the run hits both alike; the ratio is the
median of adjacent pairs.

    python benchmarks/one_text_token.py [--model tiny-world] [--chunks 200] [--threads 1]

Prints and writes benchmarks/results/one_text_token.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.actions import FrameAction
from models.kv_pool import PoolAttention
from models.registry import from_name
from models.world import Conditioning
from runtime.engine import Engine
from runtime.requests import ChunkCommitted, ChunkRequest

RESULTS = Path(__file__).resolve().parent / "results"


def chunk(engine: Engine, key: str) -> np.ndarray:
    """One lockstep chunk of `key` held ("" = none); its frames."""
    engine.submit(ChunkRequest("s", engine.new_request_id(), actions=[FrameAction(frozenset(key))]))
    frames = None
    while engine.has_work():
        for o in engine.step():
            if isinstance(o, ChunkCommitted):
                frames = o.frames
    if frames is None:
        raise RuntimeError("the chunk did not commit")
    return frames


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny-world")
    parser.add_argument("--chunks", type=int, default=200, help="timed chunks, half on each path")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the server's on 2 cores)")
    parser.add_argument("--out", type=Path, default=RESULTS / "one_text_token.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)

    world = from_name(args.model)
    read_v = PoolAttention.one_text_value
    paths = {"one_text_value": read_v, "cross_attention": lambda self, layer: None}
    twins = Engine({"m": from_name(args.model)})  # the same chunks on the full path, for the bits
    twins.add_stream("s", "m", Conditioning(seed=1060002))
    engine = Engine({"m": world})
    engine.add_stream("s", "m", Conditioning(seed=1060002))
    rng = random.Random(0)
    ms: dict[str, list[float]] = {name: [] for name in paths}
    same = True
    warm = 10
    try:
        for i in range(warm + args.chunks):
            key = rng.choice(["w", "a", "s", "d", ""])
            name = "one_text_value" if i % 2 else "cross_attention"
            PoolAttention.one_text_value = paths[name]
            t0 = time.perf_counter()
            frames = chunk(engine, key)
            dt = (time.perf_counter() - t0) * 1000
            PoolAttention.one_text_value = paths["cross_attention"]
            same &= bool(np.array_equal(frames, chunk(twins, key)))
            if i >= warm:
                ms[name].append(dt)
    finally:
        PoolAttention.one_text_value = read_v
    pairs = [b / a for a, b in zip(ms["one_text_value"], ms["cross_attention"], strict=False)]
    result = {
        "benchmark": "one_text_token",
        "command": " ".join(["python", *sys.argv]),
        "model": args.model,
        "threads": args.threads,
        "chunks_per_path": len(ms["one_text_value"]),
        "ms_per_chunk_median": {name: round(statistics.median(v), 2) for name, v in ms.items()},
        "speedup_median_of_pairs": round(statistics.median(pairs), 4),
        "frames_identical": same,
        "note": "CPU; lockstep chunks of one session, the two paths alternating chunk by chunk",
    }
    print(json.dumps(result, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
