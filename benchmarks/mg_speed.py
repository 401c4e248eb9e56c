"""Speed of a served Matrix-Game 2.0 world (the converted model: I2V + the original action module).

One prepared command for a lent GPU (random weights at the published universal size: FLOPs do not
depend on them; bf16), and its CPU check at a tiny size (same code path, measures nothing):

    python benchmarks/mg_speed.py --out $OUT/mg_speed.json                    # a few minutes
    python benchmarks/mg_speed.py --device cpu --tiny --out /tmp/mg_speed.json

Rows, each written as soon as it is done: `open_ms` (one session's start: crop/resize, CLIP,
VAE-encoding the conditioning frames, image K/V), then N sessions through a bare `Engine`
(`benchmarks.gpu_shapes.engine_run`: per-stage ms per chunk, frames/s in total and per
session, Wan VAE decode included) for N = 1, 4, 8, eager and with CUDA graphs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diffusers import AutoencoderKLWan

from benchmarks.gpu_shapes import compile_world, engine_run, sync
from models.causal_wan import CausalWan
from models.convert import matrix_game, wan_vae
from models.matrix_game.clip_vision import CLIPVision, CLIPVisionConfig
from models.matrix_game.loader import build_world, transformer_config
from models.world import Conditioning, World

TINY_ORIGINAL = matrix_game.PUBLISHED["universal"] | {
    "dim": 64,
    "ffn_dim": 128,
    "freq_dim": 32,
    "num_heads": 2,
    "num_layers": 2,
    "action_config": matrix_game.PUBLISHED["universal"]["action_config"]
    | {"blocks": [0], "heads_num": 2, "hidden_size": 16, "img_hidden_size": 64}
    | {"keyboard_hidden_dim": 128, "mouse_hidden_dim": 128},
}


def make_world(tiny: bool, device: torch.device, dtype: torch.dtype) -> World:
    """The universal variant with random weights (tiny: a 2-layer DiT, small VAE and CLIP, 32x48)."""
    meta = {
        "variant": "universal",
        "original": TINY_ORIGINAL if tiny else matrix_game.PUBLISHED["universal"],
        "inference": matrix_game.INFERENCE["universal"] | {"cond_frames": matrix_game.COND_FRAMES},
    }
    vae_cfg = wan_vae.diffusers_config()
    clip_cfg = CLIPVisionConfig()
    if tiny:
        meta["inference"] = meta["inference"] | {"clip_tokens": 5}
        meta["world"] = {"height": 32, "width": 48}
        vae_cfg = {"base_dim": 8, "z_dim": 16, "dim_mult": [1, 2, 4], "num_res_blocks": 1}
        vae_cfg |= {"temperal_downsample": [True, True], "scale_factor_spatial": 4}
        clip_cfg = CLIPVisionConfig(image_size=28, num_layers=2, mlp_ratio=1.0)
    torch.manual_seed(0)
    with torch.device(device):
        transformer = CausalWan(transformer_config(meta))
        vae = AutoencoderKLWan(**vae_cfg)
        clip = CLIPVision(clip_cfg)
    picture = np.random.default_rng(0).integers(0, 256, (352, 640, 3), dtype=np.uint8)
    return build_world(
        meta, transformer.eval(), vae.eval(), clip, device, dtype, start_image=lambda seed: picture
    )


def open_ms(world: World, reps: int) -> float:
    """Milliseconds of one session's start (`init_state`: the image conditioning)."""
    world.setup(8)
    times = []
    for i in range(reps):
        sync(world.device)
        t0 = time.perf_counter()
        state = world.init_state(Conditioning(seed=i))
        sync(world.device)
        times.append((time.perf_counter() - t0) * 1000)
        world.release_state(state)
    return round(min(times), 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--chunks", type=int, default=6, help="measured chunks per session per run")
    p.add_argument("--budget-s", type=float, default=420.0, help="stop starting new runs after this")
    p.add_argument("--tiny", action="store_true", help="tiny sizes: checks the script, measures nothing")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "mg_speed.json")
    args = p.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    start = time.perf_counter()
    meta = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "dtype": args.dtype,
        "torch": torch.__version__,
        "tiny": args.tiny,
        "command": " ".join(sys.argv),
    }
    world = make_world(args.tiny, device, dtype)
    results: list[dict] = [{"kind": "open", "open_ms": open_ms(world, 3)}]
    print(json.dumps(results[-1]), flush=True)
    runs = [("eager", 1), ("eager", 4), ("graphs", 1), ("graphs", 4), ("eager", 8), ("graphs", 8)]
    if args.tiny:  # on a CPU: no CUDA graphs; inductor compiles slowly
        runs = [("eager", 1), ("eager", 2), ("compiled", 1)]
    mode_now = "eager"
    for mode, n in runs:
        row: dict = {"kind": "engine", "mode": mode, "sessions": n}
        if time.perf_counter() - start > args.budget_s:
            results.append(row | {"skipped": "time budget spent"})
            continue
        t_run = time.perf_counter()
        try:
            if mode != mode_now:
                compile_world(world, mode, (1, 2, 4, 8))
                mode_now = mode
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            with torch.no_grad():
                row |= engine_run(world, n, args.chunks)
            if device.type == "cuda":
                row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        except Exception as exc:  # one failing row must not lose the others
            row["error"] = f"{type(exc).__name__}: {exc}"[:500]
        row["wall_s"] = round(time.perf_counter() - t_run, 1)
        print(json.dumps(row), flush=True)
        results.append(row)
        args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=2))


if __name__ == "__main__":
    main()
