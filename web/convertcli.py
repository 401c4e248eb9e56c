"""``worldserve convert``: turn published checkpoints into a model directory (see docs/MODELS.md).

    worldserve convert --from self-forcing|matrix-game-2|fastvideo SRC... [--config FILE] --out DIR

SRC: the transformer checkpoint (Self-Forcing `self_forcing_dmd.pt`, Matrix-Game
`*_distill.safetensors`, or a FastVideo "-Diffusers" directory), optionally `Wan2.1_VAE.pth` and
(Matrix-Game) `models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth`, in any order: each file
is recognised by its keys. This module only parses arguments and reports; models/convert does
the work (no tensors here; its modules load only once the command runs).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from models.convert.kinds import KINDS

__all__ = ["register"]


def register(commands: argparse._SubParsersAction) -> None:
    """Add the ``convert`` subcommand to the ``worldserve`` parser."""
    p = commands.add_parser("convert", help="convert original checkpoints into a model directory")
    p.add_argument("--from", dest="kind", required=True, choices=KINDS, help="checkpoint family / layout")
    p.add_argument("sources", nargs="+", type=Path, metavar="SRC", help="checkpoint files or directories")
    p.add_argument(
        "--config", type=Path, default=None, help="original config.json (default: the published one)"
    )
    p.add_argument("--out", type=Path, required=True, help="model directory to create (must not exist)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Convert; print what was written and what serving it still needs. Exit 2 on failure."""
    from models.convert.keymap import ConversionError
    from models.convert.output import convert_sources, load_config_file, write

    try:
        conv = convert_sources(
            args.kind, list(args.sources), load_config_file(args.config), progress=not args.no_progress
        )
        out = write(conv, args.out, progress=not args.no_progress)
    except (ConversionError, OSError) as exc:
        hint = ""
        if "mis-shaped" in str(exc) and args.config is None:
            hint = " (sizes differ from the published config; pass --config)"
        print(f"worldserve convert: {exc}{hint}; nothing was written", file=sys.stderr)
        return 2
    size = f"{conv.inference['width']}x{conv.inference['height']}"  # said, as --config can change it
    print(f"worldserve convert: wrote {conv.family} ({conv.variant}, {size} frames) to {out}")
    if conv.requires:
        print(f"worldserve convert: serving it still needs: {', '.join(conv.requires)} (docs/MODELS.md)")
    return 0
