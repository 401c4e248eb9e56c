"""Engine overhead: a chunk through Engine + Session vs the bare model loop, in one run.

The bare loop calls the world's four contract functions directly (denoise K times, context,
decode, advance the counters by hand) with no transaction, scheduler or session, as one call
on the engine thread (so both sides run on its torch threads, `EngineThread`). The served path
is a lockstep session: `Session.step` -> EngineThread -> scheduler -> runner ->
transaction commit -> FramesEvent back on the event loop. Both run the same chunks on the same
world; measurements alternate in blocks so background load hits both alike.

Also reports KV bytes per session: the formula, the measured buffer size, and the formula at
the full-size Wan2.1-1.3B shapes of Self-Forcing and Matrix-Game 2.0 (their published configs).

    python benchmarks/engine_overhead.py [--model tiny-random] [--chunks 24] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import torch
from gpu_shapes import shape_configs  # this folder: the MG/SF shapes

from models.actions import FrameAction, group_actions
from models.registry import from_name
from models.sampler import add_noise
from models.world import Conditioning, World
from runtime.engine import Engine, EngineThread
from runtime.kv_cache import KVLayout
from sessions.events import FramesEvent
from sessions.manager import OpenParams, SessionManager

RESULTS = Path(__file__).parent / "results"


def bare_loop(world: World, chunks: int, seed: int) -> list[float]:
    """Seconds per chunk of the model alone."""
    state = world.init_state(Conditioning(seed=seed))
    cfg = world.transformer.cfg
    layout = KVLayout(cfg.sink_frames, cfg.window_frames, world.tokens_per_frame)
    sched = world.config.schedule
    times = []
    for c in range(chunks):
        t0 = time.perf_counter()
        n = world.chunk_frames
        index = layout.index([state.row], [state.frames], n, world.pad_row, device=world.device)
        video = world.layout.video_frames(state.frames, n)
        acts = None
        if cfg.action is not None:
            acts = group_actions(
                world.action_space, world.layout, state.frames, n, [FrameAction(frozenset({"w"}))] * video
            ).tensor[None]
        x = world.noise(seed, c + 1, 0, n)[None]
        for k, (t, sg) in enumerate(zip(sched.timesteps, sched.sigmas, strict=True)):
            x0 = sched.to_x0(world.denoise(x, t, index, acts), x, sg)
            if k + 1 < len(sched.steps):
                x = add_noise(x0, world.noise(seed, c + 1, k + 1, n)[None], sched.sigmas[k + 1])
        x0 = world.canonical(x0)
        world.context(x0, index, acts)
        frames, state.decoder = world.decode(x0[0], state)
        frames.cpu().numpy()
        state.frames += n
        state.chunks += 1
        times.append(time.perf_counter() - t0)
    return times


async def served(manager: SessionManager, chunks: int, seed: int) -> list[float]:
    """Seconds per chunk through a lockstep session (submit -> FramesEvent on the loop)."""
    session = await manager.open(OpenParams(seed=seed, mode="lockstep"))
    got: asyncio.Queue[FramesEvent] = asyncio.Queue()
    session.activate(lambda ev: got.put_nowait(ev) if isinstance(ev, FramesEvent) else None)
    times = []
    for i in range(chunks):
        t0 = time.perf_counter()
        session.step(i, [FrameAction(frozenset({"w"}))])
        ev = await got.get()
        times.append(time.perf_counter() - t0)
        session.ack(ev.chunk)
    await manager.close(session)
    return times


def wan_kv_bytes(shape: str) -> int:
    """One session's bf16 KV bytes at a full-size Wan2.1-1.3B shape of gpu_shapes.py (VAE: 8x)."""
    world, dit, _ = shape_configs(shape, tiny=False)
    return dit.kv_bytes(dit.tokens_per_frame(world.height // 8, world.width // 8), itemsize=2)


async def main_async(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)  # torch runs on the engine thread alone (`EngineThread`), both loops too
    world = from_name(args.model)
    engine = Engine({args.model: world}, max_batch=1)
    et = EngineThread(engine, asyncio.get_running_loop(), threads=args.threads)
    et.start()
    manager = SessionManager(et, default_model=args.model)
    bare: list[float] = []
    serve: list[float] = []
    try:
        await et.call(bare_loop, world, 2, 99)  # warm-up
        await served(manager, 2, seed=99)
        for r in range(args.rounds):
            bare += (await et.call(bare_loop, world, args.chunks, r))[1:]  # the first chunk is shorter
            serve += (await served(manager, args.chunks, seed=r))[1:]
    finally:
        await manager.shutdown()
        await asyncio.get_running_loop().run_in_executor(None, et.stop)

    measured = world.transformer.pool.row_nbytes()
    b, s = statistics.median(bare), statistics.median(serve)
    return {
        "model": args.model,
        "chunks_timed": len(bare),
        "bare_ms_per_chunk_median": round(b * 1000, 3),
        "served_ms_per_chunk_median": round(s * 1000, 3),
        "bare_ms_per_chunk_mean": round(statistics.fmean(bare) * 1000, 3),
        "served_ms_per_chunk_mean": round(statistics.fmean(serve) * 1000, 3),
        "overhead_ratio_median": round(s / b - 1, 4),
        "overhead_ms_median": round((s - b) * 1000, 3),
        "target_overhead": 0.10,
        "kv_bytes_per_session": {
            "formula": "layers x ((sink+window) frames x tokens/frame + text tokens) x dim x 2 (K,V)"
            " x itemsize (+ the action layers' temporal K/V): one row of the K/V pool",
            "formula_total": world.kv_bytes_per_session(),
            "measured": measured,
            "wan1.3b_self_forcing_bf16": wan_kv_bytes("sf"),
            "wan1.3b_matrix_game2_bf16": wan_kv_bytes("mg"),
        },
        "threads": args.threads,
        "note": "CPU, 2 cores; timings include background load; ratio is measured side by side in one run",
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-random")
    p.add_argument("--chunks", type=int, default=24)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    result = asyncio.run(main_async(args))
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "engine_overhead.json"
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
