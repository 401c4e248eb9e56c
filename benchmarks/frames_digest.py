"""sha256 of a world's engine frames: the before/after check of a change that must not move a bit.

One session (seed 7, the key script of benchmarks/reproducibility.py) runs on a bare `Engine`,
alone and in a batch of 3 (two mates, one forward for all), for each model named; the script
prints and saves the sha256 of each run's frames. Run it on two commits with the same torch
threads and compare the JSON:

    python benchmarks/frames_digest.py [--model tiny-world --model tiny-random] [--chunks 8] \
        [--out benchmarks/results/frames_digest.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.reproducibility import run
from models.registry import from_name

RESULTS = Path(__file__).parent / "results"


def digests(model: str, chunks: int) -> dict[str, str]:
    """sha256 of the session's frames alone and in a batch of 3."""
    world = from_name(model)
    alone = run(world, 0, chunks, max_batch=1)
    batched = run(world, 2, chunks, max_batch=4)
    return {
        "alone": hashlib.sha256(alone.tobytes()).hexdigest(),
        "batch_of_3": hashlib.sha256(batched.tobytes()).hexdigest(),
    }


def main() -> None:
    """Print and save the digests."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", help="repeatable (default: tiny-world, tiny-random)")
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS / "frames_digest.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
    report = {
        "commit": commit.strip(),
        "chunks": args.chunks,
        "threads": args.threads,
        "torch": torch.__version__,
        "digests": {m: digests(m, args.chunks) for m in args.model or ["tiny-world", "tiny-random"]},
    }
    print(json.dumps(report, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
