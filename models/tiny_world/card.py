"""Print the model card's file table (path, bytes, sha256) for a model directory.

    python -m models.tiny_world.card [DIR]      # default: the shipped weights

The rows go under "Files" in MODEL_CARD.md; tests/models/tiny_world/test_shipped.py checks them.
"""

from __future__ import annotations

import argparse
import hashlib
from collections.abc import Sequence
from pathlib import Path

from models.tiny_world import WEIGHTS_DIR


def file_rows(root: Path) -> list[tuple[str, int, str]]:
    """(relative path, bytes, sha256 hex) of every file under `root`, sorted by path."""
    rows = []
    for p in sorted(root.rglob("*")):
        if p.is_file():
            data = p.read_bytes()
            rows.append((str(p.relative_to(root)), len(data), hashlib.sha256(data).hexdigest()))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m models.tiny_world.card", description=__doc__.split("\n")[0]
    )
    parser.add_argument("dir", type=Path, nargs="?", default=WEIGHTS_DIR, help="model directory")
    args = parser.parse_args(argv)
    print("| file | bytes | sha256 |")
    print("| --- | ---: | --- |")
    for name, size, sha in file_rows(args.dir):
        print(f"| `{name}` | {size} | `{sha}` |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
