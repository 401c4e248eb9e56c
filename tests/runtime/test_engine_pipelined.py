"""Every engine transaction test again with the pipelined decode (chunk k+1 computed on top of
chunk k while k decodes), plus the cases only a pipeline has: a chunk that loses the chunk it ran
on top of runs again on the committed world, exactly as if it had waited."""

from __future__ import annotations

import numpy as np
import pytest

from models.world import Conditioning, World
from runtime.engine import Engine
from runtime.requests import ChunkCommitted, ChunkRequest, DebugHooks
from tests.runtime import test_engine as serial
from tests.runtime.conftest import assert_same_snapshot, committed, keys, small_world, snapshot
from tests.runtime.test_engine import *  # noqa: F403  (the serial tests, collected again here)


@pytest.fixture(scope="module")
def world() -> World:
    return small_world()


@pytest.fixture(scope="module")
def image_world() -> World:
    return small_world(image_start=True, name="tiny-image")


@pytest.fixture(autouse=True)
def pipelined(monkeypatch: pytest.MonkeyPatch) -> None:
    def make_engine(world: World, **kw) -> Engine:
        return Engine({world.config.id: world}, pipeline=True, **kw)

    monkeypatch.setattr(serial, "make_engine", make_engine)


# -- what only a pipeline does ------------------------------------------------------------------

Record = tuple[str, str, int, bytes | None]  # (outcome type, stream, chunk, frames)


def _records(outs: list) -> list[Record]:
    return [
        (
            type(o).__name__,
            o.stream_id,
            o.chunk,
            o.frames.tobytes() if isinstance(o, ChunkCommitted) else None,
        )
        for o in outs
    ]


def _play(
    pipeline: bool,
    chunks: int,
    hook=None,
    setup=None,
    debug_b: DebugHooks | None = None,
    carry: tuple[int, ...] = (),
) -> tuple[Engine, list[Record], list[tuple]]:
    """Three streams, `chunks` chunks queued on each (the ring wraps); returns the engine, every
    outcome in order and the boundary events (stream, name) in order. Serial runs use the
    pipelined pool layout (a chunk of ring slack) too, so that the two can agree bit for bit: a
    different ring length changes the order of float sums once the ring wraps. `carry`: the
    world's carry channels (a chunk on top of another reads that one's last frame)."""
    e = Engine({"tiny": small_world(carry=carry)}, pipeline=True, max_batch=4)
    e.runner.pipeline = pipeline
    events: list[tuple] = []
    for i, sid in enumerate("abc"):
        e.add_stream(sid, "tiny", Conditioning(seed=i), debug_b if sid == "b" else None)
    reqs = {
        sid: [ChunkRequest(sid, e.new_request_id(), actions=keys("wasd"[(j + i) % 4])) for j in range(chunks)]
        for i, sid in enumerate("abc")
    }

    def record(sid: str, name: str) -> None:
        events.append((sid, name))
        if hook is not None:
            hook(e, reqs, sid, name)

    e.runner.boundary_hook = record
    if setup is not None:
        setup(e)
    for j in range(chunks):
        for sid in "abc":
            e.submit(reqs[sid][j])
    outs = []
    while e.has_work():
        outs += e.step()
    return e, _records(outs), events


def assert_same_outcomes(a: list[Record], b: list[Record]) -> None:
    """The same outcomes, frames within 1 level: a chunk that runs again after the chunk below
    it failed lands in another batch than in a serial run (other mates, another position), and
    multi-threaded CPU kernels may then sum in another order."""
    assert [r[:3] for r in sorted(a)] == [r[:3] for r in sorted(b)]
    for x, y in zip(sorted(a), sorted(b), strict=True):
        if x[3] is not None:
            diff = np.frombuffer(x[3], np.uint8).astype(int) - np.frombuffer(y[3], np.uint8)
            assert np.abs(diff).max() <= 1, x[:3]


CARRY = pytest.mark.parametrize("carry", [(), (0, 1)], ids=["plain", "carry"])


@CARRY
def test_pipelined_rollouts_equal_serial_ones_bit_for_bit(carry):
    _, serial_out, serial_events = _play(False, 7, carry=carry)
    e, piped_out, piped_events = _play(True, 7, carry=carry)
    assert sorted(piped_out) == sorted(serial_out)
    assert all(kind == "ChunkCommitted" for kind, *_ in piped_out) and len(piped_out) == 21
    # the overlap happened: chunk 2 of a stream was denoised before chunk 1 committed
    first_commit = piped_events.index(("a", "commit"))
    assert piped_events.index(("a", "denoise:0"), 1) < first_commit
    assert serial_events.index(("a", "denoise:0"), 1) > serial_events.index(("a", "commit"))
    assert not e.runner.busy and e.runner.streams["a"].state.chunks == 7
    # against a serial engine with the plain ring: the same frames up to float order (1 level)
    plain = Engine({"tiny": small_world(carry=carry)}, max_batch=4)
    for i, sid in enumerate("abc"):
        plain.add_stream(sid, "tiny", Conditioning(seed=i))
    for j in range(7):
        for i, sid in enumerate("abc"):
            plain.submit(ChunkRequest(sid, plain.new_request_id(), actions=keys("wasd"[(j + i) % 4])))
    outs = []
    while plain.has_work():
        outs += plain.step()
    frames = {(sid, chunk): f for _, sid, chunk, f in piped_out}
    for o in outs:
        diff = np.abs(np.frombuffer(frames[o.stream_id, o.chunk], np.uint8).astype(int) - o.frames.ravel())
        assert diff.max() <= 1


