"""What a batch's atlases cost per chunk: `Cartographer.recall` for N sessions at once against
one session at a time (how it ran before), N = 1, 2, 4, 8, on this machine's CPU.

    python benchmarks/atlas_recall.py [--model tiny-world|DIR] [--trials 15]

The sessions' atlases, latest frames and planned phases are real: 8 tiny-world streams walk a
random policy through the Engine for a few chunks, and the last chunk's recall inputs are kept.
Each trial times both ways back to back at every N (alternating, so background load hits both
alike); the figure of merit is the ratio of the medians (this machine's speed drifts by up to 2x
between hours, so only ratios from one run are comparable). Also checks that both ways give
the same cells and masks. Prints and writes benchmarks/results/atlas_recall.json (or --out).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.serving import report
from benchmarks.tiny_world_eval import EVAL_SEED_BASE, batched
from models.game import random_policy
from models.registry import from_name
from models.tiny_world.atlas import Atlas, Cartographer
from runtime.engine import Engine

SESSIONS = 8


def capture(model: str, chunks: int) -> tuple[Cartographer, tuple[Atlas, torch.Tensor, torch.Tensor]]:
    """Run `SESSIONS` streams `chunks` chunks; return the world's cartographer and the inputs of
    the last batched recall (the batch's atlases, latest frames and phases)."""
    world = from_name(model)
    carto = world.plugin.cartographer
    if carto is None or carto.prior is None:
        raise SystemExit(f"{model} keeps no atlases with a terrain prior")
    seen: list[tuple[Atlas, torch.Tensor, torch.Tensor]] = []
    recall = carto.recall

    def keep(atlas: Atlas, last: torch.Tensor, phases: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append((atlas, last, phases))
        return recall(atlas, last, phases)

    carto.recall = keep  # type: ignore[method-assign]
    engine = Engine({world.config.id: world}, max_batch=SESSIONS, max_streams=SESSIONS)
    seeds = [EVAL_SEED_BASE + 40000 + i for i in range(SESSIONS)]
    frames = chunks * world.chunk_frames * world.layout.frames_per_latent
    batched(engine, world.config.id, seeds, [random_policy(s, frames) for s in seeds], SESSIONS)
    carto.recall = recall  # type: ignore[method-assign]
    full = [x for x in seen if x[1].shape[0] == SESSIONS]
    if not full:
        raise SystemExit("no chunk ran all sessions in one batch")
    return carto, full[-1]


def part(atlas: Atlas, rows: slice) -> Atlas:
    """The sessions `rows` of a batch of atlases."""
    return Atlas(*(getattr(atlas, f.name)[rows] for f in fields(Atlas)))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny-world", help="registry name or model directory")
    parser.add_argument("--chunks", type=int, default=12, help="chunks the sessions walk first")
    parser.add_argument("--trials", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parent / "results" / "atlas_recall.json"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    carto, (atlas, last, phases) = capture(args.model, args.chunks)

    def together(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return carto.recall(part(atlas, slice(0, n)), last[:n], phases[:n])[:2]

    def one_by_one(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        out = [
            carto.recall(part(atlas, slice(i, i + 1)), last[i : i + 1], phases[i : i + 1]) for i in range(n)
        ]
        return torch.cat([c for c, _, _ in out]), torch.cat([m for _, m, _ in out])

    a, b = together(SESSIONS), one_by_one(SESSIONS)
    same = bool(torch.equal(a[1], b[1]) and torch.allclose(a[0], b[0], atol=1e-5))
    sizes = (1, 2, 4, SESSIONS)
    times: dict[str, dict[int, list[float]]] = {
        "together": {n: [] for n in sizes},
        "one_by_one": {n: [] for n in sizes},
    }
    for _ in range(args.trials):
        for n in sizes:
            for name, run in (("together", together), ("one_by_one", one_by_one)):
                t = time.perf_counter()
                run(n)
                times[name][n].append((time.perf_counter() - t) * 1000)
    rows = {
        n: {
            "together_ms": round(statistics.median(times["together"][n]), 2),
            "one_by_one_ms": round(statistics.median(times["one_by_one"][n]), 2),
            "speedup": round(
                statistics.median(times["one_by_one"][n]) / statistics.median(times["together"][n]), 2
            ),
        }
        for n in sizes
    }
    report(
        args.out,
        "atlas_recall",
        model=args.model,
        threads=args.threads,
        trials=args.trials,
        same_cells_and_masks=same,
        by_sessions=rows,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
