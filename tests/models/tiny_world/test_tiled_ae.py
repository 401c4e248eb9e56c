"""Tile-aligned latents (`FastAEConfig.frame_size`): a frame is encoded, cell by cell, on a canvas
anchored on its tile grid, plus its phase there; the decoder draws the canvas cell by cell and
crops the frame at the phase the latents carry; a chunk drawn on the previous frame's anchor is
re-anchored on its own last frame (`canonical`) before it becomes history."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from torch import nn

from models.game import Game, GameConfig
from models.tiny_world.fast_decoder import (
    PHASE_CHANNELS,
    SPRITE_CHANNELS,
    SPRITE_REACH,
    FastAEConfig,
    FastAutoencoder,
    FastStreamingDecoder,
    PhaseNet,
    SpriteDecoder,
    crop,
    phase_channels,
    place,
    read_phase,
    read_sprite,
    shift_cells,
    sprite_channels,
)

TILED = dict(
    latent_channels=4 + PHASE_CHANNELS,
    spatial=8,
    frame_size=32,
    enc_channels=(4, 8, 8, 8),
    dec_channels=(8, 8, 8, 4),
    dec_up_blocks=(1, 0, 0),
)
ALL = torch.tensor(list(itertools.product(range(-4, 12), range(-4, 12))))  # every (x, y) phase


def make() -> FastAutoencoder:
    torch.manual_seed(0)
    ae = FastAutoencoder(FastAEConfig(**TILED))
    for p in ae.parameters():  # zero-initialised residual convs would hide mistakes
        p.data.normal_(0, 0.2)
    return ae.eval()


def test_phase_channels_round_trip_for_every_phase_and_survive_noise():
    ch = phase_channels(ALL, 8, (6, 6))
    assert ch.shape == (256, 4, 6, 6)
    assert torch.equal(read_phase(ch, 8), ALL)
    # A generated latent's phase is never exact: noise of 0.3 per cell still reads back.
    noisy = ch + 0.3 * torch.randn(ch.shape, generator=torch.Generator().manual_seed(0))
    assert torch.equal(read_phase(noisy, 8), ALL)


def test_place_then_crop_returns_the_frame_with_a_visibility_channel():
    pos = ALL + 4
    frames = torch.randn(256, 3, 32, 32)
    canvas = place(frames, pos, 48)
    assert canvas.shape == (256, 4, 48, 48)
    assert torch.equal(crop(canvas[:, :3], pos, 32), frames)
    assert torch.equal(canvas[:, 3].sum(dim=(1, 2)), torch.full((256,), 32.0 * 32))
    ox, oy = pos[10].tolist()
    assert canvas[10, 3, oy, ox] == 1 and canvas[10, 3, oy + 32, ox + 32] == 0
    assert canvas[10, :3, :oy].abs().sum() == 0 and canvas[10, :3, :, :ox].abs().sum() == 0


@torch.no_grad()
def test_encode_carries_the_given_phase_and_decode_crops_the_canvas_there():
    ae = make()
    video = torch.rand(2, 3, 5, 32, 32) * 2 - 1
    offsets = torch.randint(0, 8, (2, 5, 2), generator=torch.Generator().manual_seed(1))
    z = ae.encode_raw(video, offsets)
    assert z.shape == (2, 8, 5, 8, 8)  # 32 px = 4 cells, plus two on every side
    flat = z.transpose(1, 2).reshape(10, 8, 8, 8)
    assert torch.equal(read_phase(flat[:, 4:], 8), offsets.reshape(10, 2))
    out = ae.decode_raw(z)
    canvas = ae.decoder(flat[:, :4])  # (10, 3, 64, 64)
    want = crop(canvas, offsets.reshape(10, 2) + 16, 32).view(2, 5, 3, 32, 32).transpose(1, 2)
    assert torch.equal(out, want)
    # The same cells at another phase decode to another window of the same canvas.
    moved = z.clone()
    moved[:, 4:] = phase_channels(torch.tensor([[-3, 10]]), 8, (8, 8))[:, :, None]
    assert torch.equal(ae.decode_raw(moved)[0, :, 0], canvas[0, :, 26:58, 13:45])


@torch.no_grad()
def test_without_offsets_the_encoder_reads_the_phase_off_the_frame():
    ae = make()
    video = torch.rand(1, 3, 3, 32, 32) * 2 - 1
    with torch.no_grad():
        read = ae.phase.offsets(video[0].transpose(0, 1))
    z = ae.encode_raw(video)
    assert torch.equal(z, ae.encode_raw(video, read[None]))


def test_phase_net_pools_edge_scores_by_pixel_modulo_the_tile():
    class Edges(
        nn.Module
    ):  # stands in for the learned convs: vertical edges at x = 3 mod 8, horizontal at y = 6 mod 8
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            n, _, h, w = x.shape
            e = torch.zeros(n, 2, h, w)
            e[:, 0, :, 3::8] = 1.0
            e[:, 1, 6::8, :] = 1.0
            return e

    net = PhaseNet(8)
    net.net = Edges()
    assert net.offsets(torch.zeros(2, 3, 32, 32)).tolist() == [[5, 2], [5, 2]]  # edges at -o mod 8


def test_the_game_draws_tile_edges_where_its_camera_puts_them():
    """What the phase labels rely on: at camera x, the game's tile edges lie at columns -x mod 8."""
    game = Game(GameConfig(size=64))
    game.reset(1_000_003)
    cx, cy = (int(v) for v in game.camera)
    frame = game.terrain().astype(int)
    cols = np.flatnonzero(np.abs(np.diff(frame, axis=1)).sum(axis=(0, 2))) + 1  # first column of a new tile
    rows = np.flatnonzero(np.abs(np.diff(frame, axis=0)).sum(axis=(1, 2))) + 1
    assert len(cols) and len(rows)
    assert set((cols % 8).tolist()) == {(-cx) % 8} and set((rows % 8).tolist()) == {(-cy) % 8}


