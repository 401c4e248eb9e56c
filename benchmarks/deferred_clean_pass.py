"""A lockstep session through the websocket with each chunk's clean pass after its frames are sent
(`--defer-clean-pass on`, the serial default) vs before (`off`), side by side in one run.

Two `worldserve serve` processes, one per setting, the same model, seed and actions; each round
runs a lockstep session of `--steps` steps on one server, then on the other (alternating which
goes first), per codec and client think time (`--think-ms`: what the client spends between
holding a chunk's frames and sending its next step: a policy's forward, a game's frame; 0 is a
client that answers at once). Reported per setting, codec and think time: step latency (`step`
sent -> its frames decoded here) p50/p99, lockstep frames per second (the chunk's video frames
per mean step latency plus the think time), and per round the ratio of the two settings' mean step
latency (off / on; the median of those ratios is the comparison: this machine's speed drifts
within the hour).

    python benchmarks/deferred_clean_pass.py [--model tiny-world] [--steps 40] [--rounds 4]
                                             [--think-ms 0 25] [--codecs h264 raw] [--threads 1]

Prints and writes benchmarks/results/deferred_clean_pass.json.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.server_overhead import ws_latency
from benchmarks.serving import report, start_server
from models.registry import from_name

RESULTS = Path(__file__).parent / "results"
SETTINGS = ("on", "off")


async def measure(
    urls: dict[str, str], codecs: list[str], thinks: list[float], steps: int, rounds: int
) -> dict:
    cases = [(c, t) for c in codecs for t in thinks]
    lat: dict[tuple, list[float]] = {(s, c, t): [] for s in SETTINGS for c, t in cases}
    ratio: dict[tuple, list[float]] = {k: [] for k in cases}
    for url in urls.values():  # warm-up: first-use costs on both servers
        for c in codecs:
            await ws_latency(url, c, 4)
    for r in range(rounds):
        order = SETTINGS if r % 2 == 0 else SETTINGS[::-1]
        for c, t in cases:
            means = {}
            for s in order:
                got = await ws_latency(urls[s], c, steps, t)
                lat[s, c, t] += got
                means[s] = statistics.mean(got)
            ratio[c, t].append(means["off"] / means["on"])
            line = ", ".join(f"{s} {means[s]:.1f} ms" for s in SETTINGS)
            print(f"round {r + 1}/{rounds} {c} think {t:g} ms: step latency {line}")
    return {"latency": lat, "ratio": ratio}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny-world")
    parser.add_argument("--steps", type=int, default=40, help="lockstep steps per session")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="the engine thread's torch threads")
    parser.add_argument("--codecs", nargs="+", default=["h264", "raw"], choices=["h264", "jpeg", "raw"])
    parser.add_argument("--think-ms", nargs="+", type=float, default=[0.0, 25.0], help="client think times")
    parser.add_argument("--out", type=Path, default=RESULTS / "deferred_clean_pass.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    world = from_name(args.model)
    frames = world.layout.video_frames(world.start_frames + world.chunk_frames, world.chunk_frames)
    procs = {s: start_server(args.model, args.threads, "--defer-clean-pass", s) for s in SETTINGS}
    try:
        urls = {s: url for s, (_, url) in procs.items()}
        got = asyncio.run(measure(urls, args.codecs, args.think_ms, args.steps, args.rounds))
    finally:
        for proc, _ in procs.values():
            proc.terminate()
            proc.wait(60)
    paths, ratios, runs = {}, {}, {}
    for (s, c, t), ms in got["latency"].items():
        paths[f"{s}/{c}/think{t:g}"] = {
            "step_latency_ms_p50": round(float(np.percentile(ms, 50)), 2),
            "step_latency_ms_p99": round(float(np.percentile(ms, 99)), 2),
            "lockstep_fps": round(frames * 1000 / (statistics.mean(ms) + t), 2),
        }
    for (c, t), r in got["ratio"].items():
        ratios[f"{c}/think{t:g}"] = round(statistics.median(r), 3)
        runs[f"{c}/think{t:g}"] = [round(x, 3) for x in r]
    report(
        args.out,
        "deferred_clean_pass",
        model=world.spec.id,
        video_frames_per_chunk=frames,
        engine_threads=args.threads,
        steps=args.steps,
        rounds=args.rounds,
        think_ms=args.think_ms,
        paths=paths,
        step_latency_ratio_off_to_on=ratios,
        step_latency_ratio_off_to_on_runs=runs,
    )


if __name__ == "__main__":
    main()
