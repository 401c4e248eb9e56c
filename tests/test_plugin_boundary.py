"""The plug-in seam holds: no general module imports the tiny world (or its game) or names one of
its concepts. Everything only the built-in world uses lives in models/tiny_world/ (and its game,
models/game/) behind `models.plugin.WorldPlugin`; runtime/, sessions/, web/ and the rest of
models/ go through the seam.

Identifiers are split into words (snake_case and CamelCase) and none may be a tiny-world word;
imports may not reach models.tiny_world or models.game. `EXCEPTIONS` lists, per file, what is
allowed and why; anything else fails with the file, line and name.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("runtime", "sessions", "web", "models")
OWN = ("models/tiny_world", "models/game")  # the built-in world's packages: not scanned
WORDS = frozenset(
    {
        "gate",
        "gates",
        "atlas",
        "atlases",
        "cartographer",
        "terrain",
        "carry",
        "carried",
        "marker",
        "markers",
        "sprite",
        "sprites",
        "wall",
        "walls",
        "palette",
        "game",
    }
)
FORBIDDEN_IMPORTS = ("models.tiny_world", "models.game")
# Other families' names that contain a word above without meaning it.
FAMILY_NAMES = re.compile(r"matrix_?game|MatrixGame", re.IGNORECASE)

# file -> {identifier or import: why it is allowed}
EXCEPTIONS: dict[str, dict[str, str]] = {
    "models/causal_wan.py": {
        # Wan's adaptive-norm gates (scale, shift, gate per block): the DiT's own word, not the key gate.
        "gate": "Wan's AdaLN gate",
        "c_gate": "Wan's AdaLN gate",
    },
}


def words(name: str) -> set[str]:
    """The lower-case words of an identifier (snake_case and CamelCase)."""
    name = FAMILY_NAMES.sub("", name)
    parts = re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+", name)
    return {p.lower() for p in parts}


def names(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, identifier) of every name a module defines or uses."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            out.append((node.lineno, node.id))
        elif isinstance(node, ast.Attribute):
            out.append((node.lineno, node.attr))
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out.append((node.lineno, node.name))
        elif isinstance(node, ast.arg):
            out.append((node.lineno, node.arg))
        elif isinstance(node, ast.keyword) and node.arg is not None:
            out.append((node.value.lineno, node.arg))
        elif isinstance(node, ast.alias):
            out.append((getattr(node, "lineno", 0), (node.asname or node.name).split(".")[-1]))
    return out


def imports(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every import."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.append((node.lineno, node.module))
    return out


def general_modules() -> list[Path]:
    files = [p for d in SCANNED for p in (ROOT / d).rglob("*.py")]
    return sorted(p for p in files if not str(p.relative_to(ROOT)).startswith(OWN))


def violations(path: Path, rel: str | None = None) -> list[str]:
    """What `path` (the repository's file `rel`, by default where it lies) names or imports of
    the built-in world, less its `EXCEPTIONS`."""
    rel = rel or str(path.relative_to(ROOT))
    allowed = EXCEPTIONS.get(rel, {})
    tree = ast.parse(path.read_text(), filename=rel)
    found = []
    for line, module in imports(tree):
        if module.startswith(FORBIDDEN_IMPORTS) and module not in allowed:
            found.append(f"{rel}:{line}: imports {module}")
    for line, name in names(tree):
        bad = words(name) & WORDS
        if bad and name not in allowed:
            found.append(f"{rel}:{line}: {name} ({', '.join(sorted(bad))})")
    return sorted(set(found))


def test_words_split_identifiers_and_skip_other_families_names():
    assert words("KeyGate") == {"key", "gate"} and words("carry_channels") == {"carry", "channels"}
    assert words("load_matrix_game") == {"load"} and words("MGActionConfig") == {"mg", "action", "config"}
    assert words("gated") & WORDS == set()  # whole words only


def test_the_scan_catches_a_tiny_world_name_and_import(tmp_path: Path):
    bad = tmp_path / "probe.py"
    bad.write_text("from models.tiny_world.atlas import Atlas\n\nlast_atlas = Atlas\n")
    found = violations(bad, "runtime/probe.py")
    assert any("imports models.tiny_world.atlas" in v for v in found)
    assert any("last_atlas (atlas)" in v for v in found)


def test_no_general_module_names_the_tiny_world():
    found = [v for p in general_modules() for v in violations(p)]
    assert not found, "tiny-world concepts outside models/tiny_world/:\n" + "\n".join(found)


def test_every_exception_is_still_needed():
    """An exception nobody uses any more is dropped, so the list shows what is left to move."""
    for rel, allowed in EXCEPTIONS.items():
        tree = ast.parse((ROOT / rel).read_text())
        used = {m for _, m in imports(tree)} | {n for _, n in names(tree)}
        assert set(allowed) <= used, f"{rel}: unused exceptions {sorted(set(allowed) - used)}"
