"""Sessions that keep an atlas (models/tiny_world/atlas.py) in the chunk loop: without a terrain
prior the world plays as without an atlas until a place comes back into view, then draws the
tiles it showed there; with one, the tiles that come into view first are the prior's, the same
ones each time; the atlas moves only in a commit, so a cancelled chunk leaves it as it was and a
pipelined chunk that loses the chunk below it runs again on the committed one; a fork shares it
and a reset starts a new one."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import numpy as np
import pytest
import torch

from models.registry import from_name, load_world
from models.tiny_world import WEIGHTS_DIR
from models.tiny_world.metrics import free_worlds
from models.tiny_world.plugin import TinyWorldPlugin, TinyWorldSettings
from models.world import Conditioning, World
from runtime.engine import Engine
from runtime.errors import CapacityError
from runtime.requests import ChunkCancelled, ChunkRequest
from tests.runtime.conftest import committed, keys, run_chunk, small_world

OUT, BACK = "d" * 8, "a" * 8  # 32 px right (the tiles on the left leave the window), then back


def with_atlas(world: World, tiles: int) -> World:
    """`world` (its DiT, decoder and motion head) with sessions keeping an atlas `tiles` across (0: none)."""
    settings = replace(world.plugin.settings, atlas_tiles=tiles)
    return World(
        world.config,
        world.transformer,
        world.decoder,
        start_image=world._start_image,
        plugin=TinyWorldPlugin(settings, motion=world.plugin.motion),
    )


@pytest.fixture(scope="module")
def mapped() -> World:
    world = from_name("tiny-world")
    assert world.plugin.remembers  # the shipped world keeps an atlas
    return world


@pytest.fixture(scope="module")
def plain(mapped: World) -> World:
    return with_atlas(mapped, 0)


@pytest.fixture(scope="module")
def remembering(mapped: World) -> World:
    """The shipped world's atlas without its terrain prior."""
    assert mapped.plugin.terrain is not None
    return with_atlas(mapped, mapped.plugin.settings.atlas_tiles)


@pytest.fixture(scope="module")
def seed() -> int:
    return free_worlds(1, 48, 1_060_000, keys="da")[0]


def play(world: World, seed: int, script: str) -> tuple[Engine, list[np.ndarray]]:
    engine = Engine({"m": world})
    start = engine.add_stream("s", "m", Conditioning(seed=seed)).frame
    return engine, [start[None]] + [committed(engine, "s", keys(k)).frames for k in script]


def test_a_world_plays_as_without_an_atlas_until_a_place_comes_back(plain, remembering, seed):
    _, without = play(plain, seed, OUT + BACK)
    engine, with_atlas = play(remembering, seed, OUT + BACK)
    out = len(OUT) + 1
    assert all(np.array_equal(a, b) for a, b in zip(without[:out], with_atlas[:out], strict=True))
    # Back on the start's anchor, every tile wholly in view is drawn as the start frame drew it.
    st, carto = engine.runner.streams["s"].state, remembering.plugin.cartographer
    assert st.plugin_state.atlas.origin.tolist() == [0, 0]
    pos = carto.phase(st.plugin_state.last[:, 0][None])
    start, end = with_atlas[0][0], with_atlas[-1][-1]
    assert torch.equal(pos, carto.phase(remembering.decoder.encode(start[None])[:, 0][None]))
    x, y = (pos[0] + 2 * carto.s).tolist()
    whole = carto.whole(pos + 2 * carto.s)[0, 0].repeat_interleave(carto.s, 0).repeat_interleave(carto.s, 1)
    whole = whole[y : y + 64, x : x + 64].numpy()
    same = np.abs(end.astype(int) - start).max(axis=-1) <= 24
    assert whole.sum() >= 49 * 64 and same[whole].mean() > 0.97


def test_the_terrain_prior_draws_what_comes_into_view_first_the_same_each_time(remembering, mapped, seed):
    _, own = play(remembering, seed, OUT)
    _, drawn = play(mapped, seed, OUT)
    _, again = play(mapped, seed, OUT)
    assert all(np.array_equal(a, b) for a, b in zip(drawn, again, strict=True))
    assert np.array_equal(own[0], drawn[0])  # the start frame is the game's
    differ = [not np.array_equal(a, b) for a, b in zip(own[1:], drawn[1:], strict=True)]
    assert differ[-1] and sum(differ) >= len(OUT) // 2  # the new columns are the prior's


@pytest.mark.parametrize("boundary", ["denoise:0", "decode", "commit"])  # the clean pass runs after commit
def test_a_cancelled_chunk_leaves_the_atlas_as_it_was(mapped, seed, boundary):
    engine, _ = play(mapped, seed, OUT)
    reference, _ = play(mapped, seed, OUT)
    st = engine.runner.streams["s"].state
    before = st.plugin_state.atlas

    def hook(stream_id: str, name: str) -> None:
        if name == boundary:
            engine.abort(engine._live)

    engine.runner.boundary_hook = hook
    outcomes = run_chunk(engine, "s", keys("a"))
    assert [type(o) for o in outcomes] == [ChunkCancelled]
    assert st.plugin_state.atlas is before
    engine.runner.boundary_hook = None
    for k in BACK:
        got, expected = committed(engine, "s", keys(k)), committed(reference, "s", keys(k))
        assert np.array_equal(got.frames, expected.frames)