def test_streaming_decoder_and_world_use_the_canvas_grid():
    from models.causal_wan import CausalWan
    from models.tiny_world import dit_config, world_config
    from models.world import World

    dec = FastStreamingDecoder(make())
    assert dec.margin_cells == 4 and dec.latent_channels == 8
    frames = (np.random.default_rng(0).random((3, 32, 32, 3)) * 255).astype(np.uint8)
    z = dec.encode(frames)
    assert z.shape == (8, 3, 8, 8)
    out, _ = dec.decode(z, dec.init_cache())
    assert out.shape == (3, 32, 32, 3)
    cfg = world_config()
    cfg.width = cfg.height = 32
    world = World(cfg, CausalWan(dit_config(8)), dec, start_image=None)
    assert world.latent_shape == (8, 8, 8)
    # A generated chunk is snapped by the decoder's canonical form (the runner then shows it and
    # writes the history from it).
    noisy = z[None] + 0.2 * torch.randn(1, *z.shape, generator=torch.Generator().manual_seed(0))
    snapped = world.canonical(noisy)
    assert torch.equal(snapped, dec.canonical(noisy)) and not torch.equal(snapped, noisy)


def test_config_validation():
    with pytest.raises(ValueError, match="frame_size"):
        FastAEConfig(**{**TILED, "frame_size": 30})
    with pytest.raises(ValueError, match="more than"):
        FastAEConfig(**{**TILED, "latent_channels": 4})
    plain = FastAEConfig(latent_channels=4)
    assert plain.margin_cells == 0 and plain.cell_channels == 4
    with pytest.raises(ValueError, match="tile-aligned"):
        FastAEConfig(latent_channels=4, sprite=True)
    with pytest.raises(ValueError, match="more than 7"):
        FastAEConfig(**{**TILED, "latent_channels": 7, "sprite": True})
    sprite = FastAEConfig(
        **{**TILED, "latent_channels": 4 + PHASE_CHANNELS + SPRITE_CHANNELS, "sprite": True}
    )
    assert (
        sprite.cell_channels == 4
        and sprite.phase_slice == slice(4, 8)
        and sprite.sprite_slice == slice(8, 11)
    )
    assert FastAEConfig.from_dict(FastAEConfig(**TILED).to_dict()) == FastAEConfig(**TILED)
    with pytest.raises(ValueError, match="codebook needs tile-aligned"):
        FastAEConfig(latent_channels=4, codebook=[[0, 0, 0]])
    with pytest.raises(ValueError, match="RGB triples"):
        FastAEConfig(**TILED, codebook=[[0, 0, 256]])
    with pytest.raises(ValueError, match="RGB triples"):
        FastAEConfig(**TILED, codebook=[[0, 0]])


