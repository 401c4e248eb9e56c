"""The DiT's per-cell sprite marker (`MarkerConfig`, `sprite_marker`, `with_marker`,
`--marker`): each latent cell is told where the player is relative to itself. The marker
puts the game's player in its world tile; it reads the canvas' whole phase range; a marked copy
of a DiT computes what the original does until the marker has weight; the cached and the dense
forward see the same marker; the CLI trains, exports and resumes a marked model, optionally with
an auxiliary head that reads the marker back from the DiT's last tokens (`--sf-marker-aux`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from models.causal_wan import CausalWan, frame_attention_mask
from models.registry import from_name, load_world
from models.tiny_world import ae_config, marker_config
from models.tiny_world.data import make_episodes
from models.tiny_world.fast_decoder import phase_channels, sprite_channels
from models.tiny_world.marker import MarkerConfig, dit_features, dit_marker, marker_spec, sprite_marker
from models.tiny_world.train import main
from models.tiny_world.training.dit import with_marker
from models.tiny_world.training.heads import AuxHeads
from tests.models.conftest import tiny_config
from tests.models.test_causal_wan import TOL, H, W, rollout
from tests.models.tiny_world.test_teacher_forcing import serve_random_policy, with_transformer
from tests.models.tiny_world.test_train_cli import train_tiny


@torch.no_grad()
def test_the_marker_puts_the_games_player_in_its_world_tile():
    """Encoded game frames (the shipped autoencoder, the game's cameras): the one cell whose
    marker is within half a cell of zero along each axis is the cell of the canvas holding the
    world tile under the player's centre, the tile a wall would be on."""
    ae = from_name("tiny-world").decoder.ae
    marker = marker_config(ae.cfg)
    eps = make_episodes([1_000_003, 1_000_010], 40, layers=True)
    video = torch.from_numpy(eps.frames).permute(0, 4, 1, 2, 3).float() / 127.5 - 1
    cams = np.rint(eps.cameras).astype(np.int64)
    sprites = np.concatenate([np.rint(eps.players).astype(np.int64), eps.rings[..., None]], axis=-1)
    z = ae.encode_float(video, torch.from_numpy(cams % 8), torch.from_numpy(sprites))
    cells = sprite_marker(z, marker) * marker.reach  # (E, 2, T, h, w), in cells
    anchor = cams // 8 * 8 - 16  # the canvas' top-left corner in world pixels
    tile = np.floor((eps.cameras + eps.players - anchor) / 8).astype(np.int64)  # (E, T, 2)
    assert len(np.unique(tile[..., 0])) > 1  # the player crosses canvas cells
    for e in range(len(eps)):
        for t in range(eps.frames.shape[1]):
            dx, dy = cells[e, 0, t, 0], cells[e, 1, t, :, 0]
            assert ((dx >= -0.5) & (dx < 0.5)).nonzero().flatten().tolist() == [tile[e, t, 0]]
            assert ((dy >= -0.5) & (dy < 0.5)).nonzero().flatten().tolist() == [tile[e, t, 1]]


def test_the_marker_reads_every_phase_of_the_canvas():
    """Phases across the chunk's whole range [-s/2, 3s/2) (a generated frame's view moves up to
    half a tile either way off its anchor) and off-centre players: the marker is the player's
    canvas offset from each cell centre, saturating at `reach` cells."""
    cfg = ae_config(tiled=True, sprite=True)
    mean, std = torch.randn(15) * 0.1, torch.rand(15) + 0.5
    cfg.latents_mean, cfg.latents_std = mean.tolist(), std.tolist()
    marker = marker_config(cfg)
    phases = torch.tensor([[-4, 11], [0, 0], [7, -3], [11, 5], [3, 8]])
    centres = torch.tensor([[32, 32], [20, 40], [32, 60], [4, 32], [45, 9]])
    raw = torch.zeros(5, 15, 12, 12)
    raw[:, 8:12] = phase_channels(phases, 8, (12, 12))
    raw[:, 12:15] = sprite_channels(centres, torch.zeros(5, dtype=torch.bool), 64, (12, 12))
    z = ((raw - mean[:, None, None]) / std[:, None, None])[:, :, None]  # (5, C, 1, 12, 12)
    got = sprite_marker(z, marker)[:, :, 0] * marker.reach  # (5, 2, 12, 12) cells
    centre = 16 + phases + centres  # canvas pixels
    cell = torch.arange(12) * 8 + 4
    want_x = ((centre[:, 0, None] - cell) / 8).clamp(-2, 2)  # (5, 12) along a row
    want_y = ((centre[:, 1, None] - cell) / 8).clamp(-2, 2)
    torch.testing.assert_close(got[:, 0], want_x[:, None, :].expand(-1, 12, -1), atol=1e-4, rtol=0)
    torch.testing.assert_close(got[:, 1], want_y[:, :, None].expand(-1, -1, 12), atol=1e-4, rtol=0)


@torch.no_grad()
def test_a_marked_copy_serves_the_original_frames_until_the_marker_has_weight(tmp_path: Path):
    world = from_name("tiny-world")
    marker = marker_config(world.decoder.ae.cfg)
    marked = with_marker(world.transformer, marker)
    channels = world.transformer.cfg.in_channels
    assert dit_marker(marked.cfg) == marker and marked.patch_embedding.weight.shape[1] == channels + 2
    with pytest.raises(ValueError, match="already"):
        with_marker(marked, marker)
    loaded = with_transformer(world, marked, tmp_path / "marked")
    assert loaded.transformer.cfg == marked.cfg
    served, _ = serve_random_policy(loaded, 1_000_321, 3)
    original, _ = serve_random_policy(world, 1_000_321, 3)
    assert np.abs(served.astype(int) - original.astype(int)).max() <= 1
    # Given weight, the marker changes what the served model draws.
    loaded.transformer.patch_embedding.weight[:, channels:] = torch.randn(128, 2, 1, 2, 2) * 0.5
    changed, _ = serve_random_policy(loaded, 1_000_321, 3)
    assert np.abs(changed.astype(int) - original.astype(int)).max() > 16


@torch.no_grad()
def test_the_cached_and_the_dense_forward_see_the_same_marker(make_model):
    marker = MarkerConfig(phase=0, place=4, mean=(0.0,) * 6, std=(1.0,) * 6, frame_size=32)
    torch.manual_seed(0)
    cfg = tiny_config(in_channels=6, out_channels=6, input_features=marker_spec(marker))
    model = CausalWan(cfg, dit_features(cfg)).eval()
    model.patch_embedding.weight[:, 6:] = 1.0  # the marker weighs heavily
    text = torch.randn(2, 8)
    chunks = [torch.randn(1, 6, 2, H, W) for _ in range(3)]
    got = rollout(model, chunks[:-1], chunks[-1], 500.0, text)
    ts = torch.zeros(1, 6)
    ts[:, -2:] = 500.0
    mask = frame_attention_mask([2] * 3, 16)
    dense = model.forward_dense(torch.cat(chunks, 2), ts, [model.text_kv(text)], mask)
    assert (got - dense[:, :, -2:]).abs().max().item() <= TOL
    moved = [c.clone() for c in chunks]
    moved[0][:, 4] += 1.0  # the player elsewhere in the history: another marker there
    assert (rollout(model, moved[:-1], moved[-1], 500.0, text) - got).abs().max().item() > 1e-3


@pytest.mark.parametrize("first", ["dit", "sf2"])
def test_the_cli_trains_exports_and_resumes_a_marked_model(first: str, tmp_path: Path):
    """`--marker STAGE`: the DiT reads the marker from that stage on (from the DiT stage: from
    its random start)."""
    out = tmp_path / "run"
    tiled = ("--ae-tiled", "true", "--ae-sprite", "true", "--episode-frames", "16", "--sf-sprite-jitter", "2")
    train_tiny(out, *tiled, "--sf2-steps", "2", "--sf3-steps", "0", "--marker", first)
    state = torch.load(out / "ckpt.pt", weights_only=False)
    assert state["stage"] == "done" and state["dit_cfg"]["input_features"] is not None
    world = load_world(out / "model")
    assert dit_marker(world.transformer.cfg) == marker_config(world.decoder.ae.cfg)
    assert world.transformer.patch_embedding.weight[:, 15:].abs().sum() > 0  # trained
    served, _ = serve_random_policy(world, 1_000_321, 2)
    assert served.shape == (9, 64, 64, 3)
    # Resuming the finished run builds the marked modules before loading their weights.
    assert main(["--out", str(out), "--resume", "--export-only", "--no-progress", "--threads", "1"]) == 0
    again = load_world(out / "model").transformer.state_dict()
    for name, value in world.transformer.state_dict().items():
        assert torch.equal(again[name], value), name


def test_the_marker_needs_a_sprite_layer_and_a_stage_that_runs(tmp_path: Path):
    with pytest.raises(SystemExit, match="sprite layer"):
        train_tiny(tmp_path / "a", "--ae-tiled", "true", "--sf2-steps", "2", "--marker", "sf2")
    with pytest.raises(SystemExit, match="names a stage"):
        train_tiny(tmp_path / "b", "--ae-tiled", "true", "--ae-sprite", "true", "--marker", "sf2")
    with pytest.raises(SystemExit, match="names a stage"):
        train_tiny(tmp_path / "c", "--ae-tiled", "true", "--ae-sprite", "true", "--marker", "ae")


def test_the_marker_head_lays_out_its_targets_as_the_dits_tokens():
    """Token (f, i, j) of a 2x2 patch grid (frame-major, as the patch embedding flattens) holds
    the marker of cells [2i, 2i+2) x [2j, 2j+2) of frame f."""
    heads = AuxHeads(8, (1, 2, 2), marker=True, motion=False)
    marker = torch.arange(2 * 3 * 4 * 6, dtype=torch.float32).view(1, 2, 3, 4, 6)
    got = heads.marker_targets(marker)
    assert got.shape == (1, 3 * 2 * 3, 8)
    for f, i, j in [(0, 0, 0), (1, 1, 2), (2, 0, 1)]:
        cells = marker[0, :, f, 2 * i : 2 * i + 2, 2 * j : 2 * j + 2].flatten()
        assert torch.equal(got[0, f * 6 + i * 3 + j], cells)


def test_the_marker_aux_head_trains_checkpoints_and_needs_the_marker(tmp_path: Path):
    """`--sf-marker-aux`: the sf phase logs the head's loss and checkpoints the head with the run;
    without a marker in the self-forced phases the flag is refused."""
    out = tmp_path / "run"
    tiled = ("--ae-tiled", "true", "--ae-sprite", "true", "--episode-frames", "16", "--sf-sprite-jitter", "2")
    rows = train_tiny(out, *tiled, "--marker", "sf", "--sf-marker-aux", "1", "--ckpt-every", "1")
    assert [r["step"] for r in rows] == [1, 2] and all(r["marker_aux"] > 0 for r in rows)
    state = torch.load(out / "ckpt.pt", weights_only=False)
    assert state["aux_heads"]["marker.weight"].shape == (8, 128) and "motion.weight" not in state["aux_heads"]
    with pytest.raises(SystemExit, match="--marker sf"):
        train_tiny(tmp_path / "bare", *tiled, "--sf-marker-aux", "1")
