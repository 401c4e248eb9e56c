"""How long a Matrix-Game open or reset holds another session's chunks, before and after the
conditioning moved off the engine thread (runtime/conditioning.py).

    python benchmarks/mg_cond_stall.py      # ~5 min on 2 busy CPU cores; writes results/mg_cond_stall.json

A reduced Matrix-Game 2.0 world on the CPU (random weights; the universal variant's DiT, action
module, I2V conditioning, Wan VAE and CLIP tower, scaled down; one session's conditioning costs
several of its chunks here). Through a real `EngineThread`, session A steps lockstep chunks back
to back while, in the "churn" runs, session B opens, resets twice and closes, over and over,
`--pause` s after each answer. Reported: the gaps between A's consecutive chunks (median, 90th
percentile, worst) alone and under churn, with the conditioning on the engine thread ("before":
`Engine(offload_conditioning=False)`, main's code path) and on the conditioning worker
("after_niceN": at a CPU priority N lower than the engine's; the engine's default is
`Engine(conditioning_nice=...)`), each run `--rounds` times, interleaved; and how long B's opens
and resets took.

On a CPU the worker and the engine thread share the cores: at the same priority a conditioning
slows A's chunks by what it takes from them, at a lower one it mostly waits for spare time (and
takes longer); either way no chunk waits for a whole conditioning any more. On CUDA the worker's
work runs on its own CUDA stream.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diffusers import AutoencoderKLWan

from models.causal_wan import CausalWan
from models.convert import matrix_game
from models.matrix_game.clip_vision import CLIPVision, CLIPVisionConfig
from models.matrix_game.loader import build_world, transformer_config
from models.world import Conditioning, World
from runtime.conditioning import CONDITIONING_NICE
from runtime.engine import Engine, EngineThread
from runtime.requests import ChunkCommitted, ChunkRequest

OUT = Path(__file__).parent / "results" / "mg_cond_stall.json"
UNIVERSAL = matrix_game.PUBLISHED["universal"]
SHAPE = {  # the reduced world; the published sizes in the comments
    "height": 32,  # 352
    "width": 48,  # 640
    "dim": 128,  # 1536
    "num_layers": 2,  # 30
    "cond_frames": matrix_game.COND_FRAMES,  # 30, as published
    "clip_image": 112,  # 224 (65 tokens instead of 257)
    "clip_layers": 8,  # 32 (ViT-H width 1280 kept)
    "vae_base_dim": 8,  # 96
}


def make_world() -> World:
    """The reduced Matrix-Game world (random weights, fp32, CPU)."""
    s = SHAPE
    original = UNIVERSAL | {
        "dim": s["dim"],
        "ffn_dim": 2 * s["dim"],
        "freq_dim": 64,
        "num_heads": s["dim"] // 64,
        "num_layers": s["num_layers"],
        "action_config": UNIVERSAL["action_config"]
        | {"blocks": list(range(s["num_layers"])), "heads_num": 4, "hidden_size": 32}
        | {"img_hidden_size": s["dim"], "keyboard_hidden_dim": 256, "mouse_hidden_dim": 256},
    }
    clip_tokens = (s["clip_image"] // 14) ** 2 + 1
    meta = {
        "variant": "universal",
        "original": original,
        "inference": matrix_game.INFERENCE["universal"]
        | {"cond_frames": s["cond_frames"], "clip_tokens": clip_tokens},
        "world": {"height": s["height"], "width": s["width"]},
    }
    vae_cfg = {"base_dim": s["vae_base_dim"], "z_dim": 16, "dim_mult": [1, 2, 4], "num_res_blocks": 1}
    vae_cfg |= {"temperal_downsample": [True, True], "scale_factor_spatial": 4}
    torch.manual_seed(0)
    transformer = CausalWan(transformer_config(meta))
    vae = AutoencoderKLWan(**vae_cfg)
    clip = CLIPVision(CLIPVisionConfig(image_size=s["clip_image"], num_layers=s["clip_layers"]))
    picture = np.random.default_rng(0).integers(0, 256, (352, 640, 3), dtype=np.uint8)
    return build_world(meta, transformer.eval(), vae.eval(), clip, start_image=lambda seed: picture)


def summary(values: list[float]) -> dict:
    """Median, 90th percentile and worst of `values` (seconds) in ms."""
    xs = sorted(values)
    p90 = xs[min(len(xs) - 1, int(0.9 * len(xs)))]
    return {
        "n": len(xs),
        "median_ms": round(1000 * statistics.median(xs), 1),
        "p90_ms": round(1000 * p90, 1),
        "worst_ms": round(1000 * xs[-1], 1),
    }


async def run(
    world: World, offload: bool, nice: int, churn: bool, chunks: int, threads: int, pause: float
) -> dict:
    """A steps `chunks` lockstep chunks (after 2 warm-up chunks); with `churn`, B opens, resets
    twice and closes meanwhile, again and again, `pause` s between one answer and the next call."""
    engine = Engine(
        {"mg": world},
        max_batch=2,
        max_streams=4,
        offload_conditioning=offload,
        conditioning_nice=nice,
    )
    et = EngineThread(engine, asyncio.get_running_loop(), threads=threads)
    et.start()
    done = asyncio.Event()
    conditionings: list[float] = []

    async def conditioned(fut: asyncio.Future) -> None:
        t0 = time.perf_counter()
        await fut
        conditionings.append(time.perf_counter() - t0)

    async def churner() -> None:
        seed = 100
        while not done.is_set():
            await conditioned(et.add_stream("b", "mg", Conditioning(seed=seed)))
            for _ in range(2):
                await asyncio.sleep(pause)
                if done.is_set():
                    break
                seed += 1
                await conditioned(et.reset_stream("b", Conditioning(seed=seed)))
            await et.remove_stream("b")
            await asyncio.sleep(pause)

    async def chunk() -> float:
        out = await et.submit(ChunkRequest("a", et.new_request_id()))
        assert isinstance(out, ChunkCommitted), out
        return time.perf_counter()

    try:
        await et.add_stream("a", "mg", Conditioning(seed=1))
        for _ in range(2):
            await chunk()
        task = asyncio.create_task(churner()) if churn else None
        if churn:
            while not conditionings and not task.done():  # the churn is under way
                await asyncio.sleep(0.01)
        stamps = [await chunk() for _ in range(chunks + 1)]
        done.set()
        if task is not None:
            await task
    finally:
        done.set()
        await asyncio.to_thread(et.close)
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    row: dict = {"gaps": summary(gaps), "wall_s": round(stamps[-1] - stamps[0], 1)}
    if churn:
        row["conditioning"] = summary(conditionings)
    return row


def prepare_ms(world: World, reps: int = 3) -> float:
    """One session's conditioning alone on this thread (`World.prepare`), best of `reps`, ms."""
    times = []
    for i in range(reps):
        t0 = time.perf_counter()
        world.prepare(Conditioning(seed=i))
        times.append(time.perf_counter() - t0)
    return round(1000 * min(times), 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chunks", type=int, default=40, help="measured chunks of A per run")
    p.add_argument("--rounds", type=int, default=2, help="times each run is repeated, interleaved")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the engine thread")
    p.add_argument(
        "--nice", type=int, nargs="+", default=[0, 5, 10], help="the worker's lower CPU priorities to run"
    )
    p.add_argument("--pause", type=float, default=0.5, help="s between B's answer and its next call")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    torch.set_num_threads(1)  # the main thread's team stays small (see EngineThread)
    world = make_world()
    meta = {
        "shape": SHAPE,
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "engine_threads": args.threads,
        "churn_pause_s": args.pause,
        "conditioning_threads": 1,
        "conditioning_nice": {"default": CONDITIONING_NICE, "runs": args.nice},
        "load_avg_start": [round(x, 2) for x in os.getloadavg()],
        "prepare_ms_alone": prepare_ms(world),
        "command": " ".join(sys.argv),
    }
    print(json.dumps(meta), flush=True)
    results: dict[str, list[dict]] = {}
    for r in range(args.rounds):
        runs = [("before_alone", False, 0, False), ("before_churn", False, 0, True)]
        runs += [("after_alone", True, 0, False)]  # nothing runs on the worker: its priority is moot
        runs += [(f"after_nice{n}_churn", True, n, True) for n in args.nice]
        for key, offload, nice, churn in runs:
            row = asyncio.run(run(world, offload, nice, churn, args.chunks, args.threads, args.pause))
            print(json.dumps({"run": key, "round": r} | row), flush=True)
            results.setdefault(key, []).append(row)
    meta["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    args.out.write_text(json.dumps({"meta": meta, "runs": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
