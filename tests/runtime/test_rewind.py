"""Rewind (runtime/history.py, `Engine.rewind_stream`): back to the end of a retained chunk, then
the same actions give the original continuation bit for bit; beyond the retention nothing moves."""

from __future__ import annotations

import numpy as np
import pytest

from models.world import Conditioning
from runtime.engine import Engine
from runtime.errors import NotRetained
from runtime.memory import world_costs
from runtime.requests import ChunkCancelled, ChunkRequest
from tests.runtime.conftest import committed, keys, small_world

SCRIPT = [keys("w"), keys("d"), keys("a"), keys("s"), keys("w", "d"), keys(), keys("a"), keys("d")] * 2


def engine_for(world, retention: int, **kw) -> Engine:
    return Engine({world.config.id: world}, retention=retention, **kw)


def assert_same(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert len(got) == len(want) and all(np.array_equal(g, w) for g, w in zip(got, want, strict=True))


def play(engine: Engine, sid: str, script) -> list[np.ndarray]:
    return [committed(engine, sid, a).frames for a in script]


@pytest.mark.parametrize("pipeline", [False, True])
@pytest.mark.parametrize("image_start", [False, True])
def test_rewind_then_the_same_actions_give_the_original_continuation(pipeline, image_start):
    """16 chunks (the ring of 6 + 3x2 frames wraps several times), back by 1..3 chunks from
    several points: every continuation equals the original, and `frame` is the chunk's last."""
    world = small_world(image_start=image_start, name="tiny-r")
    engine = engine_for(world, 3, pipeline=pipeline, defer_context=None if pipeline else True)
    engine.add_stream("s", "tiny-r", Conditioning(seed=5))
    original = play(engine, "s", SCRIPT)
    for back_to, from_chunk in [(13, 16), (14, 16), (15, 16), (16, 16)]:
        info = engine.rewind_stream("s", back_to)
        shown = sum(f.shape[0] for f in original[:back_to]) + int(image_start)  # + the start image
        assert (info.chunks, info.video_frames) == (back_to, shown)
        assert np.array_equal(info.frame, original[back_to - 1][-1])
        again = play(engine, "s", SCRIPT[back_to:from_chunk])
        for got, want in zip(again, original[back_to:from_chunk], strict=True):
            assert np.array_equal(got, want)
    assert list(engine.runner.streams["s"].action_log)[-1] == SCRIPT[-1] * original[-1].shape[0]


def test_rewind_twice_in_a_row_and_the_retention_counts_from_the_highest_chunk_written():
    """From 10 back to 8, then to 7 (still within 3 of chunk 10): exact; chunk 6 is out
    (its frames' slots were written by chunk 10); then forward again, and the retention
    moves with the new highest chunk."""
    world = small_world(name="tiny-r")
    engine = engine_for(world, 3)
    engine.add_stream("s", "tiny-r", Conditioning(seed=2))
    original = play(engine, "s", SCRIPT[:10])
    engine.rewind_stream("s", 8)
    info = engine.rewind_stream("s", 7)
    assert info.chunks == 7
    with pytest.raises(NotRetained, match="chunk 6 is not retained"):
        engine.rewind_stream("s", 6)
    assert engine.info("s").chunks == 7  # nothing moved
    again = play(engine, "s", SCRIPT[7:12])
    assert all(np.array_equal(g, w) for g, w in zip(again, original[7:10], strict=False))
    with pytest.raises(NotRetained):
        engine.rewind_stream("s", 8)  # now at 12: 9..12 are retained
    engine.rewind_stream("s", 9)
    assert np.array_equal(committed(engine, "s", SCRIPT[9]).frames, original[9])


def test_beyond_the_retention_and_forward_are_not_retained_and_change_nothing():
    world = small_world(name="tiny-r")
    engine = engine_for(world, 2)
    engine.add_stream("s", "tiny-r", Conditioning(seed=3))
    play(engine, "s", SCRIPT[:6])
    for bad in (3, 0, 7, -1):
        with pytest.raises(NotRetained):
            engine.rewind_stream("s", bad)
    info = engine.info("s")
    assert info.chunks == 6
    # a queued chunk is not cancelled by a refused rewind
    rid = engine.new_request_id()
    engine.submit(ChunkRequest("s", rid, actions=SCRIPT[6]))
    with pytest.raises(NotRetained):
        engine.rewind_stream("s", 1)
    outcomes = []
    while engine.has_work():
        outcomes += engine.step()
    assert [o.chunk for o in outcomes if o.request_id == rid] == [7]
    assert not any(isinstance(o, ChunkCancelled) for o in outcomes)


def test_without_retention_only_the_current_chunk_is_a_rewind_target():
    world = small_world(name="tiny-r")
    engine = engine_for(world, 0)
    engine.add_stream("s", "tiny-r", Conditioning(seed=3))
    play(engine, "s", SCRIPT[:3])
    assert engine.rewind_stream("s", 3).chunks == 3
    with pytest.raises(NotRetained):
        engine.rewind_stream("s", 2)


def test_a_rewind_cancels_the_queued_chunks_in_the_old_numbering():
    world = small_world(name="tiny-r")
    engine = engine_for(world, 2)
    engine.add_stream("s", "tiny-r", Conditioning(seed=4))
    original = play(engine, "s", SCRIPT[:4])
    rids = [engine.new_request_id() for _ in range(2)]
    for rid, a in zip(rids, SCRIPT[4:6], strict=True):
        engine.submit(ChunkRequest("s", rid, actions=a))
    engine.rewind_stream("s", 3)
    outcomes = engine.step()
    assert sorted((o.request_id, o.chunk) for o in outcomes if isinstance(o, ChunkCancelled)) == [
        (rids[0], 5),
        (rids[1], 6),
    ]
    assert np.array_equal(committed(engine, "s", SCRIPT[3]).frames, original[3])


def test_fork_then_rewind_either_stays_exact():
    world = small_world(name="tiny-r")
    engine = engine_for(world, 3)
    engine.add_stream("s", "tiny-r", Conditioning(seed=6))
    original = play(engine, "s", SCRIPT[:8])
    engine.fork_stream("s", "f")
    engine.rewind_stream("f", 6)
    assert_same(play(engine, "f", SCRIPT[6:8]), original[6:8])
    engine.rewind_stream("s", 5)
    assert_same(play(engine, "s", SCRIPT[5:8]), original[5:8])


def test_cancel_then_rewind_stays_exact():
    """A chunk cancelled mid-denoise (its scratch K/V written) and then a rewind: exact."""
    world = small_world(name="tiny-r")
    engine = engine_for(world, 2, boundary_hook=None)
    engine.add_stream("s", "tiny-r", Conditioning(seed=8))
    original = play(engine, "s", SCRIPT[:6])
    engine.rewind_stream("s", 5)
    rid = engine.new_request_id()
    engine.submit(ChunkRequest("s", rid, actions=keys("space")))
    engine.abort([rid])
    while engine.has_work():
        engine.step()
    engine.rewind_stream("s", 4)
    assert_same(play(engine, "s", SCRIPT[4:6]), original[4:6])


def test_a_rewind_resets_the_plugin_state_and_decoder_cache():
    """A world whose plug-in carries state from chunk to chunk rewinds exactly too."""
    world = small_world(name="tiny-carry", carry=(0,))
    engine = engine_for(world, 2)
    engine.add_stream("s", "tiny-carry", Conditioning(seed=1))
    original = play(engine, "s", SCRIPT[:5])
    engine.rewind_stream("s", 3)
    assert_same(play(engine, "s", SCRIPT[3:5]), original[3:5])


def test_retention_is_charged_per_session():
    world = small_world(name="tiny-r")
    n = world.chunk_frames
    plain, kept = world_costs(world, 0, 0), world_costs(world, 4 * n, 4)
    assert kept.row == world.row_bytes(4 * n) > plain.row
    assert kept.session - kept.row == 4 * world.checkpoint_bytes()
    engine = engine_for(world, 4)
    engine.add_stream("s", "tiny-r", Conditioning(seed=1))
    assert engine.info("s").session_bytes == kept.session


@pytest.mark.parametrize("model", ["tiny-world", "tiny-random"])
def test_the_registered_worlds_rewind_exactly(model):
    """The shipped worlds (tiny-world: image-started, with its plug-in) through the engine."""
    from models.registry import from_name

    world = from_name(model)
    engine = Engine({world.config.id: world}, retention=2)
    engine.add_stream("s", world.config.id, Conditioning(seed=11))
    original = play(engine, "s", SCRIPT[:9])
    engine.rewind_stream("s", 7)
    assert_same(play(engine, "s", SCRIPT[7:9]), original[7:9])
    with pytest.raises(NotRetained):
        engine.rewind_stream("s", 6)


def test_the_history_keeps_at_most_retention_plus_one_checkpoints():
    world = small_world(name="tiny-r")
    engine = engine_for(world, 3)
    engine.add_stream("s", "tiny-r", Conditioning(seed=1))
    history = engine.runner.streams["s"].history
    assert len(history) == 1 and history.oldest() == 0  # the world's start
    play(engine, "s", SCRIPT[:8])
    assert len(history) == 4 and history.oldest() == 5
    engine.rewind_stream("s", 6)
    assert len(history) == 2 and history.high == 8
    engine.fork_stream("s", "f")
    assert engine.rewind_stream("f", 5).chunks == 5  # the fork holds the same ring and history
    engine.reset_stream("s", Conditioning(seed=2))
    assert len(history) == 1 and history.oldest() == 0 and history.high == 0
