"""One owner of the sessions' device state: pool rows and bytes against one device budget.

A session's device state is its world's K/V pool row (self, action and text K/V and the per-row
extras, models/kv_pool.py) and, in a world whose plug-in keeps per-session state on the device
(models/plugin.py), that state: `World.session_bytes` counts both. `DeviceMemory` is the one
place that

* sizes every loaded world's pool from one budget they all share,
* admits a session by bytes (`OutOfBudget`, which the sessions answer `busy`),
* names what each session holds (`Lease`) and gives it back explicitly when its stream is
  removed (no garbage-collector timing),
* captures a session's device state into a snapshot and installs one as a new session
  (`capture`, `install`; the format: runtime/snapshot.py).

Accounting, for worlds w with row bytes r_w and session bytes s_w (r_w plus plug-in state, plus
with a rewind retention of R chunks R checkpoints: a plug-in state and a decoder cache each; the
ring slack R chunks need is in r_w, runtime/history.py):

    fixed  F = sum over w of 2 r_w      every pool's padding row (bucket padding writes it) and
                                         its spare row (a reset builds the new state before the
                                         old one goes)
    used   U = sum of s_w over the live sessions
    admit a session of world w  iff  F + U + s_w <= budget

Pools follow the bytes: the first world's pool starts with every row the budget holds, the
others with their spare row. When an admitted session's world has no row left beyond its spare,
the owner takes the surplus rows of the other pools back (live rows move down first, then the
pool shrinks) and grows that world's pool by the rows it lacks; the admission check guarantees
the room. A resize reallocates the pool (briefly holding the old and the new one) and a compiled
world meets a new pool shape, so a server with one world never resizes after start-up.

`budget` None: room for `max_sessions` sessions of the largest world (`budget_for`), which with one
world is the `max_sessions + 1` rows (plus padding) the engine always had. Every other memory
bound of the server, and who owns it: docs/ARCHITECTURE.md, "Who owns what memory".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from runtime.errors import CapacityError

if TYPE_CHECKING:
    import torch

    from models.world import World, WorldState


class OutOfBudget(CapacityError):
    """A session's bytes do not fit the device budget now (the sessions answer `busy`)."""


@dataclass
class Lease:
    """What one session holds on the device: its world's pool row and the bytes charged for it.
    The handle a snapshot or an offload copies out and back (the row's buffers and `state`)."""

    stream_id: str
    model_id: str
    nbytes: int  # charged against the budget: `World.session_bytes` of its world
    state: WorldState | None = None  # bound once the world holds a row for it

    @property
    def row(self) -> int | None:
        """The pool row the session holds (None until bound)."""
        return None if self.state is None else self.state.row


@dataclass(frozen=True)
class Costs:
    """Bytes of one world's state, as the owner charges them."""

    row: int  # one pool row
    session: int  # one session: its row and its plug-in state


def world_costs(world: World, slack_frames: int, retention: int = 0) -> Costs:
    """A world's row and session bytes with `slack_frames` of ring slack (before any pool exists)
    and `retention` chunks of rewind history (its ring slack is part of `slack_frames`; each
    retained chunk also keeps a plug-in state and a decoder cache, `World.checkpoint_bytes`)."""
    row = world.row_bytes(slack_frames)
    history = retention * world.checkpoint_bytes() if retention else 0
    return Costs(row, row + world.session_bytes() - world.kv_bytes_per_session() + history)


def fixed_bytes(costs: Mapping[str, Costs]) -> int:
    """Bytes every pool keeps whatever the session count: a padding row and a spare row."""
    return sum(2 * c.row for c in costs.values())


def budget_for(costs: Mapping[str, Costs], sessions: int) -> int:
    """The budget that holds `sessions` sessions of the largest world."""
    return fixed_bytes(costs) + sessions * max(c.session for c in costs.values())


