"""Batching: aggregate frames/s of N lockstep sessions on one CPU engine, N = 1, 2, 4, 8.

Four paths, each at every N, alternating N within a round so background load hits all alike:

* forward: one batched denoise forward alone (best of 10, sessions at a full window), reported
          as latent frames/s: the bound of the model itself;
* bare:   the batched model loop alone (`World` calls: K denoise forwards, the context pass, the
          batched decode) for N sessions in one batch: the bound the engine can reach;
* engine: N streams in a bare `Engine` (max_batch 8); each round submits one chunk per stream
          and steps until idle;
* ws:     `worldserve serve --max-batch 8` in a subprocess and N concurrent lockstep SDK
          sessions over loopback websockets (raw frames), each `step` awaited.

The figure of merit is frames/s at N divided by frames/s at 1, per path. Median of `--rounds`.
Frames are video frames except for `forward` (latent frames).

    python benchmarks/batching.py [--model tiny-world] [--chunks 6] [--rounds 3] [--paths forward ...]

Prints and writes benchmarks/results/batching.json (or --out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.serving import start_server
from models.registry import from_name
from models.world import Conditioning, World
from runtime.engine import Engine
from runtime.requests import ChunkCommitted, ChunkRequest

RESULTS = Path(__file__).parent / "results"
KEYS = ["w", "d"]


def forward_fps(world: World, n: int, reps: int = 10) -> float:
    """Latent frames/s of one batched denoise forward for n sessions (best of `reps`)."""
    from runtime.kv_cache import KVLayout

    cfg = world.transformer.cfg
    layout = KVLayout(cfg.sink_frames, cfg.window_frames, world.tokens_per_frame)
    world.setup(max(8, n))
    states = [world.init_state(Conditioning(seed=i)) for i in range(n)]
    k = world.chunk_frames
    index = layout.index([s.row for s in states], [cfg.window_frames] * n, k, world.pad_row)
    a = cfg.action
    width = 0 if a is None else len(a.keys) + 2 * int(a.mouse) + a.vector_dim
    acts = None if a is None else torch.zeros(n, k, world.layout.frames_per_latent, width)
    x = world.noise_batch([(s.seed, 1, 0) for s in states], k)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        world.denoise(x, 500.0, index, acts)
        best = min(best, time.perf_counter() - t0)
    for s in states:
        world.release_state(s)
    return n * k / best


def bare_fps(world: World, n: int, chunks: int) -> float:
    """Frames/s of the batched model loop alone for n sessions (after one warm-up chunk)."""
    from models.vae import decode_batch
    from runtime.kv_cache import KVLayout

    cfg = world.transformer.cfg
    layout = KVLayout(cfg.sink_frames, cfg.window_frames, world.tokens_per_frame)
    world.setup(max(8, n))
    states = [world.init_state(Conditioning(seed=i)) for i in range(n)]
    sched = world.config.schedule
    k = world.chunk_frames
    a = world.transformer.cfg.action
    width = 0 if a is None else len(a.keys) + 2 * int(a.mouse) + a.vector_dim
    acts = None if a is None else torch.zeros(n, k, world.layout.frames_per_latent, width)
    frames, start = 0, 0.0
    done = [0] * n
    caches = [s.decoder for s in states]
    for c in range(chunks + 1):
        if c == 1:
            start, frames = time.perf_counter(), 0
        index = layout.index([s.row for s in states], done, k, world.pad_row, device=world.device)
        x = torch.stack([world.noise(s.seed, c, 0, k) for s in states])
        for step, (t, sg) in enumerate(zip(sched.timesteps, sched.sigmas, strict=True)):
            x0 = sched.to_x0(world.denoise(x, t, index, acts), x, sg)
            if step + 1 < len(sched.steps):
                nz = torch.stack([world.noise(s.seed, c, step + 1, k) for s in states])
                x = (1 - sched.sigmas[step + 1]) * x0 + sched.sigmas[step + 1] * nz
        x0 = world.canonical(x0)
        world.context(x0, index, acts)
        out, caches = decode_batch(world.decoder, x0, caches)
        frames += sum(int(f.shape[0]) for f in out)
        done = [d + k for d in done]
    elapsed = time.perf_counter() - start
    for s in states:
        world.release_state(s)
    return frames / elapsed


def engine_fps(world: World, n: int, chunks: int) -> float:
    """Frames/s of n lockstep streams through a bare Engine (after one warm-up round)."""
    engine = Engine({world.config.id: world}, max_batch=8, max_streams=8)
    for i in range(n):
        engine.add_stream(f"s{i}", world.config.id, Conditioning(seed=i))
    frames, start = 0, 0.0
    for c in range(chunks + 1):
        if c == 1:
            start, frames = time.perf_counter(), 0
        for i in range(n):
            engine.submit(ChunkRequest(f"s{i}", engine.new_request_id()))
        while engine.has_work():
            for o in engine.step():
                assert isinstance(o, ChunkCommitted), o
                frames += o.frames.shape[0]
    elapsed = time.perf_counter() - start
    for i in range(n):
        engine.remove_stream(f"s{i}")
    return frames / elapsed


async def ws_fps(url: str, n: int, chunks: int) -> float:
    """Frames/s of n concurrent lockstep websocket sessions (after one warm-up step each)."""
    from web.sdk import connect

    counts = [0] * n
    started = asyncio.Event()
    ready = 0

    async def one(i: int) -> None:
        nonlocal ready
        async with connect(url, seed=i, codec="raw", mode="lockstep") as s:
            await s.step({"keys": [KEYS[0]]})
            ready += 1
            if ready == n:
                started.set()
            await started.wait()
            for c in range(chunks):
                frames = await s.step({"keys": [KEYS[c % 2]]})
                counts[i] += frames.shape[0]

    t0 = 0.0

    async def clock() -> None:
        nonlocal t0
        await started.wait()
        t0 = time.perf_counter()

    await asyncio.gather(clock(), *(one(i) for i in range(n)))
    return sum(counts) / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-world")
    p.add_argument("--sessions", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--chunks", type=int, default=6, help="measured chunks per session per run")
    p.add_argument("--rounds", type=int, default=3)
    paths = ["forward", "bare", "engine", "ws"]
    p.add_argument("--paths", nargs="+", default=paths, choices=paths)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=RESULTS / "batching.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    world = from_name(args.model)
    server = None
    if "ws" in args.paths:
        server, url = start_server(args.model, args.threads, "--max-batch", "8", "--max-sessions", "8")
    runs: dict[str, dict[int, list[float]]] = {path: {n: [] for n in args.sessions} for path in args.paths}
    try:
        for r in range(args.rounds):
            for n in args.sessions:
                with torch.no_grad():
                    if "forward" in args.paths:
                        runs["forward"][n].append(forward_fps(world, n))
                    if "bare" in args.paths:
                        runs["bare"][n].append(bare_fps(world, n, args.chunks))
                    if "engine" in args.paths:
                        runs["engine"][n].append(engine_fps(world, n, args.chunks))
                if "ws" in args.paths:
                    runs["ws"][n].append(asyncio.run(ws_fps(url, n, args.chunks)))
                print(f"round {r} N={n}: " + ", ".join(f"{k} {v[n][-1]:.1f}" for k, v in runs.items()))
    finally:
        if server is not None:
            server.terminate()
            server.wait(10)
    table = {}
    for path, by_n in runs.items():
        med = {n: statistics.median(v) for n, v in by_n.items()}
        base = med[args.sessions[0]]
        table[path] = {
            str(n): {
                "fps_total": round(f, 1),
                "vs_1": round(f / base, 2),
                "runs": [round(x, 1) for x in by_n[n]],
            }
            for n, f in med.items()
        }
    result = {
        "meta": {
            "model": args.model,
            "chunks": args.chunks,
            "rounds": args.rounds,
            "threads": args.threads,
            "torch": torch.__version__,
            "machine": platform.processor() or platform.machine(),
            "command": " ".join(sys.argv),
        },
        "frames_per_s": table,
    }
    print(json.dumps(table, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
