"""The creature layer (`FastAEConfig.creatures`): a creature is three numbers in the cell where its
square starts, drawn whole on the canvas by a learned bitmap, moved with the map when a chunk is
re-anchored; the game records where it drew each creature, the layer's labels."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.game import Game, GameConfig, random_policy, simulate
from models.tiny_world import ae_config, carried_channels, creature_channels
from models.tiny_world.fast_decoder import (
    CREATURE_CHANNELS,
    PHASE_CHANNELS,
    SPRITE_CHANNELS,
    CreatureDecoder,
    FastAEConfig,
    FastAutoencoder,
    corner_cells,
    read_creatures,
    read_phase,
)
from models.tiny_world.fast_decoder import (
    creature_channels as layer_channels,
)

CREATURED = dict(
    latent_channels=4 + PHASE_CHANNELS + SPRITE_CHANNELS + CREATURE_CHANNELS,
    spatial=8,
    frame_size=32,
    sprite=True,
    creatures=True,
    enc_channels=(4, 8, 8, 8),
    dec_channels=(8, 8, 8, 4),
    dec_up_blocks=(1, 0, 0),
)


def make() -> FastAutoencoder:
    torch.manual_seed(0)
    ae = FastAutoencoder(FastAEConfig(**CREATURED))
    for p in ae.parameters():  # random weights, so a mistake cannot hide behind zeros
        p.data.normal_(0, 0.2)
    red = torch.full((4, 8, 8), -8.0 / CreatureDecoder.gain)  # transparent ...
    red[0, :6, :6] = 8.0 / CreatureDecoder.gain  # ... but an opaque 6 x 6 square
    red[1:, :6, :6] = torch.tensor([0.9, -0.7, -0.7]).view(3, 1, 1) / CreatureDecoder.gain
    ae.creature_decoder.bitmap.data.copy_(red)
    ae.sprite_decoder.bitmaps.data[:, 0] = -8.0 / CreatureDecoder.gain  # no player over them
    return ae.eval()


def test_config_lays_the_creature_channels_out_last():
    cfg = FastAEConfig(**CREATURED)
    assert (cfg.cell_channels, cfg.phase_slice, cfg.sprite_slice, cfg.creature_slice) == (
        4,
        slice(4, 8),
        slice(8, 11),
        slice(11, 14),
    )
    with pytest.raises(ValueError, match="tile-aligned"):
        FastAEConfig(latent_channels=4, creatures=True)
    with pytest.raises(ValueError, match="more than 10"):
        FastAEConfig(**{**CREATURED, "latent_channels": 10})
    assert FastAEConfig.from_dict(FastAEConfig(**CREATURED).to_dict()) == FastAEConfig(**CREATURED)
    shipped_layout = ae_config(tiled=True, sprite=True, creatures=True)
    assert shipped_layout.latent_channels == 18 and creature_channels() == (15, 16, 17)
    assert carried_channels(view=True, creatures=True) == (8, 9, 10, 11, 15, 16, 17)


def test_creature_channels_round_trip_and_survive_noise():
    corners = torch.tensor([[[3, 4], [-9, 20], [50, 1], [200, 200]]])  # view pixels; the last off canvas
    pos = torch.tensor([[16 + 5, 16 + 2]])  # the view's top-left corner on the canvas
    present, offsets = corner_cells(corners, pos, 12, 8)
    assert present.sum() == 3
    canvas_px = corners[0, :3] + pos[0]
    for x, y in canvas_px.tolist():
        assert present[0, y // 8, x // 8] and offsets[0, :, y // 8, x // 8].tolist() == [x % 8, y % 8]
    raw = layer_channels(present, offsets, 8)
    noisy = raw + 0.05 * torch.randn(raw.shape, generator=torch.Generator().manual_seed(0))
    back_present, back_offsets = read_creatures(noisy, 8)
    assert torch.equal(back_present, present)
    assert torch.equal(back_offsets * present[:, None], offsets)


@torch.no_grad()
def test_a_creature_is_drawn_whole_across_cells_wherever_it_starts():
    """The point of the layer: a square that starts anywhere in a cell, crossing into three others,
    is drawn whole at its place, the same drawing everywhere."""
    dec = make().creature_decoder
    canvas = torch.zeros(1, 3, 48, 48)
    for x, y in [(8, 8), (13, 19), (15, 15), (20, 31)]:
        present = torch.zeros(1, 6, 6, dtype=torch.bool)
        offsets = torch.zeros(1, 2, 6, 6, dtype=torch.long)
        present[0, y // 8, x // 8] = True
        offsets[0, :, y // 8, x // 8] = torch.tensor([x % 8, y % 8])
        out = dec(canvas, present, offsets)
        drawn = (out - canvas).abs().amax(dim=1)[0] > 0.5
        want = torch.zeros(48, 48, dtype=torch.bool)
        want[y : y + 6, x : x + 6] = True
        assert torch.equal(drawn, want), (x, y)
        torch.testing.assert_close(
            out[0, :, y + 2, x + 3], torch.tensor([0.9, -0.7, -0.7]), atol=1e-3, rtol=0
        )


@torch.no_grad()
def test_encoded_creatures_are_drawn_where_the_labels_put_them_and_move_with_the_map():
    """Encoded with known corners, a creature is drawn at its corner in the view; a chunk drawn
    on the previous anchor and re-anchored (`canonical`) moves the creature's cell with the map,
    so it decodes to the same frames."""
    ae = make()
    c = ae.cfg.latent_channels
    ae.set_normalisation(
        torch.cat([torch.linspace(-0.5, 0.5, 8), torch.zeros(6)]),
        torch.cat([torch.linspace(0.5, 2.0, 8), torch.ones(6)]),
    )
    frames = torch.rand(3, 3, 32, 32) * 2 - 1
    off = torch.tensor([[1, 5], [2, 5], [3, 6]])
    spr = torch.tensor([[16, 16, 0], [16, 16, 0], [16, 16, 0]])
    corners = torch.tensor([[[4, 9], [-3, 25]], [[5, 10], [-2, 26]], [[6, 11], [-1, 27]]])  # (3, K, 2)
    z = ae.encode_float(frames.transpose(0, 1)[None], off[None], spr[None], corners[None])[0]
    assert z.shape == (c, 3, 8, 8)
    drawn = ae.decode_float(z[None])[0].transpose(0, 1)  # (3, 3, 32, 32)
    backdrop = ae.decode_layers((z * ae.latents_std + ae.latents_mean).transpose(0, 1), creatures=False)[0]
    for i, frame_corners in enumerate(corners.tolist()):
        changed = (drawn[i] - backdrop[i]).abs().amax(dim=0) > 0.5
        want = torch.zeros(32, 32, dtype=torch.bool)
        for x, y in frame_corners:
            want[max(y, 0) : y + 6, max(x, 0) : x + 6] = True
        assert torch.equal(changed, want), i
    # On the anchor one tile to the left (phases 9..11) and re-anchored: the same frames.
    wide = ae.encode_wide(frames, off, spr, corners)
    own = ae.at_anchor(wide, off, torch.zeros(3, 2, dtype=torch.long))
    torch.testing.assert_close(own, z.transpose(0, 1))
    prev = ae.at_anchor(wide, off, torch.tensor([[1, 0]] * 3))
    ph = ae.cfg.phase_slice
    assert read_phase(prev[:, ph] * ae.latents_std[ph, 0] + ae.latents_mean[ph, 0], 8)[:, 0].tolist() == [
        9,
        10,
        11,
    ]
    noisy = prev + 0.05 * torch.randn(prev.shape, generator=torch.Generator().manual_seed(1))
    out = ae.canonical(noisy.transpose(0, 1)[None])
    cs = ae.cfg.creature_slice
    torch.testing.assert_close(out[0, cs].transpose(0, 1)[:, :, :, :7], own[:, cs, :, :7], rtol=0, atol=1e-5)
    torch.testing.assert_close(
        ae.decode_float(out), ae.decode_float(noisy.transpose(0, 1)[None]), rtol=0, atol=1e-5
    )


def test_the_game_records_where_it_draws_every_creature():
    """`creature_corners` are the labels: the creature-coloured pixels of every frame's backdrop
    (the frame without the player) are exactly the creatures' squares from those corners,
    cut by the view."""
    cfg = GameConfig(size=64)
    red = np.array(cfg.palette.creature)
    side = int(cfg.creature_size * cfg.scale)
    seen = 0
    for seed in (1_000_001, 1_000_002, 1_000_005):
        sim = simulate(seed, random_policy(seed, 60), cfg, layers=True)
        assert sim.creature_corners.shape == (61, cfg.creatures, 2)
        for backdrop, terrain, corners in zip(sim.backdrops, sim.terrains, sim.creature_corners, strict=True):
            want = np.zeros((64, 64), bool)
            for x, y in corners:
                want[max(y, 0) : max(y + side, 0), max(x, 0) : max(x + side, 0)] = True
            assert np.array_equal((backdrop == red).all(-1), want)
            assert np.array_equal(backdrop[~want], terrain[~want])
            seen += int(want.any())
    assert seen > 0
    game = Game(cfg)
    game.reset(1_000_001)
    assert game.creature_corners().dtype == np.int64


def test_widened_models_compute_what_they_did_and_leave_the_new_channels_as_they_were():
    """`widen` (the DiT) and `widen_head` (the motion head), used to add the layer to a trained
    model: on the old channels they compute exactly what the old models did, whatever the new
    channels hold, and the DiT's flow on the new channels is zero (with them carried from the
    latest frame, a widened world leaves its creatures where they were)."""
    from models.causal_wan import CausalWan
    from models.tiny_world import dit_config, marker_config
    from models.tiny_world.data import SPACE
    from models.tiny_world.motion_head import MotionHead
    from models.tiny_world.training.dit import teacher_forcing_layout, widen
    from models.tiny_world.training.motion import motion_config, widen_head

    torch.manual_seed(0)
    dit = CausalWan(dit_config(15))
    for p in dit.parameters():
        p.data.normal_(0, 0.05)
    wide = widen(dit, 18)
    mask, positions, f = teacher_forcing_layout(1, 4, 16)
    seq = torch.randn(1, 15, 2 * f - 1, 12, 12)
    t = torch.rand(1, 2 * f - 1) * 1000
    acts = torch.zeros(1, 2 * f - 1, 1, SPACE.width)  # one video frame per latent frame
    acts[..., 1] = 1.0
    text = [dit.text_kv(dit.null_text("cpu", torch.float32))]
    with torch.no_grad():
        old = dit.forward_dense(seq, t, text, mask, acts, positions)
        new = wide.forward_dense(
            torch.cat([seq, torch.randn(1, 3, 2 * f - 1, 12, 12)], 1), t, text, mask, acts, positions
        )
    torch.testing.assert_close(new[:, :15], old, rtol=0, atol=1e-5)
    assert not new[:, 15:].any()
    with pytest.raises(ValueError, match="cannot widen"):
        widen(dit, 15)

    ae = FastAutoencoder(ae_config(tiled=True, sprite=True))
    ae.set_normalisation(torch.zeros(15), torch.ones(15))
    head = MotionHead(motion_config(ae))
    for p in head.parameters():
        p.data.normal_(0, 0.1)
    wider = widen_head(head, 18)
    assert marker_config(ae.cfg) == wider.cfg.marker
    z = torch.randn(2, 15, 12, 12)
    with torch.no_grad():
        a, b = head.context(z), wider.context(torch.cat([z, torch.randn(2, 3, 12, 12)], 1))
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(y, x, rtol=0, atol=1e-5)
