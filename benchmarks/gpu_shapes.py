"""Full-size shapes through the Engine: Wan2.1-1.3B at Matrix-Game 2.0 and Self-Forcing shapes.

Random weights (FLOPs do not depend on them), bf16, eager. For each shape and session count it
runs chunks through a bare `Engine` (batched sessions) and reports per-stage ms per chunk,
frames/s per session and in total, KV bytes per session and peak device memory, next to the
published figures in shared/ANCHORS.md. Writes JSON to --out (default benchmarks/results/).

    python benchmarks/gpu_shapes.py --device cuda --shape mg --sessions 1 4 8
    python benchmarks/gpu_shapes.py --device cpu --tiny        # the same code path, scaled down

Needs a GPU for real figures; `--tiny` only checks that the script runs.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from models.causal_wan import ActionConfig, CausalWanConfig
from models.registry import build_world
from models.sampler import FlowSchedule
from models.world import Conditioning, World, WorldConfig
from runtime.engine import Engine
from runtime.requests import ChunkCommitted, ChunkRequest

PUBLISHED_FPS = {"mg": 25.0, "sf": 17.0}  # one H100 (shared/ANCHORS.md)


def shape_configs(shape: str, tiny: bool) -> tuple[WorldConfig, CausalWanConfig, dict]:
    """Wan2.1-1.3B (dim 1536, 30 layers) at the MG or SF shape; `tiny` scales everything down."""
    if shape == "mg":
        width, height, steps, window = 640, 352, (1000, 666, 333), 6
        action = ActionConfig(
            keys=("w", "a", "s", "d"),
            mouse=True,
            frames_per_latent=4,
            blocks=15,
            key_dim=1024,
            motion_dim=1024,
            heads=16,
        )
    else:
        width, height, steps, window = 832, 480, (1000, 750, 500, 250), 21
        action = None
    dit = CausalWanConfig(
        chunk_frames=3, window_frames=window, text_dim=4096, null_text_len=512, action=action
    )
    vae = {}  # AutoencoderKLWan defaults: Wan2.1's VAE
    if tiny:
        width, height = 64, 64
        dit = CausalWanConfig(
            num_attention_heads=2,
            attention_head_dim=32,
            ffn_dim=128,
            num_layers=4,
            text_dim=32,
            freq_dim=32,
            chunk_frames=3,
            window_frames=window,
            null_text_len=8,
            action=None
            if action is None
            else ActionConfig(
                keys=action.keys, frames_per_latent=4, blocks=2, key_dim=32, motion_dim=32, heads=2
            ),
        )
        vae = {"base_dim": 8, "dim_mult": [1, 2, 2, 2]}
    world = WorldConfig(id=shape, fps=16.0, width=width, height=height, schedule=FlowSchedule(steps=steps))
    return world, dit, vae


def run_shape(world: World, sessions: int, chunks: int) -> dict:
    engine = Engine({world.config.id: world}, max_batch=sessions, max_streams=sessions)
    for i in range(sessions):
        engine.add_stream(f"s{i}", world.config.id, Conditioning(seed=i))
    per_chunk: list[dict] = []
    frames = 0
    t_start = None
    for c in range(chunks + 1):  # chunk 0 is warm-up (and the shorter first chunk)
        if c == 1:
            if world.device.type == "cuda":
                torch.cuda.synchronize()
            t_start = time.perf_counter()
        for i in range(sessions):
            engine.submit(ChunkRequest(f"s{i}", engine.new_request_id()))
        while engine.has_work():
            for o in engine.step():
                assert isinstance(o, ChunkCommitted), o
                if c >= 1:
                    per_chunk.append(o.timings.as_dict())
                    frames += o.frames.shape[0]
    elapsed = time.perf_counter() - t_start
    stages = {k: round(sum(t[k] for t in per_chunk) / len(per_chunk), 2) for k in per_chunk[0]}
    return {
        "sessions": sessions,
        "chunks_per_session": chunks,
        "stage_ms_mean": stages,
        "fps_total": round(frames / elapsed, 2),
        "fps_per_session": round(frames / elapsed / sessions, 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--shape", choices=["mg", "sf"], nargs="+", default=["mg", "sf"])
    p.add_argument("--sessions", type=int, nargs="+", default=[1, 4])
    p.add_argument("--chunks", type=int, default=6)
    p.add_argument(
        "--tiny", action="store_true", help="scaled-down configs: checks the script, measures nothing"
    )
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    results = []
    for shape in args.shape:
        wcfg, dit, vae = shape_configs(shape, args.tiny)
        world = build_world(wcfg, dit, vae, seed=0, device=args.device, dtype=dtype)
        for n in args.sessions:
            if args.device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats()
            row = run_shape(world, n, args.chunks)
            row.update(
                shape=shape,
                resolution=f"{wcfg.height}x{wcfg.width}",
                steps=len(wcfg.schedule.steps),
                kv_bytes_per_session=world.kv_bytes_per_session(),
                published_fps_h100=PUBLISHED_FPS[shape],
            )
            if args.device.startswith("cuda"):
                row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            print(json.dumps(row))
            results.append(row)
        del world
    args.out.mkdir(parents=True, exist_ok=True)
    name = "gpu_shapes_tiny.json" if args.tiny else "gpu_shapes.json"
    meta = {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "dtype": args.dtype,
    }
    (args.out / name).write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    print(f"wrote {args.out / name}")


if __name__ == "__main__":
    main()
