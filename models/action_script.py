"""Action scripts: a compact text form of per-frame key input, for the command line and tests.

No torch here (the game and the CLI's argument checks import it)."""

from __future__ import annotations

from collections.abc import Sequence


def parse_action_script(script: str, keys: Sequence[str] | None = None) -> list[frozenset[str]]:
    """One key set per frame from an action script: comma-separated items, each the keys held
    together joined by ``+`` (empty: an idle frame), optionally ``*count`` to repeat it;
    whitespace is ignored (``"d*16,a*16"``, ``"w+d*8,,space"``, ``"*30"``). ``keys``: the names
    allowed (None: any name; the world's action space checks them later). ValueError names the
    bad item."""
    text = "".join(script.split())
    if not text:
        return []
    actions: list[frozenset[str]] = []
    for n, item in enumerate(text.split(",")):
        keys_text, star, count_text = item.partition("*")
        if star and not count_text.isdigit():
            raise ValueError(f"item {n} ({item!r}): '*' must be followed by a count")
        held = frozenset(keys_text.split("+") if keys_text else ())
        unknown = sorted(held - set(keys)) if keys is not None else []
        if unknown or "" in held:
            valid = f"; valid keys are {list(keys)}" if keys is not None else ""
            raise ValueError(f"item {n} ({item!r}): unknown key(s) {unknown or ['']}{valid}")
        actions.extend([held] * (int(count_text) if star else 1))
    return actions
