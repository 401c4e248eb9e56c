"""The trainer's teacher-forced sequence equals the engine's cached rollout, chunk for chunk.

One dense forward over [clean copies | noisy copies] with shared RoPE positions must give, for
every noisy chunk, what `forward_chunk` gives when the clean chunks before it went through
context passes into a windowed KV cache (the serving path).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.tiny_world.training.config import lr_at
from models.tiny_world.training.dit import sample_sigmas, teacher_forcing_layout
from runtime.kv_cache import KVLayout
from tests.models.conftest import tiny_actions, tiny_config

H = W = 8
TOL = 1e-5


@torch.no_grad()
@pytest.mark.parametrize(("n_chunks", "chunk", "window"), [(3, 2, 16), (4, 2, 5), (3, 3, 4)])
def test_teacher_forcing_matches_cached_rollout(make_model, n_chunks, chunk, window):
    cfg = tiny_config(
        chunk_frames=chunk,
        window_frames=window,
        action=tiny_actions(mouse=False, vector_dim=0, frames_per_latent=1),
    )
    model = make_model(cfg)
    mask, positions, f = teacher_forcing_layout(n_chunks, chunk, window)
    clean = torch.randn(1, 4, f, H, W)
    noisy = torch.randn(1, 4, f - 1, H, W)
    sizes = [1] + [chunk] * n_chunks
    per_chunk = torch.rand(len(sizes)) * 100  # noisy-history augmentation: small timesteps per chunk
    t_clean = per_chunk.repeat_interleave(torch.tensor(sizes))[None]  # (1, F)
    t_noisy = torch.tensor([[900.0] * chunk + [500.0] * chunk + [250.0] * chunk * (n_chunks - 2)])
    actions = torch.randn(1, f, 1, 3 + 2)
    text = model.text_kv(torch.randn(2, 8))
    dense = model.forward_dense(
        torch.cat([clean, noisy], 2),
        torch.cat([t_clean, t_noisy], 1),
        [text],
        mask,
        torch.cat([actions, actions[:, 1:]], 1),
        positions,
    )[:, :, f:]

    layout = KVLayout(0, window, model.tokens_per_frame(H, W))
    model.setup_caches(1, H, W, text_tokens=2)
    model.pool.set_text(0, text.k, text.v)
    start = 0
    for n in sizes:
        if start > 0:  # denoise the noisy copy of this chunk against the committed cache
            sl = slice(start, start + n)
            got = model.forward_chunk(
                noisy[:, :, start - 1 : start - 1 + n],
                t_noisy[:, start - 1],
                layout.index([0], [start], n, model.pool.pad_row),
                actions[:, sl],
            )
            assert (got - dense[:, :, start - 1 : start - 1 + n]).abs().max().item() <= TOL
        # then the context pass of its clean copy
        model.forward_chunk(
            clean[:, :, start : start + n],
            t_clean[:, start],
            layout.index([0], [start], n, model.pool.pad_row),
            actions[:, start : start + n],
            need_output=False,
        )
        start += n


def test_layout_shapes_and_positions():
    mask, positions, f = teacher_forcing_layout(2, 3, 8)
    assert f == 7 and mask.shape == (13, 13)
    assert positions.tolist() == [0, 1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6]
    assert not mask[:7, 7:].any()  # clean copies never see noisy ones
    assert not mask[10, 4:7].any() and mask[10, 10:13].all()  # a noisy chunk: itself, not its clean copy


def test_schedule_helpers():
    assert lr_at(0, 100, 1.0, 10) == pytest.approx(0.1)
    assert lr_at(10, 100, 1.0, 10) == pytest.approx(1.0)
    assert lr_at(100, 100, 1.0, 10) == pytest.approx(0.05)
    s = sample_sigmas(torch.Generator().manual_seed(0), (1000,), [1.0, 0.5], 3.0, 0.5)
    assert s.min() >= 0 and s.max() <= 1 and (s == 1.0).float().mean() > 0.2


def with_transformer(world, transformer, path):
    """`world` (its decoder, motion head and terrain prior) with another DiT, written to the model
    directory `path` and loaded back from it, as a trainer's export is served."""
    from models.registry import load_world, save_world
    from models.world import World

    other = World(
        world.config,
        transformer.eval(),
        world.decoder,
        start_image=None,
        plugin=world.plugin,
    )
    save_world(other, path, start_image={"kind": "game", "size": 64})
    return load_world(path)