@torch.no_grad()
def test_a_scroll_by_one_tile_is_a_copy_of_cells():
    """The point of the layout: the game's view moved by one tile (8 px) encodes to the same cells,
    moved by one, wherever a cell was fully in view in both frames; drawn back, they give the same
    pixels moved by 8."""
    torch.manual_seed(0)
    ae = FastAutoencoder(FastAEConfig(**{**TILED, "frame_size": 64, "enc_channels": (4, 8, 8, 32)})).eval()
    for p in ae.parameters():
        p.data.normal_(0, 0.2)
    game = Game(GameConfig(size=64))
    game.reset(1_000_003)
    x, y = (float(v) for v in game._player[0])
    views, cams = [], []
    for dx in (0.0, 8.0):
        game.place_player(x + 13 + dx, y)  # away from the clamped world edge
        views.append(torch.from_numpy(game.terrain()).float().div(127.5).sub(1.0))
        cams.append([int(v) % 8 for v in game.camera])
    assert cams[0] == cams[1] and cams[0][0] != 0  # same phase; a cell straddles the edge
    video = torch.stack(views).permute(3, 0, 1, 2)[None]  # (1, 3, 2, 64, 64)
    z = ae.encode_raw(video, torch.tensor([cams]))[0]  # (C, 2, 12, 12)
    first, moved = z[:, 0, 3:10, 4:10], z[:, 1, 3:10, 3:9]  # cells 3..9 are whole in view
    assert first.std() > 0
    torch.testing.assert_close(moved, first, rtol=0, atol=1e-5)
    frames = ae.decode_raw(z[None])[0]  # (3, 2, 64, 64)
    ox, oy = cams[0]
    rows = slice(8 - oy, 64 - oy)  # cells 3..9 down
    # Cells 3..8 across of the moved view (whole in both) are cells 4..9 of the first.
    moved_cols, first_cols = slice(8 - ox, 56 - ox), slice(16 - ox, 64 - ox)
    torch.testing.assert_close(
        frames[:, 1, rows, moved_cols], frames[:, 0, rows, first_cols], rtol=0, atol=1e-5
    )


