"""Prompt switching through the served path, against LongLive's original interactive pipeline
(tests/fixtures/golden/make_longlive_golden.py: base + LoRA, two switches with its K/V re-cache),
and the switch as part of the chunk's transaction (cancel, fork)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from models.registry import load_world
from models.world import Conditioning, World
from runtime import parity
from runtime.engine import Engine
from runtime.requests import ChunkCancelled, ChunkCommitted, ChunkRequest
from tests.fixtures.golden import GOLDEN
from tests.fixtures.golden.served import write_longlive_dir

GOLDEN_FILE = GOLDEN / "longlive_rollout.safetensors"


@pytest.fixture(scope="module")
def ll_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_longlive_dir(tmp_path_factory.mktemp("ll"))


@pytest.fixture
def golden() -> parity.Golden:
    return parity.load_golden(GOLDEN_FILE)


def test_served_longlive_replays_the_original_switching_rollout(ll_dir: Path, golden: parity.Golden) -> None:
    world = load_world(ll_dir)
    assert world.config.prompt_switch == "recache" and world.transformer.cfg.keep_latents
    result = parity.compare(golden, parity.replay(world, golden))
    assert not result.not_produced
    # 6 chunks x (4 steps + ctx) x (input, t, 2 blocks) + 24 flow + 24 x0 + latents
    assert len(result.diffs) == len(golden.outputs) == 169
    # the switches are at frames 6 (chunk 2, every frame re-cached) and 12 (chunk 4, after the roll)
    assert {"x0.c2.s0", "x0.c4.s0", "block1.c5.ctx", "latents"} <= set(result.diffs)
    name, worst = result.worst
    assert worst < 1e-4, (name, worst)


def test_without_the_recache_the_chunks_after_a_switch_differ(ll_dir: Path, golden: parity.Golden) -> None:
    world = load_world(ll_dir)
    world.config.prompt_switch = "plain"  # only the text K/V changes at a switch
    result = parity.compare(golden, parity.replay(world, golden))
    assert max(result.diffs[f"x0.c{c}.s3"] for c in (0, 1)) < 1e-4  # before the first switch: equal
    assert result.diffs["x0.c2.s0"] > 1e-2  # the first chunk under the new prompt reads re-cached K/V


def test_without_the_switches_the_first_segment_is_unchanged(ll_dir: Path, golden: parity.Golden) -> None:
    world = load_world(ll_dir)
    golden.meta["rollout"]["switch_frame_indices"] = []
    result = parity.compare(golden, parity.replay(world, golden))
    assert max(v for k, v in result.diffs.items() if ".c0." in k or ".c1." in k) < 1e-4
    assert result.diffs["x0.c2.s3"] > 1e-2


def _engine(world: World) -> tuple[Engine, parity.GoldenPrompts]:
    golden = parity.load_golden(GOLDEN_FILE)
    world.prompts = parity.GoldenPrompts(golden.tensors)
    return Engine({world.config.id: world}, max_batch=2, max_streams=3), world.prompts


def _run(engine: Engine, stream: str, prompt: str | None = None, cancel: str | None = None) -> object:
    rid = engine.new_request_id()
    engine.submit(ChunkRequest(stream, rid, actions=[], prompt=prompt))
    if cancel is not None:
        engine.runner.boundary_hook = lambda sid, name: engine.abort([rid]) if name == cancel else None
    outcomes = []
    try:
        while engine.has_work():
            outcomes += engine.step()
    finally:
        engine.runner.boundary_hook = None
    (out,) = [o for o in outcomes if o.request_id == rid]
    return out


def _cond() -> Conditioning:
    return Conditioning(seed=5, prompt="segment 0")


def test_a_cancelled_switch_leaves_the_old_prompt(ll_dir: Path) -> None:
    world = load_world(ll_dir)
    engine, _ = _engine(world)
    for sid in ("a", "b"):
        engine.add_stream(sid, world.config.id, _cond())
    for _ in range(4):  # past the window: the re-cache keeps the sinks' K/V
        for sid in ("a", "b"):
            assert isinstance(_run(engine, sid), ChunkCommitted)
    free = world.free_rows
    for boundary in ("denoise:0", "denoise:3", "decode", "commit"):
        out = _run(engine, "a", prompt="segment 1", cancel=boundary)
        assert isinstance(out, ChunkCancelled), boundary
        assert world.free_rows == free  # the switch's staged row went back
    a, b = _run(engine, "a"), _run(engine, "b")  # the next chunk: no switch
    assert isinstance(a, ChunkCommitted) and isinstance(b, ChunkCommitted)
    assert (a.frames == b.frames).all()
    switched = _run(engine, "a", prompt="segment 1")
    plain = _run(engine, "b")
    assert not (switched.frames == plain.frames).all()
    assert engine.runner.streams["a"].state.prompt == "segment 1"


def test_frames_before_a_switch_are_unchanged_and_a_fork_copies_the_prompt(ll_dir: Path) -> None:
    world = load_world(ll_dir)
    engine, _ = _engine(world)
    engine.add_stream("a", world.config.id, _cond())
    engine.add_stream("b", world.config.id, _cond())
    before = [(_run(engine, "a").frames, _run(engine, "b").frames) for _ in range(2)]
    assert all((x == y).all() for x, y in before)
    _run(engine, "a", prompt="segment 2")
    engine.fork_stream("a", "f")  # the fork runs under the switched prompt and its re-cached K/V
    assert engine.runner.streams["f"].state.prompt == "segment 2"
    for _ in range(2):
        x, y = _run(engine, "a"), _run(engine, "f")
        assert (x.frames == y.frames).all()


def test_a_switch_to_an_unknown_prompt_fails_only_that_chunk(ll_dir: Path) -> None:
    world = load_world(ll_dir)
    engine, _ = _engine(world)
    engine.add_stream("a", world.config.id, _cond())
    _run(engine, "a")
    free = world.free_rows
    out = _run(engine, "a", prompt="segment 9")
    assert "prompt switch failed" in out.message and world.free_rows == free
    assert isinstance(_run(engine, "a"), ChunkCommitted)


def test_a_switch_waits_for_a_free_row(ll_dir: Path) -> None:
    world = load_world(ll_dir)
    engine, _ = _engine(world)
    engine.add_stream("a", world.config.id, _cond())
    _run(engine, "a")
    held = []
    while world.free_rows:  # somebody else holds every free row for a while
        held.append(world._lease_row())
    rid = engine.new_request_id()
    engine.submit(ChunkRequest("a", rid, actions=[], prompt="segment 1"))
    assert not any(isinstance(o, ChunkCommitted) for o in engine.step())
    assert engine.has_work()  # requeued, not failed
    for row, lease in held:
        world.free_row(row, lease)
    outcomes = []
    while engine.has_work():
        outcomes += engine.step()
    assert [type(o) for o in outcomes] == [ChunkCommitted]


def test_the_kept_latents_count_in_a_session_bytes(ll_dir: Path) -> None:
    world = load_world(ll_dir)
    cfg = world.transformer.cfg
    c, h, w = world.latent_shape
    frames = cfg.sink_frames + cfg.window_frames + world.slack_frames
    with_latents = world.session_bytes()
    cfg.keep_latents = False
    assert with_latents - world.session_bytes() == frames * c * h * w * torch.finfo(world.dtype).bits // 8


@pytest.mark.parametrize("pipeline", [False, True])
def test_a_switch_queued_among_chunks_matches_the_serial_one(ll_dir: Path, pipeline: bool) -> None:
    """Chunks queued back to back (pipelined: the switching chunk runs on top of its predecessor's
    uncommitted K/V, and the next on top of the switch's staged row) give the frames of the chunks
    run one at a time."""

    def frames(engine: Engine, queued: bool) -> list:
        world = next(iter(engine.worlds.values()))
        engine.add_stream("a", world.config.id, _cond())
        plan = [None, None, None, "segment 1", None, "segment 2", None]
        if not queued:
            return [_run(engine, "a", prompt=p).frames for p in plan]
        rids = []
        for p in plan:
            rids.append(engine.new_request_id())
            engine.submit(ChunkRequest("a", rids[-1], actions=[], prompt=p))
        outcomes = []
        while engine.has_work():
            outcomes += engine.step()
        by_id = {o.request_id: o for o in outcomes}
        return [by_id[r].frames for r in rids]

    serial = frames(_engine(load_world(ll_dir))[0], queued=False)
    world = load_world(ll_dir)
    world.prompts = parity.GoldenPrompts(parity.load_golden(GOLDEN_FILE).tensors)
    engine = Engine({world.config.id: world}, max_batch=2, max_streams=3, pipeline=pipeline)
    queued = frames(engine, queued=True)
    assert all((x == y).all() for x, y in zip(serial, queued, strict=True))
    assert engine.runner.streams["a"].state.prompt == "segment 2"