def serve_random_policy(world, seed: int, n_chunks: int) -> tuple[np.ndarray, list[frozenset[str]]]:
    """One engine session of `world` (seed `seed`) under the game's random policy for `n_chunks`
    chunks: its frames (start frame first) and the policy's keys."""
    from models.actions import FrameAction
    from models.game import random_policy
    from models.world import Conditioning
    from runtime.engine import Engine
    from runtime.requests import ChunkRequest

    chunk = world.chunk_frames
    script = random_policy(seed, n_chunks * chunk)
    engine = Engine({world.config.id: world}, max_batch=1)
    frames = {0: engine.add_stream("s", world.config.id, Conditioning(seed=seed)).frame[None]}
    for j in range(n_chunks):
        acts = [FrameAction(frozenset(k)) for k in script[j * chunk : (j + 1) * chunk]]
        engine.submit(ChunkRequest("s", engine.new_request_id(), actions=acts))
    while engine.has_work():
        for o in engine.step():
            frames[o.frame0] = o.frames
    return np.concatenate([frames[k] for k in sorted(frames)]), script


@torch.no_grad()
@pytest.mark.parametrize("sink, carry", [(False, False), (True, False), (False, True)])
def test_self_forced_history_is_the_engines_rollout(sink, carry, tmp_path):
    """The sf stage's history (`rollout_history`) is what a session would show:
    driven with the engine's own noise, it decodes to the engine's frames. Also with a sink
    frame and a window short enough that the sink is all that is left of the start, and with
    the player's place and the view's phase carried from each chunk's latest frame
    (`--sf-place-start`, `--sf-view-start`)."""
    import json
    import shutil

    from models.registry import from_name, load_world
    from models.tiny_world import WEIGHTS_DIR, carried_channels
    from models.tiny_world.data import action_rows
    from models.tiny_world.training.history import rollout_history
    from models.world import Conditioning

    shipped_carry = from_name("tiny-world").plugin.settings.carry_channels
    # The trainer's rollouts draw every tile and creature themselves: the world is served here
    # without the terrain prior, whose draws the atlas pins (the tiles shown never come back in
    # these chunks), and without the creature head, whose walk is pinned likewise.
    shutil.copytree(WEIGHTS_DIR, tmp_path / "w")
    card = json.loads((tmp_path / "w" / "worldserve.json").read_text())
    del card["plugin"]["terrain"], card["plugin"]["creatures"]
    if sink:
        card["transformer"].update(sink_frames=1, window_frames=8)
    if carry:
        card["plugin"]["carry_channels"] = list(carried_channels(place=True, view=True))
    (tmp_path / "w" / "worldserve.json").write_text(json.dumps(card))
    world, n_chunks = load_world(tmp_path / "w"), 4 if sink or carry else 2
    assert world.plugin.terrain is None and world.transformer.cfg.sink_frames == int(sink)
    assert world.plugin.settings.carry_channels == (carried_channels(True, True) if carry else shipped_carry)
    seed, chunk = 1_000_123, world.chunk_frames
    served, script = serve_random_policy(world, seed, n_chunks)

    start = world.init_state(Conditioning(seed=seed)).start_latents  # (C, 1, h, w)
    x0 = torch.zeros(1, start.shape[0], 1 + n_chunks * chunk, *start.shape[2:])
    x0[0, :, :1] = start
    actions = torch.from_numpy(action_rows(script))[None, :, None]
    noise = lambda j, k: world.noise(seed, j + 1, k, chunk)[None]  # noqa: E731 (chunk 0: the prefill)
    sched = world.config.schedule
    gen = torch.Generator()
    carried = world.plugin.settings.carry_channels
    lat = rollout_history(
        world.transformer,
        x0,
        actions,
        sched,
        gen,
        noise,
        canonical=world.canonical,
        carry_channels=carried,
        motion=world.plugin.motion,
    )
    mine, _ = world.decoder.decode(lat[0], world.decoder.init_cache())
    assert np.abs(mine.numpy().astype(int) - served.astype(int)).max() <= 1
    if carry:  # the carried channels matter: without them the same noise gives another rollout
        plain = rollout_history(world.transformer, x0, actions, sched, gen, noise, canonical=world.canonical)
        assert not torch.equal(plain, lat)


