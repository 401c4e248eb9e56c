"""The device-memory budget of the sessions' state, and what it holds, before anything is allocated.

The engine's memory owner (runtime/memory.py) sizes every world's K/V pool from one budget that
all loaded worlds share and admits sessions by bytes; this module works out that budget
(`device_budget`) for `serve` to pass on, and, with the owner's own figures, how many sessions it
holds. At a published size a row is gigabytes (Self-Forcing at 480x832: 12.3 GB in float32;
7.0 GB in bfloat16 with the pipelined decode's slack), so `serve`'s defaults could ask for more
than any device has. `fit_sessions` tells how many sessions of the largest world the budget
holds (for `serve`'s one warning line), or says in one line what one session needs when not even
that fits.

The budget, unless ``--device-memory`` gives it:

* CUDA: the device's free memory once the weights are loaded (what the caching allocator holds
  unused counts as free), less :data:`CUDA_MARGIN` of its total (at least
  :data:`CUDA_MARGIN_MIN`) for activations, the decoder's work and allocator slack.
* CPU: :data:`CPU_SHARE` of the memory available once the weights are loaded (MemAvailable,
  or the cgroup's limit when that is lower), the rest left to activations, the encoders and
  the other processes of the machine.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from web.startup import StartupError

if TYPE_CHECKING:  # the parser reads this module's figures for its help: no torch at import
    from models.world import World

__all__ = ["Budget", "PoolCost", "device_budget", "fit_sessions", "format_bytes", "pool_cost"]

CUDA_MARGIN = 0.10  # share of the device's total memory kept free of the pool
CUDA_MARGIN_MIN = 2 * 2**30  # bytes, the least margin on a small device
CPU_SHARE = 0.5  # share of the available RAM the pool may take
MEMINFO = Path("/proc/meminfo")
CGROUP = Path("/sys/fs/cgroup")  # cgroup v2: memory.max and memory.current


@dataclass(frozen=True)
class Budget:
    """Bytes the K/V pools may take, and where the figure comes from (for messages)."""

    nbytes: int
    source: str


@dataclass(frozen=True)
class PoolCost:
    """Device bytes the engine reserves for its sessions' state."""

    per_session: int  # the largest world's session: its pool row and its plug-in state
    fixed: int  # whatever the count: the spare (a reset's) and padding rows of every world's pool

    def total(self, sessions: int) -> int:
        """Bytes reserved for ``sessions`` sessions."""
        return self.fixed + sessions * self.per_session

    def sessions_within(self, nbytes: int) -> int:
        """The most sessions whose state fits in ``nbytes`` (0 when not even one does)."""
        return max(0, (nbytes - self.fixed) // self.per_session)


def pool_cost(worlds: Mapping[str, World], pipelined: bool, retention: int = 0) -> PoolCost:
    """What the engine's memory owner charges for ``worlds`` (loaded, before any pool exists):
    rows with a chunk of ring slack when ``pipelined`` and ``retention`` chunks more for rewinds
    (as `Engine` sets them up), sessions with their plug-in state (`World.session_bytes`) and
    rewind checkpoints; the figures of runtime/memory.py."""
    from runtime.memory import fixed_bytes, world_costs
    from runtime.runner import ring_slack

    costs = {
        name: world_costs(w, ring_slack(w.chunk_frames, pipelined, retention), retention)
        for name, w in worlds.items()
    }
    return PoolCost(per_session=max(c.session for c in costs.values()), fixed=fixed_bytes(costs))


def device_budget(device: str, given: int | None = None) -> Budget:
    """The bytes the pools may take on ``device`` (see the module docstring); ``given``: the
    ``--device-memory`` figure, taken as it is."""
    if given is not None:
        return Budget(given, "--device-memory")
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        free, total = torch.cuda.mem_get_info(dev)
        free += torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
        margin = max(int(total * CUDA_MARGIN), CUDA_MARGIN_MIN)
        return Budget(
            max(0, free - margin),
            f"{device} has {format_bytes(free)} free; {format_bytes(margin)} is kept for activations",
        )
    available = available_ram()
    return Budget(
        int(available * CPU_SHARE), f"{CPU_SHARE:.0%} of the {format_bytes(available)} of RAM available"
    )


def available_ram(meminfo: Path = MEMINFO, cgroup: Path = CGROUP) -> int:
    """Bytes of RAM this process could still take: MemAvailable, or what its cgroup's limit
    leaves when that is lower (a container sees the host's MemAvailable)."""
    available = None
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024  # the figure is in kB
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            available = min(available, int(limit) - int((cgroup / "memory.current").read_text()))
    except (OSError, ValueError):
        pass  # no cgroup v2 memory controller here: MemAvailable stands
    return max(0, available)


def auto_retention(
    worlds: Mapping[str, World], requested: int, budget: Budget, pipelined: bool, most: int
) -> int:
    """The rewind retention `serve` picks when not told: the most chunks, up to ``most``, that
    still let the budget hold ``requested`` sessions (0 when even one chunk would not). Rewind is
    cheap for small worlds and costly for full-size ones (a decoder cache per retained chunk), so
    it never takes sessions the user asked for."""
    for chunks in range(most, 0, -1):
        if pool_cost(worlds, pipelined, chunks).sessions_within(budget.nbytes) >= requested:
            return chunks
    return 0


def fit_sessions(
    worlds: Mapping[str, World],
    requested: int,
    budget: Budget,
    pipelined: bool,
    device: str,
    retention: int = 0,
) -> int:
    """How many of ``requested`` sessions the budget holds (at most ``requested``). Raises
    StartupError, one line saying what is needed and what to change, when not even one fits."""
    cost = pool_cost(worlds, pipelined, retention)
    fits = cost.sessions_within(budget.nbytes)
    if fits >= 1:
        return min(requested, fits)
    dtypes = {str(w.dtype).removeprefix("torch.") for w in worlds.values()}
    hints = ["--device-memory SIZE if more is free than that"]
    if "float32" in dtypes:
        hints.insert(0, "--dtype bfloat16 (half the bytes)")
    if len(worlds) > 1:
        hints.append("fewer --model worlds (every world's pool keeps a spare and a padding row)")
    raise StartupError(
        f"one session of {', '.join(worlds)} needs {format_bytes(cost.total(1))} of {device} memory "
        f"for its K/V state in {'/'.join(sorted(dtypes))} (its row and the spare ones every pool keeps), "
        f"but the budget is {format_bytes(budget.nbytes)} ({budget.source}); "
        f"try {', or '.join(hints)}"
    )


def format_bytes(n: int) -> str:
    """``n`` bytes for people: 1.5 GiB, 320.0 MiB, 12.0 KiB, 100 B."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