def test_a_pipelined_chunk_on_a_cancelled_one_runs_again_on_the_committed_atlas(seed):
    def run(pipeline: bool) -> list[tuple]:
        engine = Engine({"m": from_name("tiny-world")}, pipeline=True)  # its own K/V pool
        engine.runner.pipeline = pipeline
        engine.add_stream("s", "m", Conditioning(seed=seed))
        reqs = [ChunkRequest("s", engine.new_request_id(), actions=keys(k)) for k in OUT + BACK]
        commits = {"n": 0}

        def hook(stream_id: str, name: str) -> None:
            if name == "commit":
                commits["n"] += 1
                if commits["n"] == len(OUT) + 2:  # the second chunk back
                    engine.abort([reqs[len(OUT) + 1].request_id])

        engine.runner.boundary_hook = hook
        todo, outs = list(reqs), []
        while todo or engine.has_work():
            while todo and engine.scheduler.queued("s") < 2:  # two ahead: the pipeline overlaps them
                engine.submit(todo.pop(0))
            outs += engine.step()
        return [(type(o).__name__, o.chunk, getattr(o, "frames", None)) for o in outs]

    serial, piped = run(False), run(True)
    assert [o[:2] for o in piped] == [o[:2] for o in serial]
    assert ("ChunkCancelled", len(OUT) + 2) in [o[:2] for o in piped]
    for a, b in zip(piped, serial, strict=True):
        if a[2] is not None:
            assert np.abs(a[2].astype(int) - b[2]).max() <= 1


def test_a_fork_shares_the_atlas_and_a_reset_starts_a_new_one(mapped, seed):
    engine, _ = play(mapped, seed, OUT)
    src = engine.runner.streams["s"].state
    engine.fork_stream("s", "f")
    assert engine.runner.streams["f"].state.plugin_state.atlas is src.plugin_state.atlas
    kept = src.plugin_state.atlas
    committed(engine, "f", keys("a"))
    assert src.plugin_state.atlas is kept and engine.runner.streams["f"].state.plugin_state.atlas is not kept
    engine.reset_stream("s", Conditioning(seed=seed + 1))
    fresh = engine.runner.streams["s"].state.plugin_state.atlas
    assert fresh is not kept and fresh.origin.tolist() == [0, 0]


def test_an_atlas_needs_tile_aligned_latents():
    w = small_world()
    with pytest.raises(ValueError, match="tile-aligned"):
        World(w.config, w.transformer, w.decoder, plugin=TinyWorldPlugin(TinyWorldSettings(atlas_tiles=64)))


def test_a_model_directory_asking_for_an_atlas_needs_a_motion_head(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(WEIGHTS_DIR, model)
    meta = json.loads((model / "worldserve.json").read_text())
    del meta["plugin"]["motion"]
    (model / "worldserve.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="atlas_tiles needs a motion head"):
        load_world(model)


@pytest.mark.parametrize("key, value", [("world_tiles", 40), ("wall_rgb", [[92, 82, 78], [70, 62, 60]])])
def test_a_model_directory_with_a_removed_game_rule_fails_to_load(tmp_path, key, value):
    # The game's world size and wall colours once ran at serve time (the camera stopped at the
    # world's edge, the border's wall was pinned): such a directory must not load and silently
    # serve without them.
    model = tmp_path / "model"
    shutil.copytree(WEIGHTS_DIR, model)
    meta = json.loads((model / "worldserve.json").read_text())
    assert key not in meta["plugin"]  # the shipped directory has none
    meta["plugin"][key] = value
    (model / "worldserve.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=rf"\['{key}'\] were removed \(hand-written game rules.*delete them"):
        load_world(model)


def test_a_sessions_atlas_counts_in_the_engines_byte_budget(mapped, plain):
    # The atlas and the creature trail (3 channels x 2 frames x 12 x 12 fp32), each counted twice:
    # the committed version and a chunk's in flight.
    state = mapped.plugin.cartographer.nbytes(4) + 3 * 2 * 12 * 12 * 4
    assert mapped.plugin.state_bytes() == state
    assert mapped.session_bytes() == mapped.kv_bytes_per_session() + 2 * state
    assert plain.session_bytes() == plain.kv_bytes_per_session()
    spare_and_padding = 2 * mapped.kv_bytes_per_session()
    engine = Engine({"m": mapped}, max_kv_bytes=spare_and_padding + mapped.session_bytes())
    engine.add_stream("a", "m", Conditioning(seed=1))
    assert engine.memory.used_bytes == mapped.session_bytes()
    assert engine.runner.streams["a"].state.plugin_state.atlas.nbytes == mapped.plugin.cartographer.nbytes(4)
    engine.remove_stream("a")
    tight = Engine({"m": mapped}, max_kv_bytes=spare_and_padding + mapped.session_bytes() - 1)
    with pytest.raises(CapacityError):
        tight.add_stream("a", "m", Conditioning(seed=1))