def _cancel_at_commit(target: int):
    """A hook that cancels only chunk `target` of stream b at its commit boundary."""
    seen = {"n": 0}

    def hook(e: Engine, reqs, sid: str, name: str) -> None:
        if sid == "b" and name == "commit":
            seen["n"] += 1
            if seen["n"] == target:
                e.abort([reqs["b"][target - 1].request_id])

    return hook


@CARRY
def test_a_chunk_whose_predecessor_is_cancelled_runs_again_on_the_committed_world(carry):
    # Pipelined, chunk 3 of b was computed on top of chunk 2 when 2 is cancelled at its commit
    # boundary: 3 is rolled back and runs again on the committed world, as chunk 2, as a serial
    # engine (where it simply waited) runs it.
    _, serial_out, _ = _play(False, 5, _cancel_at_commit(2), carry=carry)
    e, piped_out, _ = _play(True, 5, _cancel_at_commit(2), carry=carry)
    assert_same_outcomes(piped_out, serial_out)
    b = [(kind, chunk) for kind, sid, chunk, _ in piped_out if sid == "b"]
    assert ("ChunkCancelled", 2) in b and [c for k, c in b if k == "ChunkCommitted"] == [1, 2, 3, 4]
    assert e.runner.streams["b"].state.chunks == 4


def _poison_chunk_two_of_b(e: Engine) -> None:
    """The first denoise of b's chunk 2 (latent frames 2-3) predicts inf: the chunk fails."""
    world = e.worlds["tiny"]
    denoise = world.denoise
    left = {"n": 1}

    def poisoned(x, t, index, acts):
        pred = denoise(x, t, index, acts)
        hit = (index.rows == e.runner.streams["b"].state.row) & (index.frame_offset == 2)
        if left["n"] and bool(hit.any()):
            left["n"] -= 1
            pred[hit] = float("inf")
        return pred

    world.denoise = poisoned


@CARRY
def test_a_chunk_whose_predecessor_fails_runs_again_on_the_committed_world(carry):
    _, serial_out, _ = _play(False, 4, setup=_poison_chunk_two_of_b, carry=carry)
    _, piped_out, _ = _play(True, 4, setup=_poison_chunk_two_of_b, carry=carry)
    assert_same_outcomes(piped_out, serial_out)
    b = [(kind, chunk) for kind, sid, chunk, _ in piped_out if sid == "b"]
    assert ("ChunkFailed", 2) in b and [c for k, c in b if k == "ChunkCommitted"] == [1, 2, 3]


def test_a_fault_inside_a_pipelined_batch_fails_its_owner_and_reruns_the_mates():
    hooks = DebugHooks(fail_at_chunk=2)
    _, serial_out, _ = _play(False, 4, debug_b=hooks)
    _, piped_out, _ = _play(True, 4, debug_b=hooks)
    assert sorted(piped_out) == sorted(serial_out)
    b = [(kind, chunk) for kind, sid, chunk, _ in piped_out if sid == "b"]
    assert ("ChunkFailed", 2) in b and [c for k, c in b if k == "ChunkCommitted"] == [1, 2, 3]
    assert sum(kind == "ChunkCommitted" for kind, *_ in piped_out) == 11


@pytest.mark.parametrize("pipeline", [False, True])
def test_cancelling_every_chunk_in_flight_leaves_the_world_as_it_was(pipeline):
    e = Engine({"tiny": small_world()}, pipeline=pipeline)
    e.add_stream("s", "tiny", Conditioning(seed=3))
    committed(e, "s", keys("w"))
    before = snapshot(e, "s")
    reqs = [ChunkRequest("s", e.new_request_id(), actions=keys("d")) for _ in range(3)]
    for r in reqs:
        e.submit(r)

    def hook(sid: str, name: str) -> None:
        if name == "commit":  # pipelined: chunk 3 is computed on top of chunk 2 by now
            e.abort([r.request_id for r in reqs])

    e.runner.boundary_hook = hook
    outs = []
    while e.has_work():
        outs += e.step()
    assert [type(o).__name__ for o in outs].count("ChunkCancelled") == 3
    assert sorted(o.chunk for o in outs) == [2, 2, 3]  # queued ones: the numbers they would commit as
    assert_same_snapshot(before, snapshot(e, "s"))


def test_control_calls_settle_a_decode_in_flight():
    e = Engine({"tiny": small_world()}, pipeline=True)
    ref = Engine({"tiny": small_world()}, pipeline=True)
    for eng in (e, ref):
        eng.add_stream("s", "tiny", Conditioning(seed=5))
    e.submit(ChunkRequest("s", e.new_request_id(), actions=keys("a")))
    assert e.step() == [] and e.runner.busy  # computed; its decode is in flight
    info = e.fork_stream("s", "t")  # settles first: the fork copies the committed chunk
    assert info.chunks == 1 and not e.runner.busy
    (done,) = e.step()
    assert isinstance(done, ChunkCommitted) and done.chunk == 1
    ref_frames = committed(ref, "s", keys("a")).frames
    assert np.array_equal(done.frames, ref_frames)
    assert np.array_equal(committed(e, "t", keys("w")).frames, committed(ref, "s", keys("w")).frames)