@torch.no_grad()
def test_a_chunk_on_the_previous_anchor_is_re_anchored_on_its_last_frame():
    """`canonical`: a chunk whose view ran into the next tile (phases past s) is moved onto the
    anchor of its last frame: the cells it would have been encoded with there, the phase exact,
    the far-margin cells it vacated filled as empty, and the same frames when decoded."""
    ae = make()
    ae.set_normalisation(torch.linspace(-0.5, 0.5, 8), torch.linspace(0.5, 2.0, 8))
    frames = torch.rand(3, 3, 32, 32) * 2 - 1
    off = torch.tensor([[1, 5], [2, 5], [3, 6]])
    wide = ae.encode_wide(frames, off)
    assert wide.shape == (3, 4, 10, 10)
    own = ae.at_anchor(wide, off, torch.zeros(3, 2, dtype=torch.long))
    torch.testing.assert_close(
        own, ae.encode_float(frames.transpose(0, 1)[None], off[None])[0].transpose(0, 1)
    )
    # The chunk as generated on the anchor one tile to the left: phases 9..11.
    prev = ae.at_anchor(wide, off, torch.tensor([[1, 0]] * 3))
    assert read_phase(prev[:, 4:] * ae.latents_std[4:, 0] + ae.latents_mean[4:, 0], 8)[:, 0].tolist() == [
        9,
        10,
        11,
    ]
    noisy = prev + 0.1 * torch.randn(prev.shape, generator=torch.Generator().manual_seed(3)) * (
        torch.arange(8) >= 4
    ).view(8, 1, 1)  # a generated chunk's phase is never exact
    chunk = noisy.transpose(0, 1)[None]  # (1, C, 3, h, w)
    out = ae.canonical(chunk)[0].transpose(0, 1)
    torch.testing.assert_close(out[:, :, :, :7], own[:, :, :, :7], rtol=0, atol=1e-5)
    torch.testing.assert_close(out[:, 4:], own[:, 4:], rtol=0, atol=1e-5)
    fill = (ae.fill_cell() - ae.latents_mean[:4, 0]) / ae.latents_std[:4, 0]
    want = fill[:, 0, 0].view(1, 4, 1).expand(3, 4, 8)
    torch.testing.assert_close(out[:, :4, :, 7], want, rtol=0, atol=1e-5)  # the vacated column
    torch.testing.assert_close(
        ae.decode_float(ae.canonical(chunk)), ae.decode_float(chunk), rtol=0, atol=1e-5
    )
    # A chunk already on its last frame's anchor only has its phase snapped.
    same = ae.canonical(own.transpose(0, 1)[None])[0].transpose(0, 1)
    torch.testing.assert_close(same, own, rtol=0, atol=1e-5)
    plain = FastAutoencoder(
        FastAEConfig(
            latent_channels=4,
            **{k: v for k, v in TILED.items() if k not in ("latent_channels", "frame_size")},
        )
    )
    x = torch.randn(1, 4, 2, 4, 4)
    assert plain.canonical(x) is x


def test_shift_cells_moves_whole_cells_and_fills_the_vacated_ones():
    cells = torch.arange(2 * 1 * 3 * 3, dtype=torch.float32).view(2, 1, 3, 3)
    fill = torch.full((1, 1, 1), -1.0)
    out = shift_cells(cells, torch.tensor([[1, 0], [-1, 1]]), fill)
    assert out[0, 0].tolist() == [[1, 2, -1], [4, 5, -1], [7, 8, -1]]
    assert out[1, 0].tolist() == [[-1, 12, 13], [-1, 15, 16], [-1, -1, -1]]


SPRITED = {**TILED, "latent_channels": 4 + PHASE_CHANNELS + SPRITE_CHANNELS, "sprite": True}


def make_sprited() -> FastAutoencoder:
    torch.manual_seed(0)
    ae = FastAutoencoder(FastAEConfig(**SPRITED))
    for p in ae.parameters():
        p.data.normal_(0, 0.2)
    return ae.eval()


def test_sprite_channels_round_trip_and_survive_noise():
    centre = torch.tensor([[16, 16], [3, 29], [32, 0], [0, 32]])
    state = torch.tensor([False, True, True, False])
    ch = sprite_channels(centre, state, 32, (5, 5))
    assert ch.shape == (4, 3, 5, 5) and ch[0].abs().max() == 1  # the centre is 0, the state -1
    noisy = ch + 0.3 * torch.randn(ch.shape, generator=torch.Generator().manual_seed(0))
    for c in (ch, noisy):
        got_centre, got_state = read_sprite(c, 32)
        assert torch.equal(got_centre, centre) and torch.equal(got_state, state)


