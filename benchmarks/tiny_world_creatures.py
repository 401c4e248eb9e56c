"""The tiny world's creatures against the game's, on more worlds than the eval's long rollouts.

    python benchmarks/tiny_world_creatures.py [--model tiny-world|DIR] [--worlds 16] [--frames 512]
                                              [--tag TAG] [--threads 1]

The eval's creature rollouts (`tiny_world_eval.creature_rollouts`, 48 worlds of 512 frames there)
on their own, for other counts and lengths: the random policy on held-out worlds (the eval's
long-rollout seeds and those after them) through the Engine. Prints and saves
benchmarks/results/tiny_world_creatures[_TAG].json: creature pixels a frame by 64-frame segment
(model, game), the share of frames in which each shows a creature (at least a sixth of one in
view), and the eval's figure, the share of the frames where the game shows one in which the
model does too (`creature_presence`). The eval's figure counts presence only: a model that
shows creatures more often than the game scores higher, so the two shares say whether the
model's creatures are as many as the game's.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.tiny_world_eval import creature_rollouts
from models.registry import from_name
from runtime.engine import Engine


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny-world", help="registry name or model directory")
    parser.add_argument("--worlds", type=int, default=16)
    parser.add_argument("--frames", type=int, default=512, help="frames per rollout (a multiple of 4)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tag", default="")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    world = from_name(args.model)
    engine = Engine({"m": world}, max_batch=8, max_streams=16)
    result = {"model": args.model} | creature_rollouts(engine, "m", args.worlds, args.frames, 8)
    print(json.dumps(result, indent=2))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"tiny_world_creatures{'_' + args.tag if args.tag else ''}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
