"""``worldserve parity``: check a served model against a golden rollout of the original code.

    worldserve parity --model DIR --golden FILE.safetensors [--tolerance 1e-4] [--json OUT]

Loads the model as ``serve`` does, replays the golden file's rollout through the engine
(runtime/parity.py), prints one line per stored output (max abs difference) and a JSON summary
as the last line. Exit status: 0 every output within the tolerance, 1 above it (or an output
the replay could not produce), 2 the model or golden cannot be loaded or replayed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from web.startup import DTYPES, resolve_device

__all__ = ["register"]

DEFAULT_TOLERANCE = 1e-4  # fp32 parity bound of the golden tests


def register(commands: argparse._SubParsersAction) -> None:
    """Add the ``parity`` subcommand to the ``worldserve`` parser."""
    p = commands.add_parser("parity", help="replay a golden rollout of the original code; print differences")
    p.add_argument("--model", required=True, help="model directory (or registry name)")
    p.add_argument("--golden", type=Path, required=True, help="golden rollout .safetensors (docs/MODELS.md)")
    p.add_argument(
        "--tolerance", type=float, default=DEFAULT_TOLERANCE, help="max abs difference (default: %(default)s)"
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda, auto ... (default: %(default)s)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="(default: %(default)s)")
    p.add_argument("--json", type=Path, default=None, help="also write the JSON summary here")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Replay and report; see the module docstring for the exit status."""
    from models import registry
    from runtime import parity
    from web.app import DTYPES as TORCH_DTYPES

    try:
        golden = parity.load_golden(args.golden)
        device = resolve_device(args.device)
        world = registry.from_name(args.model, device=device, dtype=TORCH_DTYPES[args.dtype])
        result = parity.compare(golden, parity.replay(world, golden))
    except (OSError, KeyError, ValueError, RuntimeError) as exc:
        print(f"worldserve parity: {exc}", file=sys.stderr)
        return 2
    for name, diff in result.diffs.items():
        flag = "" if diff <= args.tolerance else "  ABOVE TOLERANCE"
        print(f"{name:<24} {diff:.3e}{flag}")
    for name in result.not_produced:
        print(f"{name:<24} not produced by the served path")
    summary = result.summary(
        args.tolerance, model=str(args.model), golden=str(args.golden), family=golden.family, dtype=args.dtype
    )
    text = json.dumps(summary)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")
    return 0 if summary["pass"] else 1