@torch.no_grad()
def test_the_sprite_looks_the_same_wherever_it_is_drawn_and_only_near_its_centre():
    torch.manual_seed(0)
    dec = SpriteDecoder()
    dec.bitmaps.data.normal_(0, 1.0)
    backdrop = torch.full((2, 3, 64, 64), 0.3)  # a flat backdrop: only the sprite varies
    centre = torch.tensor([[30, 30], [41, 26]])
    r = SPRITE_REACH
    for state in (torch.tensor([True, True]), torch.tensor([False, False])):
        out = dec(backdrop, centre, state)
        drawn = out - backdrop
        assert drawn.abs().max() > 0.01
        torch.testing.assert_close(
            out[0, :, 30 - r : 30 + r, 30 - r : 30 + r], out[1, :, 26 - r : 26 + r, 41 - r : 41 + r]
        )
        keep = torch.ones(64, 64, dtype=torch.bool)
        keep[30 - r : 30 + r, 30 - r : 30 + r] = False
        assert drawn[0, :, keep].abs().max() == 0  # nothing beyond the reach
    on = dec(backdrop, centre, torch.tensor([True, True]))
    off = dec(backdrop, centre, torch.tensor([False, False]))
    assert (on - off).abs().max() > 0.01  # the state changes the drawing


@torch.no_grad()
def test_a_sprited_frame_encodes_its_sprite_and_draws_it_over_the_cells():
    ae = make_sprited()
    ae.set_normalisation(torch.linspace(-0.5, 0.5, 11), torch.linspace(0.5, 2.0, 11))
    frames = torch.rand(3, 3, 32, 32) * 2 - 1
    off = torch.tensor([[1, 5], [2, 5], [3, 6]])
    spr = torch.tensor([[16, 16, 0], [17, 15, 1], [16, 30, 1]])
    z = ae.encode_raw(frames.transpose(0, 1)[None], off[None], spr[None])[0]  # (C, 3, 6+4, 6+4)
    assert z.shape == (11, 3, 8, 8)
    flat = z.transpose(0, 1)
    centre, state = read_sprite(flat[:, 8:], 32)
    assert centre.tolist() == spr[:, :2].tolist() and state.tolist() == [False, True, True]
    # Without known sprites the encoder reads them off the frames (here an untrained guess).
    guessed = ae.encode_raw(frames.transpose(0, 1)[None], off[None])[0]
    torch.testing.assert_close(guessed[:8], z[:8])
    backdrop, drawn = ae.decode_layers(flat)
    torch.testing.assert_close(backdrop, ae.decode_layers(torch.cat([flat[:, :8], -flat[:, 8:]], 1))[0])
    torch.testing.assert_close(drawn, ae.sprite_decoder(backdrop, centre, state))
    torch.testing.assert_close(ae.decode_raw(z[None])[0].transpose(0, 1), drawn)
    # Wide cells carry the sprite channels too; cut on the frame's own anchor they are its latents.
    wide = ae.encode_wide(frames, off, spr)
    assert wide.shape == (3, 7, 10, 10)
    own = ae.at_anchor(wide, off, torch.zeros(3, 2, dtype=torch.long))
    torch.testing.assert_close(
        own, ae.encode_float(frames.transpose(0, 1)[None], off[None], spr[None])[0].transpose(0, 1)
    )
    # Re-anchoring moves cells, never the sprite: it stays where the view has it, snapped.
    prev = ae.at_anchor(wide, off, torch.tensor([[1, 0]] * 3))
    noisy = prev + 0.05 * torch.randn(prev.shape, generator=torch.Generator().manual_seed(1))
    out = ae.canonical(noisy.transpose(0, 1)[None])[0].transpose(0, 1)
    torch.testing.assert_close(out[:, 8:], own[:, 8:], rtol=0, atol=1e-5)
    torch.testing.assert_close(
        ae.decode_float(out.transpose(0, 1)[None]),
        ae.decode_float(noisy.transpose(0, 1)[None]),
        rtol=0,
        atol=1e-5,
    )


