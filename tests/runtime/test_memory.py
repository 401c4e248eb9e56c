"""runtime/memory.py: one device budget for every loaded world, admission by bytes, rows given
back explicitly, pools sized from the budget."""

from __future__ import annotations

import numpy as np
import pytest

from models.world import Conditioning
from runtime.engine import Engine
from runtime.errors import CapacityError
from runtime.memory import budget_for, world_costs
from tests.runtime.conftest import committed, keys, small_world


@pytest.fixture
def two():
    """Two worlds of different row sizes (tiny-random's architecture, two configs)."""
    return {"a": small_world(name="a"), "b": small_world(image_start=True, name="b")}


def test_two_worlds_share_one_budget(two):
    a, b = (world_costs(w, 0) for w in two.values())
    budget = budget_for({"a": a, "b": b}, 0) + 3 * a.session  # three of a's sessions
    e = Engine(two, max_streams=None, max_kv_bytes=budget)
    for i in range(3):
        e.add_stream(f"a{i}", "a", Conditioning(seed=i))
    assert e.memory.free_bytes < b.session
    with pytest.raises(CapacityError, match="bytes"):  # busy from bytes: b has no row in use yet
        e.add_stream("b0", "b", Conditioning(seed=0))
    with pytest.raises(CapacityError):
        e.add_stream("a3", "a", Conditioning(seed=3))
    for i in range(3):
        e.remove_stream(f"a{i}")
    fits = (budget - e.memory.fixed) // b.session
    for i in range(fits):  # a's pool gives its rows back; b's grows into them
        e.add_stream(f"b{i}", "b", Conditioning(seed=i))
    with pytest.raises(CapacityError):
        e.add_stream("a0", "a", Conditioning(seed=0))
    assert e.memory.pool_bytes() + e.memory._plugin_bytes() <= budget  # the device holds no more
    assert fits >= 3 and len(e.memory) == fits


def test_rows_move_when_a_pool_shrinks_and_the_sessions_run_on(two):
    a = world_costs(two["a"], 0)
    budget = budget_for({n: world_costs(w, 0) for n, w in two.items()}, 0) + 3 * a.session
    e = Engine(two, max_streams=None, max_kv_bytes=budget)
    ref = Engine({"a": small_world(name="a")}, max_streams=2)
    for sid in ("x", "y", "z"):
        e.add_stream(sid, "a", Conditioning(seed=5))
    ref.add_stream("z", "a", Conditioning(seed=5))
    committed(e, "z", keys("d"))
    committed(ref, "z", keys("d"))
    e.remove_stream("x")
    e.remove_stream("y")
    e.add_stream("b0", "b", Conditioning(seed=0))  # a's pool shrinks to z and its spare: z moves
    assert e.memory.lease("z").row == 0 and two["a"].max_sessions == 2
    assert np.array_equal(committed(e, "z", keys("w")).frames, committed(ref, "z", keys("w")).frames)


def test_fork_reset_and_remove_return_exactly_their_bytes():
    world = small_world()
    e = Engine({"tiny": world}, max_streams=3)
    session = world.session_bytes()
    e.add_stream("s", "tiny", Conditioning(seed=1))
    assert e.memory.used_bytes == session and e.info("s").session_bytes == session
    e.fork_stream("s", "copy")
    assert e.memory.used_bytes == 2 * session
    rows = world.free_rows
    e.reset_stream("s", Conditioning(seed=2))  # the spare row holds the new state, the old row is freed
    assert e.memory.used_bytes == 2 * session and world.free_rows == rows
    e.remove_stream("copy")
    assert e.memory.used_bytes == session
    e.remove_stream("s")
    assert e.memory.used_bytes == 0 and len(e.memory) == 0


def test_a_failed_reset_keeps_the_old_state_and_its_charge(image_world):
    e = Engine({"tiny-image": image_world}, max_streams=1)
    e.add_stream("s", "tiny-image", Conditioning(seed=1))
    row = e.memory.lease("s").row
    with pytest.raises(Exception, match="image"):
        e.reset_stream("s", Conditioning(seed=1, image=np.zeros((8, 8, 3), np.uint8)))
    assert e.memory.lease("s").row == row and e.memory.used_bytes == image_world.session_bytes()
    e.reset_stream("s", Conditioning(seed=2))  # the spare row is still there
    e.remove_stream("s")


def test_one_world_sizes_its_pool_from_the_budget():
    world = small_world()  # its own: no other engine holds rows in its pool
    cost = world_costs(world, 0)
    budget = budget_for({"tiny": cost}, 5) + cost.session - 1
    e = Engine({"tiny": world}, max_streams=None, max_kv_bytes=budget)
    assert world.max_sessions == 5 + 1  # five sessions and the spare; the padding row is the pool's
    assert e.memory.pool_bytes() == budget_for({"tiny": cost}, 5)
    for i in range(5):
        e.add_stream(str(i), "tiny", Conditioning(seed=i))
    with pytest.raises(CapacityError):
        e.add_stream("5", "tiny", Conditioning(seed=5))
    assert world.max_sessions == 6  # never resized
