"""The chunk transaction through a bare Engine: determinism, exact cancellation, rollback on
faults and non-finite latents, isolation between sessions, fork, prefill of image-started worlds."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from models.actions import FrameAction
from models.world import Conditioning
from runtime.engine import Engine
from runtime.errors import CapacityError, InvalidRequest, StreamNotFound
from runtime.requests import ChunkCancelled, ChunkCommitted, ChunkFailed, ChunkRequest, DebugHooks
from tests.runtime.conftest import (
    assert_same_snapshot,
    close_frames,
    committed,
    keys,
    run_chunk,
    small_world,
    snapshot,
)

SCRIPT = [keys("w"), keys("d"), keys("a", "space"), keys()]
# The serial engine runs a chunk's clean pass after its commit (no boundary); inline, before decode.
BOUNDARIES = [
    *((b, None) for b in ["denoise:0", "denoise:1", "denoise:2", "denoise:3", "decode", "commit"]),
    ("context", False),
]


def make_engine(world, **kw) -> Engine:
    return Engine({world.config.id: world}, **kw)


def play(engine: Engine, sid: str, script) -> list[np.ndarray]:
    return [committed(engine, sid, a).frames for a in script]


def test_same_seed_and_actions_give_identical_frames(world):
    a, b = make_engine(world), make_engine(world)
    a.add_stream("s", "tiny", Conditioning(seed=7))
    b.add_stream("s", "tiny", Conditioning(seed=7))
    fa, fb = play(a, "s", SCRIPT), play(b, "s", SCRIPT)
    for x, y in zip(fa, fb, strict=True):
        assert np.array_equal(x, y)
    assert [f.shape[0] for f in fa] == [3, 4, 4, 4]  # first chunk of a Wan-VAE stream: 1 + 2 frames


def test_different_actions_or_history_give_different_frames(world):
    e = make_engine(world)
    for sid in ("base", "acts", "hist", "seed"):
        e.add_stream(sid, "tiny", Conditioning(seed=11 if sid == "seed" else 7))
    base = play(e, "base", SCRIPT)
    acts = play(e, "acts", [*SCRIPT[:3], keys("s")])
    hist = play(e, "hist", [keys("s"), *SCRIPT[1:]])
    seed = play(e, "seed", SCRIPT)
    assert not np.array_equal(base[3], acts[3])  # same history, different last action
    assert np.array_equal(base[0], acts[0])
    assert not np.array_equal(base[3], hist[3])  # same last action, different history
    assert not np.array_equal(base[0], seed[0])


@pytest.mark.parametrize(("boundary", "defer"), BOUNDARIES)
def test_cancel_at_every_boundary_leaves_the_world_bit_identical(world, boundary, defer):
    hit: list[str] = []

    def hook(stream_id: str, name: str) -> None:
        if stream_id == "s" and name == boundary and not hit:
            hit.append(name)
            engine.abort(engine._live)

    engine = make_engine(world, defer_context=defer)
    ref = make_engine(world)
    engine.runner.boundary_hook = hook
    for e in (engine, ref):
        e.add_stream("s", "tiny", Conditioning(seed=3))
    play(ref, "s", SCRIPT[:2])
    hit.append("armed-later")  # no cancel during the first two chunks
    play(engine, "s", SCRIPT[:2])
    hit.clear()
    before = snapshot(engine, "s")
    outcomes = run_chunk(engine, "s", keys("d"))
    assert [type(o) for o in outcomes] == [ChunkCancelled] and outcomes[0].started and outcomes[0].chunk == 3
    assert_same_snapshot(before, snapshot(engine, "s"))
    # the stream goes on at once and matches a run that never started the cancelled chunk
    later = play(engine, "s", SCRIPT[2:])
    expected = play(ref, "s", SCRIPT[2:])
    for x, y in zip(later, expected, strict=True):
        assert np.array_equal(x, y)


def test_cancel_of_a_queued_chunk_never_starts_it(world):
    e = make_engine(world)
    e.add_stream("s", "tiny", Conditioning(seed=1))
    r1, r2 = (ChunkRequest("s", e.new_request_id(), actions=keys("w")) for _ in range(2))
    e.submit(r1)
    e.submit(r2)
    e.abort([r2.request_id])
    outs = []
    while e.has_work():
        outs += e.step()
    kinds = {o.request_id: o for o in outs}
    assert isinstance(kinds[r1.request_id], ChunkCommitted)
    assert isinstance(kinds[r2.request_id], ChunkCancelled) and not kinds[r2.request_id].started
    assert e.info("s").chunks == 1


def test_injected_fault_rolls_back_and_spares_the_batch_mate(world):
    e = make_engine(world, max_batch=4)
    alone = make_engine(world)
    e.add_stream("bad", "tiny", Conditioning(seed=1), DebugHooks(fail_at_chunk=2))
    e.add_stream("good", "tiny", Conditioning(seed=2))
    alone.add_stream("good", "tiny", Conditioning(seed=2))
    for sid in ("bad", "good"):
        committed(e, sid, keys("w"))
    committed(alone, "good", keys("w"))
    before = snapshot(e, "bad")
    e.submit(ChunkRequest("bad", e.new_request_id(), actions=keys("d")))
    e.submit(ChunkRequest("good", e.new_request_id(), actions=keys("d")))
    outs = {}
    while e.has_work():
        for o in e.step():
            outs[o.stream_id] = o
    assert isinstance(outs["bad"], ChunkFailed) and "injected" in outs["bad"].message
    assert_same_snapshot(before, snapshot(e, "bad"))
    assert isinstance(outs["good"], ChunkCommitted)
    assert close_frames(outs["good"].frames, committed(alone, "good", keys("d")).frames)
    # the failed stream runs its next chunk at once, like a stream that never saw the fault
    clean = make_engine(world)
    clean.add_stream("bad", "tiny", Conditioning(seed=1))
    committed(clean, "bad", keys("w"))
    assert np.array_equal(committed(e, "bad", keys("d")).frames, committed(clean, "bad", keys("d")).frames)


@pytest.mark.parametrize("max_batch", [1, 4])
def test_interleaved_sessions_equal_each_alone(world, max_batch):
    """Alternating sessions is bit-identical to running each alone. Batched, the float math is
    the same up to BLAS summation order, so frames agree to within one uint8 level."""
    e = make_engine(world, max_batch=max_batch)
    solo = {sid: make_engine(world) for sid in ("a", "b", "c")}
    scripts = {"a": SCRIPT, "b": [keys("s")] * 4, "c": [keys("a"), keys(), keys("w", "d"), keys("space")]}
    for sid, eng in solo.items():
        eng.add_stream(sid, "tiny", Conditioning(seed=ord(sid)))
        e.add_stream(sid, "tiny", Conditioning(seed=ord(sid)))
    expected = {sid: play(solo[sid], sid, scripts[sid]) for sid in solo}
    got: dict[str, list] = {sid: [] for sid in solo}
    for i in range(4):  # all three queued together: interleaved, or batched in one step
        for sid in solo:
            e.submit(ChunkRequest(sid, e.new_request_id(), actions=scripts[sid][i]))
        while e.has_work():
            for o in e.step():
                got[o.stream_id].append(o.frames)
    for sid in solo:
        for x, y in zip(got[sid], expected[sid], strict=True):
            diff = np.abs(x.astype(int) - y)
            if max_batch == 1:
                assert diff.max() == 0
            else:
                assert diff.max() <= 1 and (diff > 0).mean() < 1e-3
    # sessions really are different worlds, so any smearing would show
    assert np.abs(got["a"][2].astype(int) - got["b"][2]).mean() > 5


def test_fork_copies_the_committed_world(world):
    e = make_engine(world)
    e.add_stream("orig", "tiny", Conditioning(seed=5))
    play(e, "orig", SCRIPT[:2])
    e.fork_stream("orig", "copy")
    assert e.info("copy").chunks == 2
    same_a = committed(e, "orig", keys("d")).frames
    same_b = committed(e, "copy", keys("d")).frames
    assert np.array_equal(same_a, same_b)
    diff_a = committed(e, "orig", keys("w")).frames
    diff_b = committed(e, "copy", keys("s")).frames
    assert not np.array_equal(diff_a, diff_b)
    # the original is unaffected by the fork's existence
    ref = make_engine(world)
    ref.add_stream("orig", "tiny", Conditioning(seed=5))
    ref_frames = play(ref, "orig", [*SCRIPT[:2], keys("d"), keys("w")])
    assert np.array_equal(ref_frames[3], diff_a)


def test_image_started_world_prefills_the_image_when_the_stream_is_created(image_world):
    e = make_engine(image_world)
    info = e.add_stream("s", "tiny-image", Conditioning(seed=4))
    # the start image is committed frame 0, not a chunk: chunk 1 is the first generated one
    assert info.chunks == 0 and info.latent_frames == 1 and info.video_frames == 1
    assert info.frame.shape == (32, 32, 3) and info.frame.dtype == np.uint8
    expected = image_world.decoder.decode(
        image_world.decoder.encode(image_world._start_image(4)[None]), image_world.decoder.init_cache()
    )[0][-1].numpy()
    assert np.array_equal(info.frame, expected)
    first = committed(e, "s", keys("w"))
    assert first.chunk == 1 and first.frame0 == 1 and first.frames.shape[0] == 4
    # reset prefills the new world's start frame the same way
    again = e.reset_stream("s", Conditioning(seed=4))
    assert again.chunks == 0 and np.array_equal(again.frame, info.frame)
    assert np.array_equal(committed(e, "s", keys("w")).frames, first.frames)


def test_a_carrying_world_starts_each_chunk_from_its_latest_frame(monkeypatch):
    """The tiny world's `carry_channels` (models/tiny_world/plugin.py): the sampler's first input
    holds, in those channels, the latest clean frame of the stream's history (the prefilled
    image, then each chunk's last frame) on every frame; the other channels are the seed's noise.
    Queued together, so that a pipelined engine runs each chunk on top of the one before it."""
    world = small_world(image_start=True, carry=(0, 1), name="tiny-carry")
    first, clean = [], []
    denoise, context = world.denoise, world.context

    def record_denoise(x, t, index, actions):
        if t == world.config.schedule.timesteps[0]:
            first.append(x.clone())
        return denoise(x, t, index, actions)

    def record_context(x0, index, actions, noise=None):
        clean.append(x0.clone())
        return context(x0, index, actions, noise=noise)

    monkeypatch.setattr(world, "denoise", record_denoise)
    monkeypatch.setattr(world, "context", record_context)
    e = make_engine(world)
    e.add_stream("s", "tiny-carry", Conditioning(seed=3))
    for a in SCRIPT[:3]:
        e.submit(ChunkRequest("s", e.new_request_id(), actions=a))
    outs = []
    while e.has_work():
        outs += e.step()
    assert [type(o) for o in outs] == [ChunkCommitted] * 3
    assert len(first) == 3 and len(clean) == 4  # the prefill's clean pass, then one per chunk
    for chunk, (x, prev) in enumerate(zip(first, clean, strict=False), start=1):
        latest = prev[0, :2, -1:]
        assert torch.equal(x[0, :2], latest.expand_as(x[0, :2]))
        draw = world.noise(3, chunk, 0, x.shape[2])
        torch.testing.assert_close(x[0, 2:], draw[2:], rtol=0, atol=0)
        assert not torch.equal(x[0, :2], draw[:2])
    assert torch.equal(e.runner.streams["s"].state.plugin_state.last, clean[-1][0, :, -1:])
    with pytest.raises(ValueError, match="carry_channels"):  # a bad config fails at load
        small_world(carry=(0, 99))


def test_a_failing_prefill_leaves_nothing_behind(image_world, monkeypatch):
    e = make_engine(image_world)
    e.add_stream("ok", "tiny-image", Conditioning(seed=1))
    before = snapshot(e, "ok")

    def broken(*args, **kw):
        raise RuntimeError("prefill exploded")

    monkeypatch.setattr(image_world, "context", broken)
    with pytest.raises(RuntimeError, match="prefill exploded"):
        e.add_stream("s", "tiny-image", Conditioning(seed=4))
    assert "s" not in e.runner.streams and len(e.memory) == 1
    with pytest.raises(RuntimeError, match="prefill exploded"):
        e.reset_stream("ok", Conditioning(seed=9))
    assert_same_snapshot(before, snapshot(e, "ok"))  # the old world stays


def test_a_cancel_wins_before_the_request_reaches_the_engine(world):
    e = make_engine(world)
    e.add_stream("s", "tiny", Conditioning(seed=1))
    e.submit(ChunkRequest("s", e.new_request_id(), actions=keys("w")))
    rid = e.new_request_id()  # handed out, still on its way (the EngineThread's input queue)
    e.abort([rid])
    e.submit(ChunkRequest("s", rid, actions=keys("d")))
    outs = {}
    while e.has_work():
        outs |= {o.request_id: o for o in e.step()}
    cancelled = outs[rid]
    assert isinstance(cancelled, ChunkCancelled) and not cancelled.started and cancelled.chunk == 2
    assert e.info("s").chunks == 1 and not e._live


def test_queued_cancels_name_their_own_chunks(world):
    e = make_engine(world)
    e.add_stream("s", "tiny", Conditioning(seed=1))
    reqs = [ChunkRequest("s", e.new_request_id(), actions=keys("w")) for _ in range(3)]
    for r in reqs:
        e.submit(r)
    e.abort([r.request_id for r in reqs])
    outs = []
    while e.has_work():
        outs += e.step()
    assert sorted(o.chunk for o in outs) == [1, 2, 3]
    assert all(isinstance(o, ChunkCancelled) and not o.started for o in outs)


class _Exploding:
    def take(self, n: int) -> list[FrameAction]:
        raise RuntimeError("source broke")

    def give_back(self, actions) -> None:
        pass


def test_a_failing_action_source_fails_its_chunk_not_the_engine(world):
    e = make_engine(world)
    alone = make_engine(world)
    for eng in (e, alone):
        eng.add_stream("good", "tiny", Conditioning(seed=2))
    e.add_stream("bad", "tiny", Conditioning(seed=1))
    before = snapshot(e, "bad")
    e.submit(ChunkRequest("bad", e.new_request_id(), source=_Exploding()))
    e.submit(ChunkRequest("good", e.new_request_id(), actions=keys("d")))
    outs = {}
    while e.has_work():
        outs |= {o.stream_id: o for o in e.step()}
    assert isinstance(outs["bad"], ChunkFailed) and "source broke" in outs["bad"].message
    assert_same_snapshot(before, snapshot(e, "bad"))
    assert np.array_equal(outs["good"].frames, committed(alone, "good", keys("d")).frames)
    assert committed(e, "bad", keys("w")).chunk == 1  # the stream goes on


def test_non_finite_latents_are_rolled_back(world, monkeypatch):
    e = make_engine(world, max_batch=4)
    clean = make_engine(world)
    for eng in (e, clean):
        for sid, seed in (("bad", 1), ("good", 2)):
            eng.add_stream(sid, "tiny", Conditioning(seed=seed))
            committed(eng, sid, keys("w"))
    before = snapshot(e, "bad")
    denoise = world.denoise

    def poisoned(x, t, index, acts):
        pred = denoise(x, t, index, acts)
        pred[index.rows == e.runner.streams["bad"].state.row] = float("inf")
        return pred

    monkeypatch.setattr(world, "denoise", poisoned)
    e.submit(ChunkRequest("bad", e.new_request_id(), actions=keys("d")))
    e.submit(ChunkRequest("good", e.new_request_id(), actions=keys("d")))
    outs = {}
    while e.has_work():
        outs |= {o.stream_id: o for o in e.step()}
    monkeypatch.setattr(world, "denoise", denoise)
    assert isinstance(outs["bad"], ChunkFailed) and "non-finite" in outs["bad"].message
    assert_same_snapshot(before, snapshot(e, "bad"))
    # Batched with "bad" against alone: the same frames but for fp32 sum order (at most one level).
    assert close_frames(outs["good"].frames, committed(clean, "good", keys("d")).frames)
    assert close_frames(committed(e, "bad", keys("d")).frames, committed(clean, "bad", keys("d")).frames)


def test_a_closed_stream_leaves_no_non_finite_values_to_the_next_owner_of_its_row(world, monkeypatch):
    # Rows of other tests' abandoned engines come back now and not mid-test, where a collection
    # would free a lower row and the next stream would lease that one instead of the closed one.
    gc.collect()
    gc.disable()
    try:
        _closed_stream_then_next_owner(world, monkeypatch)
    finally:
        gc.enable()


def _closed_stream_then_next_owner(world, monkeypatch) -> None:
    e = make_engine(world)
    e.add_stream("bad", "tiny", Conditioning(seed=1))
    committed(e, "bad", keys("w"))
    row = e.runner.streams["bad"].state.row
    denoise = world.denoise

    def poisoned(x, t, index, acts):
        return torch.full_like(denoise(x, t, index, acts), float("nan"))

    monkeypatch.setattr(world, "denoise", poisoned)
    (out,) = run_chunk(e, "bad", keys("d"))
    monkeypatch.setattr(world, "denoise", denoise)
    assert isinstance(out, ChunkFailed)
    e.remove_stream("bad")  # closed right after the failure: its chunk never runs again
    e.add_stream("next", "tiny", Conditioning(seed=2))
    assert e.runner.streams["next"].state.row == row
    assert all(torch.isfinite(b).all() for b in world.transformer.pool.row_view(row).values())
    alone = make_engine(world)
    alone.add_stream("next", "tiny", Conditioning(seed=2))
    assert close_frames(play(e, "next", SCRIPT)[-1], play(alone, "next", SCRIPT)[-1])


@pytest.mark.parametrize(
    ("action", "field"),
    [
        (FrameAction(mouse=(1e39, 0.0)), "mouse"),
        (FrameAction(mouse=(float("nan"), 0.0)), "mouse"),
        (FrameAction(vector=(1e300, 0.0)), "vector"),
    ],
)
def test_actions_outside_the_documented_range_are_refused(world, action, field):
    e = make_engine(world)
    e.add_stream("s", "tiny", Conditioning())
    space = world.action_space
    if field == "vector" and space.vector_dim != 2:
        action = FrameAction(vector=(1e300,) + (0.0,) * (space.vector_dim - 1))
    with pytest.raises(InvalidRequest) as err:
        e.submit(ChunkRequest("s", e.new_request_id(), actions=[action]))
    assert err.value.field == field
    assert not e._live  # the refused id does not linger


def test_remove_stream_frees_device_state_before_the_budget(world):
    e = make_engine(world)
    free = world.free_rows
    e.add_stream("a", "tiny", Conditioning())
    assert world.free_rows == free - 1
    e.remove_stream("a")
    assert world.free_rows == free and len(e.memory) == 0  # the pool row is back, no GC needed


def test_client_image_must_match_the_model(image_world):
    from models.world import ConditioningError

    e = make_engine(image_world)
    with pytest.raises(ConditioningError):
        e.add_stream("s", "tiny-image", Conditioning(seed=1, image=np.zeros((8, 8, 3), np.uint8)))
    assert len(e.memory) == 0  # the reservation was released
    img = np.full((32, 32, 3), 200, np.uint8)
    info = e.add_stream("s", "tiny-image", Conditioning(seed=1, image=img))
    assert info.frame.shape == (32, 32, 3)
    assert committed(e, "s").frames.shape == (4, 32, 32, 3)


def test_limits_and_bad_requests(world):
    e = make_engine(world, max_streams=1, max_queued_per_stream=2)
    e.add_stream("a", "tiny", Conditioning())
    with pytest.raises(CapacityError):
        e.add_stream("b", "tiny", Conditioning())
    with pytest.raises(StreamNotFound):
        e.submit(ChunkRequest("nope", e.new_request_id()))
    with pytest.raises(InvalidRequest, match="keys"):
        e.submit(ChunkRequest("a", e.new_request_id(), actions=[FrameAction(frozenset({"jump"}))]))
    with pytest.raises(InvalidRequest, match="1 or 3"):
        e.submit(ChunkRequest("a", e.new_request_id(), actions=[FrameAction()] * 2))
    e.submit(ChunkRequest("a", e.new_request_id()))
    e.submit(ChunkRequest("a", e.new_request_id()))
    with pytest.raises(CapacityError):
        e.submit(ChunkRequest("a", e.new_request_id()))
    e.remove_stream("a")
    e.add_stream("b", "tiny", Conditioning())  # the slot is free again
    dropped = []
    while e.has_work():
        dropped += e.step()
    assert len(dropped) == 2 and all(isinstance(o, ChunkCancelled) and not o.started for o in dropped)
    assert "a" not in e.runner.streams


def test_reset_gives_a_fresh_world(world):
    e = make_engine(world)
    e.add_stream("s", "tiny", Conditioning(seed=9))
    first = play(e, "s", SCRIPT[:2])
    e.reset_stream("s", Conditioning(seed=9))
    assert e.info("s").chunks == 0
    again = play(e, "s", SCRIPT[:2])
    assert all(np.array_equal(x, y) for x, y in zip(first, again, strict=True))


class Buffer:
    """A realtime action source that records what it handed out and got back."""

    def __init__(self) -> None:
        self.mouse = [4.0, -2.0]
        self.returned = 0

    def take(self, n: int) -> list[FrameAction]:
        dx, dy = self.mouse
        self.mouse = [0.0, 0.0]
        return [FrameAction(frozenset({"w"}), (dx / n, dy / n))] * n

    def give_back(self, actions) -> None:
        self.returned += 1
        self.mouse[0] += sum(a.mouse[0] for a in actions)
        self.mouse[1] += sum(a.mouse[1] for a in actions)


def test_realtime_source_is_read_at_begin_and_refunded_on_rollback(world):
    e = make_engine(world)
    e.add_stream("s", "tiny", Conditioning())
    src = Buffer()
    req = ChunkRequest("s", e.new_request_id(), source=src)
    e.submit(req)

    def hook(sid: str, name: str) -> None:
        if name == "decode":
            e.abort([req.request_id])

    e.runner.boundary_hook = hook
    while e.has_work():
        e.step()
    assert src.returned == 1 and src.mouse == pytest.approx([4.0, -2.0])
    e.runner.boundary_hook = None
    e.submit(ChunkRequest("s", e.new_request_id(), source=src))
    outs = []
    while e.has_work():
        outs += e.step()
    (out,) = outs
    assert isinstance(out, ChunkCommitted) and out.actions[0].keys == {"w"}
    assert sum(a.mouse[0] for a in out.actions) == pytest.approx(4.0)


def test_timings_are_reported(world):
    e = make_engine(world)
    e.add_stream("s", "tiny", Conditioning())
    t = committed(e, "s").timings.as_dict()
    assert set(t) == {"queue", "denoise", "context", "decode", "total"}
    assert t["total"] >= t["denoise"] > 0


def test_the_frames_shown_are_the_canonical_latents_the_history_keeps():
    """`World.canonical` runs once on a generated chunk, and the clean pass and the decode both
    get its result (a tile-aligned world snaps its chunks: what is shown is what it remembers)."""
    w = small_world()
    seen: dict[str, list[torch.Tensor]] = {"in": [], "ctx": []}

    def canonical(x0: torch.Tensor) -> torch.Tensor:
        seen["in"].append(x0.clone())
        return torch.zeros_like(x0)

    ctx = w.context

    def context(x0: torch.Tensor, *args, **kwargs) -> None:
        seen["ctx"].append(x0.clone())
        ctx(x0, *args, **kwargs)

    w._canonical = canonical
    w.context = context  # type: ignore[method-assign]
    e = make_engine(w)
    e.add_stream("s", "tiny", Conditioning(seed=7))
    frames = committed(e, "s", keys("d")).frames
    assert len(seen["in"]) == 1 and seen["in"][0].abs().sum() > 0
    assert len(seen["ctx"]) == 1 and not seen["ctx"][0].any()
    want, _ = w.decoder.decode(torch.zeros_like(seen["in"][0][0]), w.decoder.init_cache())
    assert np.array_equal(frames, want.numpy())


def test_lockstep_streams_take_turns_through_the_engine(world):
    """Six streams that each send their next step as soon as their chunk commits, batches of
    four: after every step the streams' chunk counts differ by at most one."""
    e = make_engine(world, max_batch=4)
    names = [f"s{i}" for i in range(6)]
    for sid in names:
        e.add_stream(sid, "tiny", Conditioning(seed=1))
        e.submit(ChunkRequest(sid, e.new_request_id(), actions=keys("w")))
    counts = dict.fromkeys(names, 0)
    while min(counts.values()) < 4:
        for o in e.step():
            assert isinstance(o, ChunkCommitted)
            counts[o.stream_id] += 1
            e.submit(ChunkRequest(o.stream_id, e.new_request_id(), actions=keys("d")))
        assert max(counts.values()) - min(counts.values()) <= 1, counts


