"""How many chunks a second the engine runs, per world, measured while it serves.

The engine records each batch's engine time: the step that ran it plus any step right after
that only finished it (an owed clean pass, a pipelined decode), and, while work was waiting,
the time between those steps (handing outcomes out, taking requests in). Per world and batch
size the meter keeps an exponentially weighted mean of those seconds; a world's rate is the
best `batch / seconds` among the batch sizes it has run. It grows as load makes bigger batches, so
it never promises more than a batch size the engine has actually run. The first batch of each
world and size is not counted: it may compile kernels or fill caches (seconds on a GPU).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

EWMA_ALPHA = 0.05  # weight of the newest batch: a batch counts half as much 14 batches later,
# so a few slow or fast batches (another process on the machine) do not swing admission


@dataclass
class ThroughputMeter:
    """Chunks per second per world. `record` runs on the engine thread; `rate` anywhere."""

    alpha: float = EWMA_ALPHA
    _seconds: dict[tuple[str, int], float] = field(default_factory=dict)  # (model, batch) -> s per batch
    _warm: set[tuple[str, int]] = field(default_factory=set)  # keys whose first batch went by
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, model_id: str, batch: int, seconds: float) -> float | None:
        """One batch of `batch` chunks of `model_id` took `seconds` of engine time; returns the
        world's rate after it (None while only warm-up batches went by)."""
        if batch < 1 or seconds <= 0:
            raise ValueError(f"a batch needs at least one chunk and some time, got {batch}, {seconds}")
        key = (model_id, batch)
        with self._lock:
            if key not in self._warm:
                self._warm.add(key)
            else:
                old = self._seconds.get(key)
                self._seconds[key] = seconds if old is None else old + self.alpha * (seconds - old)
        return self.rate(model_id)

    def rate(self, model_id: str) -> float | None:
        """Chunks per second at the best batch size measured for this world; None before any."""
        with self._lock:
            rates = [b / s for (m, b), s in self._seconds.items() if m == model_id]
        return max(rates) if rates else None


@dataclass
class BatchTimer:
    """The batch being timed: its engine time grows until the next batch starts (engine thread)."""

    model_id: str
    batch: int
    seconds: float = 0.0
    gap_from: float | None = None  # a step ended here with work left: the time to the next counts

    def charge_gap(self, now: float) -> None:
        """The next step starts at `now`: add the time since a step that left work behind."""
        if self.gap_from is not None:
            self.seconds += now - self.gap_from
            self.gap_from = None
