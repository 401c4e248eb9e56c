"""Rewind: what a retention of R chunks costs a session, and how long a rewind takes.

For each model and R: the bytes the engine's memory owner charges one session (`world_costs`,
serial and pipelined rings: R chunks of ring slack plus R checkpoints of a decoder cache and a
plug-in state), and, serial on the CPU, the median time of `Engine.rewind_stream` back by one
chunk and by R chunks (a bare engine, one session, after 2R + 4 chunks).

    python benchmarks/rewind.py [--model tiny-world --model tiny-random] [--retention 0 2 4 8]

Prints and writes benchmarks/results/rewind.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.actions import FrameAction
from models.registry import from_name
from models.world import Conditioning, World
from runtime.engine import Engine
from runtime.memory import world_costs
from runtime.requests import ChunkRequest
from runtime.runner import ring_slack

RESULTS = Path(__file__).parent / "results"


def session_bytes(world: World, retention: int) -> dict[str, int]:
    """Bytes charged for one session, serial and pipelined."""
    n = world.chunk_frames
    return {
        mode: world_costs(world, ring_slack(n, pipe, retention), retention).session
        for mode, pipe in (("serial", False), ("pipelined", True))
    }


def rewind_ms(world: World, retention: int, repeats: int = 5) -> dict[str, float]:
    """Median ms of a rewind back by 1 and by `retention` chunks (serial engine, one session)."""
    engine = Engine({world.config.id: world}, retention=retention)
    engine.add_stream("s", world.config.id, Conditioning(seed=1))
    action = [FrameAction(frozenset({"d"}))] if "d" in world.action_space.keys else []

    def forward(chunks: int) -> None:
        for _ in range(chunks):
            engine.submit(ChunkRequest("s", engine.new_request_id(), actions=action))
            while engine.has_work():
                engine.step()

    forward(2 * retention + 4)
    out = {}
    for back in sorted({1, retention}):
        times = []
        for _ in range(repeats):
            now = engine.info("s").chunks
            start = time.perf_counter()
            engine.rewind_stream("s", now - back)
            times.append((time.perf_counter() - start) * 1000)
            forward(back)
        out[f"back_{back}"] = round(statistics.median(times), 3)
    engine.close()
    return out


def main() -> None:
    """Print and save the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", help="repeatable (default: tiny-world, tiny-random)")
    parser.add_argument("--retention", type=int, nargs="+", default=[0, 2, 4, 8])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS / "rewind.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    report: dict = {"threads": args.threads, "torch": torch.__version__, "models": {}}
    for name in args.model or ["tiny-world", "tiny-random"]:
        world = from_name(name)
        rows = {}
        for r in args.retention:
            row: dict = {"session_bytes": session_bytes(world, r)}
            if r > 0:
                row["rewind_ms"] = rewind_ms(world, r)
            rows[str(r)] = row
        report["models"][name] = {
            "checkpoint_bytes": world.checkpoint_bytes(),
            "decoder_cache_bytes": world.decoder_cache_bytes(),
            "retention": rows,
        }
    print(json.dumps(report, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
