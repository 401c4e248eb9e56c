"""The serial engine's owed clean pass: a chunk's frames go out before its K/V is written, and
nothing can read the stream's world before it is (the next chunk, a fork, a reset). Frames and
K/V equal those of an engine that runs the pass inline; a failing pass loses only its stream."""

from __future__ import annotations

import numpy as np
import pytest

from models.world import Conditioning
from runtime.engine import Engine
from runtime.requests import ChunkCommitted, ChunkFailed, ChunkRequest
from runtime.runner import Runner
from tests.runtime.conftest import assert_same_snapshot, close_frames, committed, keys, run_chunk, snapshot

SCRIPT = [keys("w"), keys("d"), keys("a", "space"), keys(), keys("s")]


def engine(world, **kw) -> Engine:
    return Engine({world.config.id: world}, **kw)


def test_frames_come_out_before_the_clean_pass_and_match_the_inline_engine(world):
    owed, inline = engine(world), engine(world, defer_context=False)
    assert owed.runner.defer_context and not inline.runner.defer_context
    for e in (owed, inline):
        e.add_stream("s", "tiny", Conditioning(seed=9))
    for actions in SCRIPT:
        owed.submit(ChunkRequest("s", owed.new_request_id(), actions=actions))
        (done,) = owed.step()  # one step: denoise, decode, commit; the clean pass is owed
        assert isinstance(done, ChunkCommitted) and done.timings.context == 0.0
        assert owed.runner.owed and owed.has_work()
        assert owed.step() == [] and not owed.has_work()  # the idle step runs it
        assert np.array_equal(done.frames, committed(inline, "s", actions).frames)
        assert_same_snapshot(snapshot(owed, "s"), snapshot(inline, "s"))


def test_a_chunk_queued_behind_an_owed_pass_waits_for_it_and_counts_it(world):
    e = engine(world)
    e.add_stream("s", "tiny", Conditioning(seed=2))
    for _ in range(2):
        e.submit(ChunkRequest("s", e.new_request_id(), actions=keys("d")))
    first = e.step()
    second = e.step()  # pays the first chunk's pass, then runs the second
    assert [o.chunk for o in first + second] == [1, 2]
    assert second[0].timings.context > 0.0
    ref = engine(world, defer_context=False)
    ref.add_stream("s", "tiny", Conditioning(seed=2))
    for o in first + second:
        assert np.array_equal(o.frames, committed(ref, "s", keys("d")).frames)


def test_control_calls_run_the_owed_pass_first(world):
    e, ref = engine(world), engine(world, defer_context=False)
    for x in (e, ref):
        x.add_stream("s", "tiny", Conditioning(seed=4))
        x.submit(ChunkRequest("s", x.new_request_id(), actions=keys("w")))
        x.step()
    assert e.runner.owed
    e.fork_stream("s", "copy")  # reads the row: the pass must have run
    assert not e.runner.owed
    ref.fork_stream("s", "copy")
    for sid in ("s", "copy"):
        assert np.array_equal(committed(e, sid, keys("d")).frames, committed(ref, sid, keys("d")).frames)


def test_a_failing_clean_pass_loses_only_its_stream_until_reset(world, monkeypatch):
    e = engine(world, max_batch=4)
    for sid in ("a", "b"):
        e.add_stream(sid, "tiny", Conditioning(seed=1))
    bad_row = e.runner.streams["b"].state.row
    context = world.context

    def broken(x0, index, actions, noise=None):
        if bad_row in index.rows.tolist():
            raise RuntimeError("clean pass exploded")
        return context(x0, index, actions, noise=noise)

    monkeypatch.setattr(world, "context", broken)
    for sid in ("a", "b"):
        e.submit(ChunkRequest(sid, e.new_request_id(), actions=keys("d")))
    outs = e.step()
    assert sorted(o.stream_id for o in outs if isinstance(o, ChunkCommitted)) == ["a", "b"]
    e.step()  # the batch's pass fails; a's runs again alone, b's fails alone
    monkeypatch.setattr(world, "context", context)
    assert e.runner.streams["b"].lost and e.runner.streams["a"].lost is None
    (fail,) = run_chunk(e, "b", keys("d"))
    assert isinstance(fail, ChunkFailed) and "lost" in fail.message and "clean pass exploded" in fail.message
    assert e.info("b").chunks == 1  # nothing committed
    ref = engine(world)
    ref.add_stream("a", "tiny", Conditioning(seed=1))
    committed(ref, "a", keys("d"))
    assert close_frames(committed(e, "a", keys("w")).frames, committed(ref, "a", keys("w")).frames)
    e.reset_stream("b", Conditioning(seed=1))
    assert e.runner.streams["b"].lost is None
    fresh = engine(world)
    fresh.add_stream("x", "tiny", Conditioning(seed=1))
    assert np.array_equal(committed(e, "b", keys("d")).frames, committed(fresh, "x", keys("d")).frames)


def test_a_pipelined_runner_cannot_defer(world):
    with pytest.raises(ValueError, match="cannot defer"):
        Runner({"tiny": world}, lambda request_id: False, pipeline=True, defer_context=True)
