"""Actions for the built-in game: key names, multi-hot encoding, action scripts, random policy.

An action is the set of keys held during one frame (a ``frozenset`` of names from ``KEYS``).
A sequence of actions drives ``simulate``; ``actions[i]`` produces frame ``i + 1``.

Action-script syntax (the CLI's ``--actions``; ``parse_action_script`` / ``format_action_script``)::

    script := ""                       # no frames at all
            | item ("," item)*         # one item per comma, items run in order
    item   := keys | keys "*" count    # "*count" repeats the item count times (count >= 0)
    keys   := ""                       # empty: no key held, one idle frame
            | key ("+" key)*           # keys held together in the same frame
    key    := "w" | "a" | "s" | "d" | "space"

Whitespace is ignored. Examples: ``"d*16,a*16"`` walks right 16 frames then left 16;
``"w+d*8,,space"`` walks up-right 8 frames, idles 1 frame, presses space for 1 frame;
``"*30"`` idles 30 frames.

``random_policy`` is the training-data policy: keys are *held* for random durations (as a
person plays), not resampled every frame, so the data shows sustained motion, stops, diagonals
and occasional space presses.
"""

from collections.abc import Iterable, Sequence

import numpy as np

from models import action_script

# The action space, in multi-hot order (index i of an encoded action is KEYS[i]).
KEYS: tuple[str, ...] = ("w", "a", "s", "d", "space")

# Movement keys only; the random policy picks among these for held motion.
MOVE_KEYS: tuple[str, ...] = ("w", "a", "s", "d")

# Perpendicular pairs (diagonals); opposite pairs cancel out and would only look like idling.
_DIAGONALS: tuple[tuple[str, str], ...] = (("w", "a"), ("w", "d"), ("s", "a"), ("s", "d"))


def check_keys(keys: Iterable[str]) -> frozenset[str]:
    """Return ``keys`` as a frozenset, raising ValueError on a name not in ``KEYS``.

    A bare string is one key name (``"space"``), not a set of one-letter keys.
    """
    held = frozenset([keys] if isinstance(keys, str) else keys)
    unknown = held.difference(KEYS)
    if unknown:
        raise ValueError(f"unknown key(s) {sorted(unknown)}; valid keys are {list(KEYS)}")
    return held


def encode_actions(actions: Sequence[Iterable[str]]) -> np.ndarray:
    """Multi-hot encode actions: (N, len(KEYS)) float32, column order as in ``KEYS``."""
    out = np.zeros((len(actions), len(KEYS)), dtype=np.float32)
    for i, keys in enumerate(actions):
        for key in check_keys(keys):
            out[i, KEYS.index(key)] = 1.0
    return out


def parse_action_script(script: str) -> list[frozenset[str]]:
    """Parse an action script (syntax in the module docstring) into one key set per frame."""
    return action_script.parse_action_script(script, KEYS)


def format_action_script(actions: Sequence[Iterable[str]]) -> str:
    """Run-length encode actions as an action script; ``parse_action_script`` inverts it."""
    items: list[str] = []
    run_keys: frozenset[str] | None = None
    run_len = 0
    for keys in [*(check_keys(a) for a in actions), None]:
        if keys == run_keys:
            run_len += 1
            continue
        if run_keys is not None:
            name = "+".join(k for k in KEYS if k in run_keys)
            items.append(name if run_len == 1 else f"{name}*{run_len}")
        run_keys, run_len = keys, 1
    return ",".join(items)


def random_policy(
    seed: int,
    n_frames: int,
    mean_hold: float = 12.0,
    min_hold: int = 4,
    max_hold: int = 40,
    p_idle: float = 0.15,
    p_diagonal: float = 0.2,
    p_space: float = 0.15,
) -> list[frozenset[str]]:
    """Persistent random key presses for training data, deterministic from ``seed``.

    The sequence is cut into segments whose lengths are geometric with mean ``mean_hold``,
    clipped to [min_hold, max_hold] frames. Each segment holds nothing (``p_idle``), a diagonal
    pair (``p_diagonal``) or one movement key (the rest). With probability ``p_space`` a segment
    also gets a short space press (1..4 frames) at a random offset.
    """
    rng = np.random.default_rng(seed)
    actions: list[frozenset[str]] = []
    while len(actions) < n_frames:
        hold = int(np.clip(rng.geometric(1.0 / mean_hold), min_hold, max_hold))
        kind = rng.random()
        if kind < p_idle:
            keys: frozenset[str] = frozenset()
        elif kind < p_idle + p_diagonal:
            keys = frozenset(_DIAGONALS[rng.integers(len(_DIAGONALS))])
        else:
            keys = frozenset({MOVE_KEYS[rng.integers(len(MOVE_KEYS))]})
        segment = [keys] * hold
        if rng.random() < p_space:
            start = int(rng.integers(hold))
            for i in range(start, min(hold, start + int(rng.integers(1, 5)))):
                segment[i] = keys | {"space"}
        actions.extend(segment)
    return actions[:n_frames]
