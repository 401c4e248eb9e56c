"""Speed of the tiny world through the Engine: one session on this machine's CPU, decode included.

    python benchmarks/tiny_world_speed.py [--model tiny-world|DIR] [--chunks 60] [--trials 3]
                                          [--against DIR]

Writes --out/tiny_world_speed.json with:

* `first_frame_ms`: `add_stream` (the session's open: start image, encode, KV allocation, the
  start frame prefilled and decoded) — what a client waits for after `open` (`ready.frame`);
* `frames_per_second`: committed video frames per wall second over `--chunks` lockstep chunks,
  submitted one at a time as a realtime client would (the next chunk is asked for when the
  previous one has arrived), plus each stage's mean milliseconds per chunk (`context` is 0:
  the engine runs a chunk's clean pass after its commit, in a step of its own, which the
  frames per second count; docs/ENGINE.md);
* `action_response`: in a fresh session, after two idle chunks, one chunk holds "d"; the number
  of chunks until the view visibly scrolls (0 = the very chunk that carried the key) and that
  chunk's submit-to-commit ms.
* with `--against`: the other model's trials, alternating with these in the same run, and the
  ratio of the two medians (the only speed comparison this machine supports: its speed drifts
  by up to 2x between hours).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.actions import FrameAction
from models.registry import from_name
from models.tiny_world.metrics import player_centroid, scroll_offset
from models.world import Conditioning
from runtime.engine import Engine
from runtime.requests import ChunkCommitted, ChunkRequest


def run_chunk(engine: Engine, sid: str, actions: list[FrameAction] | None) -> ChunkCommitted:
    """Submit one chunk and step until it commits."""
    engine.submit(ChunkRequest(sid, engine.new_request_id(), actions=actions))
    done = None
    while engine.has_work():
        for o in engine.step():
            if isinstance(o, ChunkCommitted):
                done = o
            else:
                raise RuntimeError(f"chunk did not commit: {o}")
    assert done is not None
    return done


def trial(engine: Engine, model_id: str, seed: int, chunks: int) -> dict:
    """One session: its open time, then `chunks` lockstep chunks of random held keys (frames per
    second and stage means); then the action response in a fresh session of the same seed."""
    sid = f"speed-{seed}"
    t0 = time.perf_counter()
    engine.add_stream(sid, model_id, Conditioning(seed=seed))
    first_ms = (time.perf_counter() - t0) * 1000
    rng = np.random.default_rng(seed)
    keys = ["w", "a", "s", "d"]
    stages: dict[str, list[float]] = {}
    n_frames = 0
    t1 = time.perf_counter()
    for _ in range(chunks):
        out = run_chunk(engine, sid, [FrameAction(frozenset({keys[int(rng.integers(4))]}))])
        n_frames += out.frames.shape[0]
        for k, v in out.timings.as_dict().items():
            stages.setdefault(k, []).append(v)
    wall = time.perf_counter() - t1
    engine.remove_stream(sid)
    response_chunks, response_ms = action_response(engine, model_id, seed)
    return {
        "seed": seed,
        "first_frame_ms": first_ms,
        "frames": n_frames,
        "wall_s": wall,
        "frames_per_second": n_frames / wall,
        "stage_ms_mean": {k: statistics.mean(v) for k, v in stages.items()},
        "response_chunks": response_chunks,
        "response_ms": response_ms,
    }


def action_response(engine: Engine, model_id: str, seed: int) -> tuple[int | None, float | None]:
    """Chunks until one held "d" visibly moves the view or the sprite (0 = the very chunk that
    carried the key) and that chunk's submit-to-commit ms; None when it never does in 4 chunks.
    A fresh session, two idle chunks in, so it times the response on the world as it starts
    (after minutes of play the measure would be of the world's drift, not of the latency)."""
    sid = f"response-{seed}"
    engine.add_stream(sid, model_id, Conditioning(seed=seed))
    last = None
    for _ in range(2):
        last = run_chunk(engine, sid, [FrameAction.idle()])
    prev = last.frames[-1]
    response_chunks, response_ms = None, None
    for k in range(4):
        t2 = time.perf_counter()
        out = run_chunk(engine, sid, [FrameAction(frozenset({"d"}))] if k == 0 else [FrameAction.idle()])
        ms = (time.perf_counter() - t2) * 1000
        moved = False
        for f in out.frames:
            dx, _ = scroll_offset(prev, f, radius=3, ignore=player_centroid(prev) or (32.0, 32.0))
            c0, c1 = player_centroid(prev), player_centroid(f)
            sprite_dx = 0.0 if c0 is None or c1 is None else c1[0] - c0[0]
            if dx > 0 or sprite_dx >= 1.0:
                moved = True
                break
        prev = out.frames[-1]
        if moved:
            response_chunks, response_ms = k, ms
            break
    engine.remove_stream(sid)
    return response_chunks, response_ms


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny-world", help="registry name or model directory")
    parser.add_argument("--chunks", type=int, default=60, help="steady-state chunks per trial")
    parser.add_argument("--trials", type=int, default=3, help="sessions, one after another")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--tag", default="")
    parser.add_argument(
        "--against",
        default=None,
        help="another model (name or directory): its trials alternate with --model's in this run, "
        "and the JSON gets the ratio of their median frames per second",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)

    t0 = time.perf_counter()
    world = from_name(args.model)
    load_ms = (time.perf_counter() - t0) * 1000
    mid = world.config.id
    engine = Engine({mid: world})
    trial(engine, mid, 999, 4)  # warm-up (allocator, first-call overheads)
    other = None
    if args.against:  # side by side: the machine's speed drifts by up to 2x between hours
        other = Engine({mid: from_name(args.against)})
        trial(other, mid, 999, 4)
    trials, other_trials = [], []
    for i in range(args.trials):
        trials.append(trial(engine, mid, 1_000_000 + i, args.chunks))
        if other is not None:
            other_trials.append(trial(other, mid, 1_000_000 + i, args.chunks))
    fps = [t["frames_per_second"] for t in trials]
    first = [t["first_frame_ms"] for t in trials]
    per_chunk = world.chunk_frames * world.layout.frames_per_latent
    results = {
        "model": args.model,
        "machine": {
            "cpu_threads": torch.get_num_threads(),
            "processor": platform.processor() or platform.machine(),
            "torch": torch.__version__,
        },
        "world": {"chunk_video_frames": per_chunk, "schedule": world.config.schedule.__dict__},
        "load_ms": load_ms,
        "frames_per_second": {"median": statistics.median(fps), "min": min(fps), "max": max(fps)},
        "first_frame_ms": {"median": statistics.median(first), "max": max(first)},
        "action_response_chunks": [t["response_chunks"] for t in trials],
        "action_response_ms": [t["response_ms"] for t in trials],
        "chunk_ms_at_30fps_budget": 1000 * per_chunk / 30,
        "trials": trials,
        "targets": {
            "fps_ge_30": statistics.median(fps) >= 30,
            "first_frame_le_1s": max(first) <= 1000,
            "response_within_one_chunk": all(t["response_chunks"] == 0 for t in trials),
        },
    }
    if other_trials:
        other_fps = [t["frames_per_second"] for t in other_trials]
        results["against"] = {
            "model": args.against,
            "frames_per_second": {"median": statistics.median(other_fps), "runs": other_fps},
            "fps_ratio": statistics.median(fps) / statistics.median(other_fps),
            "stage_ms_mean": {
                k: statistics.mean(t["stage_ms_mean"][k] for t in other_trials)
                for k in trials[0]["stage_ms_mean"]
            },
        }
        print(f"against {args.against}: fps ratio {results['against']['fps_ratio']:.3f}")
    args.out.mkdir(parents=True, exist_ok=True)
    tag = f"_{args.tag}" if args.tag else ""
    path = args.out / f"tiny_world_speed{tag}.json"
    path.write_text(json.dumps(results, indent=2))
    print(json.dumps({k: results[k] for k in ("frames_per_second", "first_frame_ms", "targets")}, indent=1))
    print(f"stage ms per chunk: {trials[0]['stage_ms_mean']}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
