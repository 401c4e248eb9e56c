"""Realtime admission: a realtime `open` is refused (`busy`) once the engine's measured chunk
rate cannot give every admitted realtime session its fps.

A realtime session of a world needs `fps / chunk_frames` chunks a second. Each world's
sessions claim that share of the world's measured rate (`runtime.throughput`); worlds share one
device, so the shares add up. A new realtime session is admitted while the sum, the new session
included, stays within `1 - headroom`. Before a world has a measured rate, its sessions are
admitted and claim nothing. A realtime session with no other realtime session beside it is always
admitted (the manager does not ask): on a device slower than its fps it plays as fast as the
device can, and refusing it would only leave the device idle. Lockstep sessions are paced by
their clients: they are never refused here, and their turns come from the scheduler's fair
order (so a device saturated by lockstep clients gives realtime sessions fewer frames than they
ask for).
"""

from __future__ import annotations

from collections.abc import Mapping

from models.world import ModelSpec


def chunks_per_s(spec: ModelSpec) -> float:
    """Chunks a second a realtime session of this world needs to play at its fps."""
    return spec.fps / spec.chunk_frames


def check_headroom(headroom: float | None) -> float | None:
    """`headroom` as the admission rule takes it: None (off) or a fraction in [0, 1)."""
    if headroom is not None and not 0.0 <= headroom < 1.0:
        raise ValueError(f"realtime headroom is a fraction in [0, 1), not {headroom}")
    return headroom


def refusal(
    headroom: float | None, need: Mapping[str, float], rates: Mapping[str, float | None], model_id: str
) -> str | None:
    """Why a new realtime session of `model_id` cannot be admitted, or None if it can.

    `need`: chunks/s the admitted realtime sessions of each world need, the new one included;
    `rates`: each world's measured chunks/s (None: not measured yet); `headroom`: the share of
    the rate kept free (None: the rule is off)."""
    if headroom is None or rates.get(model_id) is None:
        return None
    measured = {m: r for m, r in rates.items() if r}
    load = sum(n / measured[m] for m, n in need.items() if m in measured)
    if load <= 1.0 - headroom:
        return None
    return (
        f"server at capacity: realtime sessions would need {load:.0%} of the measured chunk rate "
        f"({need.get(model_id, 0.0):.1f} chunks/s of {measured[model_id]:.1f} for {model_id}; "
        f"admitted up to {1.0 - headroom:.0%}); retry later or open a lockstep session"
    )
