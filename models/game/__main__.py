"""CLI: write the simulator's frames for a seed and an action script.

    python -m models.game --seed 3 --actions "d*16,a*16,w*8,,space" --size 64 --out DIR
    python -m models.game --seed 3 --actions moves.json --out DIR    # [["d"], ["d", "w"], [], ...]
    python -m models.game --seed 3 --random 64 --out DIR             # the training policy

``--actions`` takes an action script (syntax in ``models.game.actions``) or the path of a JSON
file (name ending in ``.json``) holding a list with one list of key names per frame. It writes
``DIR/frame_00000.png`` .. (frame 0 is the initial frame, frame i follows action i - 1) and
``DIR/sim.npz`` with
``frames`` (N+1, H, W, 3) uint8, ``player_pos`` (N+1, 2) float64 screen pixels,
``player_world_pos`` (N+1, 2) float64 world units, ``actions`` (N, 5) float32 multi-hot in
``KEYS`` order, and ``seed``, ``fps``, ``script`` (the actions as an action script).
"""

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image

from models.game.actions import (
    KEYS,
    check_keys,
    encode_actions,
    format_action_script,
    parse_action_script,
    random_policy,
)
from models.game.simulator import GameConfig, simulate


def load_actions(spec: str) -> list[frozenset[str]]:
    """Actions from a ``.json`` file (a list of key-name lists) or else from an action script."""
    if spec.endswith(".json"):
        frames = json.loads(Path(spec).read_text())
        if not isinstance(frames, list) or not all(isinstance(f, list) for f in frames):
            raise ValueError(f"{spec}: expected a JSON list of key-name lists, one per frame")
        return [check_keys(f) for f in frames]
    return parse_action_script(spec)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments, simulate, write PNGs and sim.npz, print what was written."""
    parser = argparse.ArgumentParser(prog="python -m models.game", description="Write simulator frames.")
    parser.add_argument("--seed", type=int, required=True, help="world seed")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--actions", help=f"action script (keys {', '.join(KEYS)}) or a .json file")
    source.add_argument("--random", type=int, metavar="N", help="N frames of random_policy(seed)")
    parser.add_argument("--size", type=int, default=64, help="frame height and width in pixels")
    parser.add_argument("--out", type=Path, required=True, help="output directory (created)")
    parser.add_argument("--no-png", action="store_true", help="write only sim.npz")
    args = parser.parse_args(argv)

    try:
        actions = (
            random_policy(args.seed, args.random) if args.actions is None else load_actions(args.actions)
        )
    except (ValueError, OSError) as err:
        parser.error(str(err))
    config = GameConfig(size=args.size)
    result = simulate(args.seed, actions, config)

    args.out.mkdir(parents=True, exist_ok=True)
    if not args.no_png:
        for i, frame in enumerate(result.frames):
            Image.fromarray(frame).save(args.out / f"frame_{i:05d}.png")
        print(f"wrote {len(result.frames)} frames to {args.out / 'frame_*.png'}")
    npz = args.out / "sim.npz"
    np.savez_compressed(
        npz,
        frames=result.frames,
        player_pos=result.player_pos,
        player_world_pos=result.player_world_pos,
        actions=encode_actions(actions),
        seed=np.int64(args.seed),
        fps=np.int64(config.fps),
        script=np.str_(format_action_script(actions)),
    )
    print(f"wrote {npz}: frames {result.frames.shape}, {len(actions)} actions, seed {args.seed}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