def test_rollout_history_from_a_later_chunk_keeps_the_given_history():
    from models.registry import from_name
    from models.tiny_world.training.history import rollout_history

    world = from_name("tiny-world")
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(1, 9, *world.latent_shape, generator=gen).transpose(1, 2)  # (1, C, 9, h, w)
    actions = torch.zeros(1, 9, 1, world.action_space.width)
    sched = world.config.schedule
    kept = rollout_history(world.transformer, x0, actions, sched, torch.Generator().manual_seed(1), first=1)
    assert torch.equal(kept[:, :, :5], x0[:, :, :5])  # start frame and chunk 1: the given history
    assert not torch.equal(kept[:, :, 5:], x0[:, :, 5:])  # chunk 2: generated
    own = rollout_history(world.transformer, x0, actions, sched, torch.Generator().manual_seed(1))
    assert not torch.equal(own[:, :, 1:5], x0[:, :, 1:5])  # from chunk 0 everything is generated


@torch.no_grad()
def test_rollout_history_leaves_a_serving_cache_as_it_was():
    """`rollout_history` runs through the model's K/V cache; a session served by the same module
    goes on after it as if nothing had run in between."""
    from models.actions import FrameAction
    from models.registry import from_name
    from models.tiny_world.training.history import rollout_history
    from models.world import Conditioning
    from runtime.engine import Engine
    from runtime.requests import ChunkRequest

    def serve(interrupt: bool) -> np.ndarray:
        world = from_name("tiny-world")
        engine = Engine({world.config.id: world}, max_batch=1)
        engine.add_stream("s", world.config.id, Conditioning(seed=1_000_777))
        frames = []
        for j, keys in enumerate(["d", "s", "a"]):
            if interrupt and j == 2:
                x0 = torch.randn(2, 9, *world.latent_shape, generator=torch.Generator().manual_seed(0))
                x0 = x0.transpose(1, 2)  # (2, C, 9, h, w)
                acts = torch.zeros(2, 9, 1, world.action_space.width)
                rollout_history(world.transformer, x0, acts, world.config.schedule, torch.Generator())
            acts = [FrameAction(frozenset({keys}))] * world.chunk_frames
            engine.submit(ChunkRequest("s", engine.new_request_id(), actions=acts))
            while engine.has_work():
                frames += [o.frames for o in engine.step()]
        return np.concatenate(frames)

    assert np.array_equal(serve(interrupt=True), serve(interrupt=False))


@torch.no_grad()
def test_onestep_history_is_each_chunk_generated_from_the_truth():
    """`onestep_history` generates every chunk at once in the teacher-forced layout; chunk j is
    what the cached rollout makes of the ground-truth history before it (`rollout_history`,
    first=j), with the same noise."""
    from models.game import KEYS
    from models.registry import from_name
    from models.tiny_world.data import SPACE
    from models.tiny_world.training.history import onestep_history, rollout_history

    world = from_name("tiny-world")
    dit, chunk = world.transformer, world.chunk_frames
    gen = torch.Generator().manual_seed(0)
    c, h, w = world.latent_shape
    x0 = torch.randn(2, c, 1 + 3 * chunk, h, w, generator=gen)
    actions = torch.zeros(2, x0.shape[2], 1, SPACE.width)
    actions[:, 1:, 0, KEYS.index("d")] = 1.0
    shape = (2, c, chunk, h, w)
    table = {(j, k): torch.randn(shape, generator=gen) for j in range(3) for k in range(4)}
    noise = lambda j, k: table[(j, k)]  # noqa: E731
    sched = world.config.schedule
    one = onestep_history(dit, x0, actions, sched, gen, noise)
    assert torch.equal(one[:, :, :1], x0[:, :, :1])
    for j in range(3):
        rolled = rollout_history(dit, x0, actions, sched, gen, noise, first=j)
        frames = slice(1 + j * chunk, 1 + (j + 1) * chunk)
        torch.testing.assert_close(one[:, :, frames], rolled[:, :, frames], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(one[:, :, 1:], x0[:, :, 1:], atol=0.1)