def test_the_engine_measures_its_chunk_rate_and_each_chunks_queue_wait(world):
    from runtime.metrics import REGISTRY

    labels = {"model": "tiny", "mode": "lockstep"}
    waits_before = REGISTRY.get_sample_value("worldserve_queue_wait_seconds_count", labels) or 0.0
    e = make_engine(world, max_batch=2)
    for sid in ("a", "b"):
        e.add_stream(sid, "tiny", Conditioning(seed=2))
    assert e.throughput.rate("tiny") is None  # nothing measured: admission refuses nothing
    for _ in range(4):
        for sid in ("a", "b"):
            e.submit(ChunkRequest(sid, e.new_request_id(), actions=keys("w")))
        while e.has_work():
            e.step()
    e.submit(ChunkRequest("a", e.new_request_id(), actions=keys("w")))
    e.step()  # a new batch closes the last one's sample (its owed clean pass included)
    rate = e.throughput.rate("tiny")
    assert rate is not None and rate > 0  # batches of two, the first (warm-up) not counted
    assert REGISTRY.get_sample_value("worldserve_chunk_rate", {"model": "tiny"}) == pytest.approx(rate)
    waits = REGISTRY.get_sample_value("worldserve_queue_wait_seconds_count", labels)
    assert waits == waits_before + 9  # every chunk's submit -> batch, once
