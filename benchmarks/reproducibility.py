"""Where the same seed and actions give the same frames bit for bit, and where they do not.

One session (seed 7, a fixed key script) runs on a bare `Engine` in this process, first alone,
then in other settings, and every setting's frames are compared with the alone run's: the
largest difference in uint8 levels and the share of values that differ. Settings:

- ``alone_again``: a second engine, same process, same torch threads;
- ``interleaved``: three other sessions beside it, ``max_batch=1`` (one session per forward);
- ``idle_neighbours``: other sessions hold pool rows but send nothing (another pool row);
- ``batched_N``: N - 1 other sessions stepped with it, ``max_batch=8`` (one forward for all);
- ``batched_N_again``: the same batch (same mates, same order) in a fresh engine;
- ``batched_2_vs_8``: the session in a batch of 2 against the same session in a batch of 8;
- ``batched_4_other_order``: the same mates, the session added last instead of first;
- ``batched_4_other_mates``: as many mates, other worlds (seeds 300+);
- ``threads_T``: alone, with T torch threads instead of the first run's;
- ``deterministic_*``: the same under ``Engine(deterministic=True)`` (``serve --deterministic``,
  ``max_batch=8``), against that mode's alone run: 7 mates, and 3 other mates added first.

It also measures what the deterministic mode costs: chunks/s of 1 and of 8 sessions, plain and
deterministic (``cost``; wall time, this machine).

It also prints a hash of the alone run's frames, so two processes (or machines) can be compared.

    python benchmarks/reproducibility.py [--model tiny-random] [--chunks 12] [--threads 1]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

import numpy as np
import torch

from models.actions import FrameAction
from models.registry import from_name
from models.world import Conditioning, World
from runtime.engine import Engine
from runtime.requests import ChunkCommitted, ChunkRequest

RESULTS = Path(__file__).parent / "results"
SEED = 7
KEYS = ["w", "d", "", "a", "s", "d"]  # one held key per chunk ("" idle), repeated as needed


def script(chunks: int) -> list[list[FrameAction]]:
    """The session's actions: one action for the whole chunk."""
    return [[FrameAction(frozenset(k for k in [KEYS[i % len(KEYS)]] if k))] for i in range(chunks)]


def run(
    world: World,
    mates: int,
    chunks: int,
    max_batch: int,
    last: bool = False,
    idle: int = 0,
    mate_seed: int = 100,
    deterministic: bool = False,
) -> np.ndarray:
    """The frames of session "s" (seed SEED) stepped with ``mates`` other sessions (seeds
    ``mate_seed`` on), all submitted together each chunk; ``idle`` more sessions only hold pool rows."""
    engine = Engine(
        {world.config.id: world}, max_batch=max_batch, max_streams=16, deterministic=deterministic
    )
    others = [f"m{i}" for i in range(mates)]
    order = [*others, "s"] if last else ["s", *others]
    for i in range(idle):
        engine.add_stream(f"idle{i}", world.config.id, Conditioning(seed=200 + i))
    for sid in order:
        seed = SEED if sid == "s" else mate_seed + int(sid[1:])
        engine.add_stream(sid, world.config.id, Conditioning(seed=seed))
    frames: list[np.ndarray] = []
    for actions in script(chunks):
        for sid in order:
            engine.submit(ChunkRequest(sid, engine.new_request_id(), actions=actions))
        while engine.has_work():
            for out in engine.step():
                assert isinstance(out, ChunkCommitted), out
                if out.stream_id == "s":
                    frames.append(out.frames)
    for sid in [*order, *(f"idle{i}" for i in range(idle))]:
        engine.remove_stream(sid)
    return np.concatenate(frames)


def chunks_per_s(world: World, sessions: int, chunks: int, deterministic: bool) -> float:
    """Chunks/s of `sessions` sessions stepped together (max_batch 8), after one warm-up chunk."""
    run(world, 0, 1, max_batch=8, deterministic=deterministic)  # warm-up
    start = time.perf_counter()
    run(world, sessions - 1, chunks, max_batch=8, deterministic=deterministic)
    return sessions * chunks / (time.perf_counter() - start)


def compare(ref: np.ndarray, got: np.ndarray) -> dict:
    """Largest difference (uint8 levels) and share of differing values."""
    diff = np.abs(ref.astype(int) - got.astype(int))
    top = int(diff.max())
    return {"identical": top == 0, "max_levels": top, "share": float((diff > 0).mean())}


def main() -> None:
    """Run every setting and write benchmarks/results/reproducibility.json."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-random")
    parser.add_argument("--chunks", type=int, default=12)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the reference run")
    parser.add_argument("--out", type=Path, default=RESULTS / "reproducibility.json")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    world = from_name(args.model)
    ref = run(world, 0, args.chunks, max_batch=1)
    results = {
        "alone_again": compare(ref, run(world, 0, args.chunks, max_batch=1)),
        "interleaved": compare(ref, run(world, 3, args.chunks, max_batch=1)),
        "idle_neighbours": compare(ref, run(world, 0, args.chunks, max_batch=1, idle=3)),
    }
    by_size: dict[int, np.ndarray] = {}
    for n in (2, 4, 8):
        by_size[n] = run(world, n - 1, args.chunks, max_batch=8)
        results[f"batched_{n}"] = compare(ref, by_size[n])
        results[f"batched_{n}_again"] = compare(by_size[n], run(world, n - 1, args.chunks, max_batch=8))
    results["batched_2_vs_8"] = compare(by_size[2], by_size[8])
    four = run(world, 3, args.chunks, max_batch=8)
    results["batched_4_other_order"] = compare(four, run(world, 3, args.chunks, max_batch=8, last=True))
    results["batched_4_other_mates"] = compare(four, run(world, 3, args.chunks, max_batch=8, mate_seed=300))
    for threads in sorted({1, 2, 4} - {args.threads}):
        torch.set_num_threads(threads)
        results[f"threads_{threads}"] = compare(ref, run(world, 0, args.chunks, max_batch=1))
    torch.set_num_threads(args.threads)
    det = run(world, 0, args.chunks, max_batch=8, deterministic=True)
    results["deterministic_batched_8"] = compare(det, run(world, 7, args.chunks, 8, deterministic=True))
    results["deterministic_batched_4_other_mates_first"] = compare(
        det, run(world, 3, args.chunks, 8, last=True, mate_seed=300, deterministic=True)
    )
    results["deterministic_vs_plain_alone"] = compare(ref, det)
    cost = {
        f"{n}_sessions": {
            "plain_chunks_per_s": chunks_per_s(world, n, args.chunks, False),
            "deterministic_chunks_per_s": chunks_per_s(world, n, args.chunks, True),
        }
        for n in (1, 8)
    }

    report = {
        "model": args.model,
        "chunks": args.chunks,
        "threads": args.threads,
        "torch": torch.__version__,
        "alone_sha256": hashlib.sha256(ref.tobytes()).hexdigest(),
        "frames": list(ref.shape),
        "settings": results,
        "cost": cost,
    }
    for name, r in results.items():
        same = "identical" if r["identical"] else "differs"
        print(f"{name:24s} {same:9s} max {r['max_levels']} levels, {r['share']:.4%} of values")
    for name, c in cost.items():
        plain, det_rate = c["plain_chunks_per_s"], c["deterministic_chunks_per_s"]
        print(f"{name}: plain {plain:.2f} chunks/s, deterministic {det_rate:.2f} ({det_rate / plain:.2f}x)")
    print("alone sha256", report["alone_sha256"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
