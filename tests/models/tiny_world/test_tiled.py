"""The trainer with tile-aligned latents (`--ae-tiled true`): every episode frame, sharp and
blurred, is encoded around its own anchor at the camera's offset; clips are cut as the model sees
them (targets on the anchor of the chunk before, history re-anchored on its chunk's last frame);
the exported model serves sessions through the engine, which re-anchors each chunk as the
trainer's rollout does. With `--ae-sprite true` the player is a layer of its own: its position
and ring ride in the latents, taken from the game."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from models.registry import load_world
from models.tiny_world import place_channels, start_image, view_channels
from models.tiny_world.data import action_rows
from models.tiny_world.fast_decoder import read_phase, read_sprite
from models.tiny_world.training.clips import off_centre_starts
from models.tiny_world.training.config import TrainConfig
from models.tiny_world.training.dit import teacher_forcing_layout
from models.tiny_world.training.history import rollout_history
from models.tiny_world.training.targets import chunk_anchors
from models.tiny_world.training.trainer import Trainer
from models.world import Conditioning
from tests.models.tiny_world.test_teacher_forcing import serve_random_policy
from tests.models.tiny_world.test_train_cli import train_tiny


def test_off_centre_starts_are_the_frames_where_the_camera_stops_at_the_border():
    players = torch.full((2, 6, 2), 32.0)  # the view's centre of a 64-px frame
    players[0, 2, 0] = 28.0  # episode 0, frame 2: at the world's left edge
    players[1, 4:, 1] = 36.5  # episode 1, frames 4-5: at the bottom edge
    assert off_centre_starts(players, 1, 5).tolist() == [[0, 2], [1, 4], [1, 5]]
    assert off_centre_starts(players, 3, 4).tolist() == [[1, 4]]  # only frames first..last


def test_chunk_anchors_put_targets_on_the_chunk_before_and_history_on_its_own_last_frame():
    x = torch.tensor([5.0, 6, 7, 8, 9, 9, 9, 8, 7])  # right across the edge at 8, then back
    cams = torch.stack([x, torch.full_like(x, 3.0)], dim=-1)[None]  # (1, 9, 2)
    q, d_hist, d_target = chunk_anchors(cams, 4, 8)
    assert q[0, :, 0].tolist() == [5, 6, 7, 0, 1, 1, 1, 0, 7]
    # History: chunk 1 (frames 1-4) on frame 4's anchor (tile 1), chunk 2 on frame 8's (tile 0).
    assert d_hist[0, :, 0].tolist() == [0, -1, -1, 0, 0, 1, 1, 1, 0]
    # Targets: chunk 1 on the start frame's anchor (tile 0), chunk 2 on frame 4's (tile 1).
    assert d_target[0, :, 0].tolist() == [0, 0, 0, 1, 1, 0, 0, 0, -1]
    assert not d_hist[..., 1].any() and not d_target[..., 1].any()
    phase = q + 8 * d_target  # what the model draws: no wrap inside a chunk
    assert phase[0, 1:5, 0].tolist() == [6, 7, 8, 9] and phase[0, 5:, 0].tolist() == [1, 1, 0, -1]


def test_tiled_run_cuts_clips_on_their_anchors_and_serves(tmp_path: Path):
    out = tmp_path / "run"
    train_tiny(out, "--ae-tiled", "true")
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert all("phase_acc" in r for r in log if r["stage"] == "ae" and "loss" in r)
    data = load_file(str(out / "latents.safetensors"))
    assert data["latents"].shape == (2, 13, 8, 14, 14)  # cells around each frame's own anchor
    assert load_file(str(out / "blurred.safetensors"))["latents"].shape == (2, 13, 8, 14, 14)

    world = load_world(out / "model")
    assert world.latent_shape == (12, 12, 12)
    trainer = Trainer(
        TrainConfig(
            ae_tiled=True, ae_sprite=False, sf_sprite_jitter=0, ae_creatures=False, sf_creature_start=False
        ),
        tmp_path / "t",
        None,
        progress=False,
    )
    trainer.ae = world.decoder.ae
    ae = trainer.ae
    cams = data["cameras"]
    e, idx = np.array([0, 1]), np.array([[0, 1, 2, 3, 4], [4, 5, 6, 7, 8]])
    target, hist = trainer.clip_latents(data["latents"], cams, e, idx)
    assert target.shape == hist.shape == (2, 12, 5, 12, 12)
    q, d_hist, d_target = chunk_anchors(cams[e[:, None], idx], 4, 8)

    def phases(z: torch.Tensor) -> torch.Tensor:
        flat = z.permute(0, 2, 1, 3, 4).flatten(0, 1)
        return read_phase(flat[:, 8:] * ae.latents_std[8:, 0] + ae.latents_mean[8:, 0], 8).view(2, 5, 2)

    assert torch.equal(phases(target), q + 8 * d_target) and torch.equal(phases(hist), q + 8 * d_hist)
    # A slowed history (`sf_warp`): frame 8 frozen for a chunk, then frames 9-12. The targets'
    # anchors may lie out of reach there, so only the history is cut: the frozen chunk on frame
    # 8's own anchor (as a start frame), the next on frame 12's, as in an ordinary clip.
    slowed = trainer.history_latents(data["latents"], cams, e[:1], np.array([[0, 8, 8, 8, 8, 9, 10, 11, 12]]))
    _, plain = trainer.clip_latents(data["latents"], cams, e[:1], np.array([[8, 9, 10, 11, 12]]))
    assert torch.equal(slowed[:, :, 1:5], plain[:, :, :1].expand(-1, -1, 4, -1, -1))
    assert torch.equal(slowed[:, :, 5:], plain[:, :, 1:])
    # A frame on its own anchor is what the autoencoder encodes from the game's frame.
    frame = torch.from_numpy(start_image(0)).float().div(127.5).sub(1.0).permute(2, 0, 1)[:, None, None]
    own = ae.encode_float(frame.transpose(0, 1), (cams[:1, :1].round().long() % 8))[0]
    torch.testing.assert_close(hist[0, :, :1], own, rtol=0, atol=2e-3)

    seed, n_chunks, chunk = 1_000_321, 3, world.chunk_frames
    served, script = serve_random_policy(world, seed, n_chunks)
    assert served.shape == (1 + n_chunks * chunk, 64, 64, 3)
    assert np.ptp(served) > 0
    # The trainer's rollout re-anchors each chunk as the session does: with the engine's noise it
    # shows the session's frames.
    start = world.init_state(Conditioning(seed=seed)).start_latents
    x0 = torch.zeros(1, 12, 1 + n_chunks * chunk, 12, 12)
    x0[0, :, :1] = start
    actions = torch.from_numpy(action_rows(script))[None, :, None]
    noise = lambda j, k: world.noise(seed, j + 1, k, chunk)[None]  # noqa: E731
    sched, dit = world.config.schedule, world.transformer
    with torch.no_grad():
        lat = rollout_history(
            dit, x0, actions, sched, torch.Generator(), noise, canonical=world.decoder.canonical
        )
    mine, _ = world.decoder.decode(lat[0], world.decoder.init_cache())
    assert np.abs(mine.numpy().astype(int) - served.astype(int)).max() <= 1


def test_sprite_run_carries_the_games_player_in_its_latents_and_serves(tmp_path: Path):
    out = tmp_path / "run"
    train_tiny(
        out,
        *("--ae-tiled", "true", "--ae-sprite", "true", "--episode-frames", "16"),
        *("--sf-blur", "1", "--sf-sprite-jitter", "2", "--sf-place-start", "true"),
        *("--sf2-steps", "2", "--sf2-view-start", "true", "--sf2-jitter-centred", "true", "--sf3-steps", "0"),
    )
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert all("sprite_acc" in r for r in log if r["stage"] == "ae" and "loss" in r)
    # The second self-forced phase follows the first, its learning rate warmed up afresh.
    trained = [(r["stage"], r["step"]) for r in log if r["stage"] in ("sf", "sf2") and "loss" in r]
    assert trained == [("sf", 1), ("sf", 2), ("sf2", 1), ("sf2", 2)]
    assert torch.load(out / "ckpt.pt", weights_only=False)["stage"] == "done"
    data = load_file(str(out / "latents.safetensors"))
    lat = data["latents"]
    assert lat.shape == (2, 17, 11, 14, 14)  # cells, then the sprite channels (raw scale)
    centre, _ = read_sprite(lat[:, :, 8:].flatten(0, 1).float(), 64)
    assert torch.equal(centre, data["players"].flatten(0, 1).round().long())
    blurred = load_file(str(out / "blurred.safetensors"))["latents"]
    torch.testing.assert_close(blurred[:, :, 8:], lat[:, :, 8:])  # the game's, however blurred

    world = load_world(out / "model")
    assert world.latent_shape == (15, 12, 12)
    # The place carried since the first phase, the view's phase since the second: served so.
    assert world.plugin.settings.carry_channels == tuple(range(8, 14))
    assert world.decoder.ae.latents_std[12:].flatten().tolist() == [1.0, 1.0, 1.0]
    served, _ = serve_random_policy(world, 1_000_321, 2)
    assert served.shape == (9, 64, 64, 3) and np.ptp(served) > 0

    # History with the sprite moved (`sf_sprite_jitter`): half the eligible clips, one whole-pixel
    # offset of up to 4 px per clip on every frame; the cells, the phase and the ring untouched.
    cfg = TrainConfig(
        ae_tiled=True,
        ae_sprite=True,
        sf_sprite_jitter=4,
        sf_blur=0.0,
        ae_creatures=False,
        sf_creature_start=False,
    )
    trainer = Trainer(cfg, tmp_path / "t", None, progress=False)
    trainer.ae = world.decoder.ae
    b = 32
    e = np.arange(b) % 2
    idx = np.arange(5)[None, :] + (np.arange(b) % 12)[:, None]
    _, clean = trainer.clip_latents(lat, data["cameras"], e, idx)
    eligible = torch.arange(b) < 24
    hist, _ = trainer.degraded_history(
        clean, torch.zeros(b, 5, 1, 6), e, idx, eligible, None, lat, data["cameras"]
    )
    torch.testing.assert_close(hist[:, :12], clean[:, :12])  # cells and phase
    torch.testing.assert_close(hist[:, 14], clean[:, 14])  # the ring
    px = (hist[:, 12:14] - clean[:, 12:14]) * 4  # whole view pixels (sprite std 1, 4 px a unit)
    torch.testing.assert_close(px, px.round())
    assert px.abs().max() <= 4 and (px == px[:, :, :1]).all()  # one offset per clip, every frame
    moved = px.abs().amax(dim=(1, 2, 3, 4)) > 0
    assert not moved[~eligible].any() and 6 <= moved[eligible].sum() <= 18

    # With `centred` (the axes where the game keeps the player at the view's centre), the sprite
    # moves only along those: at the world's border the history's off-centre place is the game's.
    centred = torch.stack([torch.arange(b) % 2 == 0, torch.arange(b) % 3 == 0], dim=1)
    hist, _ = trainer.degraded_history(
        clean, torch.zeros(b, 5, 1, 6), e, idx, eligible, None, lat, data["cameras"], centred
    )
    shift = ((hist[:, 12:14] - clean[:, 12:14]) * 4).abs().amax(dim=(2, 3, 4))  # (B, 2) px
    assert not shift[~centred].any() and shift[centred & eligible[:, None]].any()


@pytest.mark.parametrize(
    ("stage", "place_start", "view_start"),
    [
        ("sf", False, False),
        ("sf", True, False),
        ("sf", False, True),
        ("sf", True, True),
        ("sf2", False, True),  # the second phase's view start, the first phase's place start
        ("sf2", True, True),
        ("dit", False, False),
    ],
)
def test_carried_channels_are_trained_to_flow_from_the_latest_history_frame(
    stage, place_start, view_start, tmp_path
):
    """`--sf-place-start` / `--sf-view-start` (in the second phase `--sf2-view-start`): in a
    self-forced phase every noisy chunk's place / phase channels are (1 - sigma) * target + sigma
    * (that channel of the history frame before the chunk), as the served sampler starts them
    (`World.carry`); the other channels are noised as usual."""
    flags = {"sf_place_start": place_start}
    if stage == "sf":
        flags.update(sf_view_start=view_start)
    elif stage == "sf2":
        flags.update(sf2_steps=1, sf2_view_start=view_start)
    else:  # the DiT stage carries nothing whatever the sf settings
        flags.update(sf_place_start=True, sf_view_start=True)
    cfg = TrainConfig(ae_tiled=True, ae_sprite=True, ae_creatures=False, sf_creature_start=False, **flags)
    trainer = Trainer(cfg, tmp_path, None, progress=False)
    trainer.stage = stage
    gen = torch.Generator().manual_seed(0)
    b, c, chunk = 3, 15, trainer.dit.cfg.chunk_frames
    mask, positions, f = teacher_forcing_layout(2, chunk, trainer.dit.cfg.window_frames)
    x0 = torch.randn(b, c, f, 12, 12, generator=gen)
    hist = x0 + torch.randn(x0.shape, generator=gen)  # another place in every history frame
    seen = {}

    class Seen(Exception):
        pass

    def forward_dense(seq, t, *args):
        seen.update(seq=seq, t=t)
        raise Seen

    trainer.dit.forward_dense = forward_dense
    with pytest.raises(Seen):
        trainer.flow_step(x0, hist, torch.zeros(b, f, 1, 6), mask, positions, f, 1e-3, 10, 1)
    noisy = seen["seq"][:, :, f:]  # (B, C, F-1, h, w)
    sigma = (seen["t"][:, f:] / 1000)[:, None, :, None, None]
    before = hist[:, :, 0 : f - 1 : chunk].repeat_interleave(chunk, dim=2)  # each chunk's latest frame
    carried = (1 - sigma) * x0[:, :, 1:] + sigma * before
    for channels, wanted in ((place_channels(), place_start), (view_channels(), view_start)):
        ch = list(channels)
        assert torch.allclose(noisy[:, ch], carried[:, ch], atol=1e-5) is wanted
    assert not torch.allclose(noisy[:, :8], carried[:, :8], atol=1e-2)  # the cells: noise
    assert view_channels() == tuple(range(8, 12)) and place_channels() == (12, 13)


def test_latent_statistics_stay_finite_when_the_camera_never_moves(tmp_path: Path):
    """Frames that all lie on one camera phase make the phase channels constant: their std is 0,
    and they keep their raw scale (std 1) so encoded latents stay finite; the cells vary and are
    normalised by their own spread."""
    trainer = Trainer(
        TrainConfig(ae_tiled=True, ae_sprite=True, ae_creatures=False, sf_creature_start=False),
        tmp_path,
        None,
        progress=False,
    )
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, size=(8, 64, 64, 3), dtype=np.uint8)
    offsets = torch.full((8, 2), 3, dtype=torch.long)
    trainer.set_latent_stats(frames, offsets)
    std = torch.tensor(trainer.ae.cfg.latents_std)
    phase = trainer.ae.cfg.phase_slice
    assert torch.equal(std[phase], torch.ones_like(std[phase]))
    assert (std[: phase.start] > 1e-6).all() and (std[: phase.start] != 1.0).all()
    x = torch.from_numpy(frames[:2]).float().div(127.5).sub(1.0).permute(0, 3, 1, 2)[:, :, None]
    assert trainer.ae.encode_float(x, offsets[:2, None]).isfinite().all()