@torch.no_grad()
def test_canonical_snaps_flat_cells_to_the_codebook_and_keeps_creatures():
    """The shipped autoencoder (tile-aligned, with a codebook fit on frames): a cell the model can
    only guess, drawn as the mean of the terrain's codes, is not a colour of the game; `canonical`
    makes it the nearest codebook tile. Cells of real terrain decode as before, and a creature,
    which no flat tile holds, stays."""
    from models.registry import load_world
    from models.tiny_world import WEIGHTS_DIR

    dec = load_world(WEIGHTS_DIR).decoder
    ae, cfg = dec.ae, dec.ae.cfg
    assert cfg.codebook and cfg.sprite
    game = Game(GameConfig(size=64))
    red = np.array(GameConfig().palette.creature)
    frames = (game.reset(seed) for seed in range(1_000_000, 1_000_200))
    frame = next(f for f in frames if (f == red).all(-1).sum() >= 12)  # a start frame with a creature
    z = dec.encode(frame[None])  # (C, 1, 12, 12), the frame on its own anchor (phase in [0, 8))
    k = cfg.cell_channels
    ph = cfg.phase_slice
    ox, oy = read_phase((z[ph, 0] * ae.latents_std[ph, 0] + ae.latents_mean[ph, 0])[None], 8)[0].tolist()
    creature = ((frame == red).all(-1)).astype(np.float32)  # (64, 64)
    # Cells whose pixels hold any creature, in canvas cells (the view sits at 16 + phase).
    canvas = np.zeros((96, 96), np.float32)
    canvas[16 + oy : 80 + oy, 16 + ox : 80 + ox] = creature
    has_creature = canvas.reshape(12, 8, 12, 8).max(axis=(1, 3)) > 0
    guess = np.zeros((12, 12), bool)
    guess[3:5, 3:9] = True  # two rows of whole cells in view, above the player's reach ...
    guess &= ~has_creature  # ... without the creature
    assert guess.sum() >= 8
    g = torch.from_numpy(guess)
    mean_code = z[:k, 0, 3:9, 3:9].mean(dim=(1, 2))  # the mean of the view's terrain codes
    guessed = z.clone()
    guessed[:k, 0, g] = mean_code[:, None]
    book = np.array(cfg.codebook)

    def cells_of(img: np.ndarray) -> np.ndarray:  # (64, 64, 3) view -> (12, 12, 8, 8, 3) canvas cells
        c = np.zeros((96, 96, 3), np.int32)
        c[16 + oy : 80 + oy, 16 + ox : 80 + ox] = img
        return c.reshape(12, 8, 12, 8, 3).transpose(0, 2, 1, 3, 4)

    def off_book(img: np.ndarray) -> np.ndarray:  # per cell: pixels further than 3 from every colour
        px = cells_of(img)[guess].reshape(-1, 1, 3)
        return (np.abs(px - book[None]).max(-1).min(-1) > 3).reshape(guess.sum(), -1).mean(-1)

    before = dec.decode(guessed, dec.init_cache())[0][-1].numpy()
    assert off_book(before).min() > 0.5  # the mean guess is no colour of the game
    snapped = ae.canonical(guessed[None])[0]
    after = dec.decode(snapped, dec.init_cache())[0][-1].numpy()
    assert off_book(after).max() == 0  # every guessed cell is now one of its tiles
    untouched = ~guess & ~has_creature
    view = cells_of(np.ones((64, 64, 3), np.int32))[..., 0].reshape(12, 12, 64).all(-1) & untouched
    orig = dec.decode(z, dec.init_cache())[0][-1].numpy()
    err = np.abs(cells_of(after)[view] - cells_of(orig)[view]).max()
    assert err <= 3  # real terrain snaps to itself

    def reddish(img: np.ndarray) -> int:
        return int(((img[..., 0] > 150) & (img[..., 1] < 100)).sum())

    assert reddish(orig) >= 12 and reddish(after) >= 0.8 * reddish(orig)
    # Without a codebook canonical leaves the cells alone.
    plain = FastAutoencoder(FastAEConfig.from_dict({**cfg.to_dict(), "codebook": []}))
    plain.load_state_dict(ae.state_dict())
    torch.testing.assert_close(plain.canonical(guessed[None])[0][:k], guessed[:k])