class DeviceMemory:
    """The pools of `worlds` and the leases of their sessions against one byte budget."""

    def __init__(
        self,
        worlds: Mapping[str, World],
        budget: int | None = None,
        *,
        max_sessions: int | None = None,
        slack_frames: Mapping[str, int] | None = None,
        settle: Callable[[], None] | None = None,
        retention: int = 0,
    ) -> None:
        """`budget`: device bytes for every world's sessions (None: room for `max_sessions`);
        with both, the smaller. `slack_frames`: each world's ring slack (default 0). `settle`:
        called before a resize moves rows (the engine finishes the work in flight on them). Rows
        another owner holds in a world's pool (another engine on the same world) stay where they
        are, on top of this owner's rows. `retention`: chunks of rewind history each session
        keeps (`world_costs`; its ring slack is in `slack_frames`)."""
        if not worlds:
            raise ValueError("no worlds")
        slack = dict(slack_frames or {})
        self.worlds = dict(worlds)
        self.costs = {name: world_costs(w, slack.get(name, 0), retention) for name, w in self.worlds.items()}
        limits = [b for b in (budget, max_sessions and budget_for(self.costs, max_sessions)) if b is not None]
        if not limits:
            raise ValueError("give a budget or max_sessions")
        self.budget = min(limits)
        self.fixed = fixed_bytes(self.costs)
        self._settle = settle or (lambda: None)
        self._leases: dict[str, Lease] = {}
        first = next(iter(self.worlds))
        for name, world in self.worlds.items():
            rows = 1  # the spare row
            if name == first:
                rows += max(0, self.budget - self.fixed) // self.costs[name].session
            world.resize(rows, slack.get(name, 0))

    # -- figures ----------------------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        """Bytes charged to live sessions (over a copy of the leases: /metrics reads it from
        another thread)."""
        return sum(lease.nbytes for lease in list(self._leases.values()))

    @property
    def free_bytes(self) -> int:
        """Bytes of the budget no session and no fixed row takes."""
        return self.budget - self.fixed - self.used_bytes

    def pool_bytes(self) -> int:
        """Device bytes every pool holds now (live, free, spare and padding rows)."""
        return sum((w.max_sessions + 1) * self.costs[n].row for n, w in self.worlds.items())

    def __len__(self) -> int:
        return len(self._leases)

    def lease(self, stream_id: str) -> Lease:
        """The lease of a live session (KeyError when it has none)."""
        return self._leases[stream_id]

    def live(self, model_id: str) -> list[Lease]:
        """The leases of `model_id`'s sessions."""
        return [lease for lease in self._leases.values() if lease.model_id == model_id]

    # -- leases -----------------------------------------------------------------------------------

    def admit(self, stream_id: str, model_id: str) -> Lease:
        """Charge a new session of `model_id` and make sure its pool has a row for it beyond the
        spare; `CapacityError` when its bytes do not fit (nothing changes then)."""
        if stream_id in self._leases:
            raise ValueError(f"stream {stream_id} already holds device state")
        need = self.costs[model_id].session
        if need > self.free_bytes:
            raise OutOfBudget(
                f"no room for another session of {model_id}: it needs {need} bytes and "
                f"{max(0, self.free_bytes)} of the {self.budget}-byte device budget are free "
                f"({len(self)} sessions live)"
            )
        self._make_room(model_id)
        lease = Lease(stream_id, model_id, need)
        self._leases[stream_id] = lease
        return lease

    def bind(self, stream_id: str, state: WorldState) -> None:
        """Record the state (and so the row) a lease's session holds now (after add, fork, reset)."""
        self._leases[stream_id].state = state

    def release(self, stream_id: str) -> int:
        """End a session's charge (its world freed the row already); returns the bytes given back
        (0 when it held none)."""
        lease = self._leases.pop(stream_id, None)
        return 0 if lease is None else lease.nbytes

    # -- snapshots --------------------------------------------------------------------------------

    def capture(self, stream_id: str) -> tuple[str, str, dict[str, torch.Tensor], dict]:
        """A live session's device state as (model id, weights hash, host tensors, JSON)
        (`World.export_state`); the session keeps running. The caller settles the world first."""
        lease = self._leases[stream_id]
        if lease.state is None:
            raise ValueError(f"stream {stream_id} holds no state yet")
        world = self.worlds[lease.model_id]
        tensors, meta = world.export_state(lease.state)
        return lease.model_id, world.weights_hash(), tensors, meta

    def install(self, stream_id: str, model_id: str, tensors: dict[str, torch.Tensor], meta: dict) -> Lease:
        """A new session of `model_id` holding a captured state: admitted by bytes as `admit`
        (`OutOfBudget`), then the state goes into a free row (`World.import_state`; its
        ValueError gives the charge back)."""
        lease = self.admit(stream_id, model_id)
        try:
            lease.state = self.worlds[model_id].import_state(tensors, meta)
        except Exception:
            self.release(stream_id)
            raise
        return lease

    # -- pools ------------------------------------------------------------------------------------

    def _make_room(self, model_id: str) -> None:
        """Leave `model_id`'s pool a free row for a new session beyond its spare, shrinking the
        other pools to their live rows and spare first when the budget's bytes are all in pools."""
        world = self.worlds[model_id]
        # An admitted lease not yet bound (its conditioning still being computed) takes its row later.
        unbound = sum(1 for lease in self.live(model_id) if lease.state is None)
        if world.free_rows - unbound >= 2:
            return
        self._settle()
        grow = (2 - world.free_rows) * self.costs[model_id].row
        if self.pool_bytes() + grow > self.budget - self._plugin_bytes():
            for name in self.worlds:
                if name != model_id:
                    self._resize(name, len(self.live(name)) + 1)
        self._resize(model_id, len(self.live(model_id)) + 2)

    def _resize(self, model_id: str, rows: int) -> None:
        world = self.worlds[model_id]
        states = [lease.state for lease in self.live(model_id) if lease.state is not None]
        world.resize(rows, world.slack_frames, states)

    def _plugin_bytes(self) -> int:
        """Bytes live sessions hold outside the pools (plug-in state, rewind checkpoints)."""
        return sum(lease.nbytes - self.costs[lease.model_id].row for lease in self._leases.values())
