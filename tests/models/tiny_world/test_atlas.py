"""The atlas (models/tiny_world/atlas.py) on the shipped tiny world's autoencoder: it keeps the flat tiles a
frame shows wholly, at their place on the grid, and gives them back, as the encoder writes them,
when a view shows them again, drawn as the game draws those tiles there; and it remembers the
creatures whose tiles scroll off the canvas."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from models.game import simulate
from models.registry import from_name
from models.tiny_world.atlas import EMPTY, Atlas, Cartographer
from models.tiny_world.fast_decoder import FastAutoencoder, creature_channels
from models.tiny_world.metrics import free_worlds


@pytest.fixture(scope="module")
def world():
    return from_name("tiny-world")


@pytest.fixture(scope="module")
def carto(world):
    return Cartographer(world.decoder.ae, 64)


def encode(world, frame: np.ndarray) -> torch.Tensor:
    """A game frame as a session's latest latent frame (C, 1, h, w), on its own anchor."""
    return world.decoder.encode(frame[None])


def recall(carto: Cartographer, atlas: Atlas, z: torch.Tensor, phases: torch.Tensor):
    """One session's recall (`Cartographer.recall` reads a batch): (k, n, g, g), (1, n, g, g)."""
    values, mask, _ = carto.recall(Atlas.stack([atlas]), z[None], phases[None])
    return values[0], mask[0]


def test_a_start_frame_keeps_its_flat_tiles_wholly_in_view(world, carto):
    sim = simulate(1_050_000, [])
    z = encode(world, sim.frames[0])
    atlas = carto.start(z)
    ae, k = world.decoder.ae, carto.k
    pos = carto.phase(z[:, 0][None]) + 2 * carto.s
    raw = z[:k, 0][None] * carto.std[:k] + carto.mean[:k]
    flat, _ = ae.flat_cells(raw, ae.view_cover(pos, carto.g))
    keep = (flat & carto.whole(pos))[0, 0]
    assert 40 <= int(keep.sum()) <= 64  # an 8 x 8-tile view, less the cells a creature or cut tile spoils
    assert int((atlas.tags[0] != EMPTY).sum()) == int(keep.sum())
    tiles, sy, sx = carto.slots(atlas.origin)
    assert torch.equal(atlas.tags[:, sy, sx][:, keep], tiles[:, keep])
    assert torch.equal(atlas.cells[:, sy, sx][:, keep], z[:k, 0][:, keep])
    memory = 2 * 64 * 64 * 8 + 64 * 64  # creature memory: tags and where, one byte
    assert atlas.nbytes == (k * 64 * 64) * 4 + 2 * 64 * 64 * 8 + 2 * 8 + 8 + memory
    assert carto.nbytes(4) == atlas.nbytes


def test_tiles_shown_before_come_back_where_the_game_draws_them(world, carto):
    # The view walked 3 tiles right (frame 24 of a free walk); on the way back the start frame's
    # tiles re-enter on the left, each frame's cut of them re-encoded for that frame's view.
    seed = free_worlds(1, 24, 1_050_000, keys="d")[0]
    sim = simulate(seed, [frozenset("d")] * 24, layers=True)
    z0, z24 = encode(world, sim.frames[0]), encode(world, sim.frames[24])
    p0, p24 = carto.phase(z0[:, 0][None])[0], carto.phase(z24[:, 0][None])[0]
    assert torch.equal(p0, p24)  # 24 px is 3 whole tiles
    atlas = carto.write(carto.start(z0), torch.tensor([3, 0]), z24)
    assert atlas.origin.tolist() == [3, 0]
    back = torch.arange(1, 5)
    phases = torch.stack([p24[0] - back, p24[1].expand(4)])  # frames 23, 22, 21, 20
    values, mask = recall(carto, atlas, z24, phases)
    assert values.shape == (carto.k, 4, carto.g, carto.g) and mask.shape == (1, 4, carto.g, carto.g)
    shown = carto.whole(p24[None] + 2 * carto.s)[0, 0]
    assert not (mask[0] & shown).any()  # the latest frame's own tiles are the DiT's
    assert mask[0].any(dim=(1, 2)).all()  # every frame of the walk back shows remembered tiles
    ae, s, k = world.decoder.ae, carto.s, carto.k
    for j in range(4):
        raw = values[:, j][None] * carto.std[:k] + carto.mean[:k]
        with torch.no_grad():
            canvas = ae.decoder(raw).clamp(-1, 1)[0]  # (3, S, S)
        x, y = (phases[:, j] + 2 * s).tolist()
        view = canvas[:, y : y + 64, x : x + 64].permute(1, 2, 0)
        pinned = mask[0, j].repeat_interleave(s, 0).repeat_interleave(s, 1)[y : y + 64, x : x + 64]
        game = torch.from_numpy(sim.backdrops[23 - j]).float() / 127.5 - 1
        err = (view - game).abs().amax(dim=-1)[pinned]
        assert pinned.sum() >= 64 and float(err.mean()) < 0.03, (j, float(err.mean()))


def test_a_full_atlas_overwrites_the_slot_and_forgets_the_older_tile(world, carto):
    small = Cartographer(world.decoder.ae, carto.g)  # as few slots as one frame's tiles
    z = encode(world, simulate(1_050_000, []).frames[0])
    first = small.start(z)
    moved = small.write(first, torch.tensor([small.g, 0]), z)  # the same tiles g tiles further on
    tiles, sy, sx = small.slots(torch.zeros(2, dtype=torch.long))
    assert not (moved.tags[:, sy, sx] == tiles).all(dim=0).any()  # nothing of the first place is left
    assert (first.tags[:, sy, sx] == tiles).all(dim=0).any()  # versions are never written in place
    with pytest.raises(ValueError, match="smaller than a latent frame"):
        Cartographer(world.decoder.ae, carto.g - 1)


def test_tiles_never_shown_are_drawn_from_the_terrain_prior(world, carto):
    # Views 8-11 px right of the start: the column entering on the right was neither remembered
    # nor begun by the start frame. Without a prior the DiT draws it; with one it is pinned, a
    # flat tile of the codebook, the same on every call.
    seed = free_worlds(1, 12, 1_050_000, keys="d")[0]
    z = encode(world, simulate(seed, []).frames[0])
    atlas = carto.start(z)
    p = carto.phase(z[:, 0][None])[0]
    phases = torch.stack([p[0] + torch.arange(8, 12), p[1].expand(4)])
    _, left_to_dit = recall(carto, atlas, z, phases)
    assert world.plugin.terrain is not None
    drawing = Cartographer(world.decoder.ae, 64)
    drawing.set_prior(world.plugin.terrain)
    values, mask = recall(drawing, atlas, z, phases)
    again = recall(drawing, atlas, z, phases)
    assert torch.equal(values, again[0]) and torch.equal(mask, again[1])
    assert torch.equal(mask & left_to_dit, left_to_dit)  # what the atlas knew, it still pins
    s, k, ae = carto.s, carto.k, world.decoder.ae
    book = torch.tensor(ae.cfg.codebook, dtype=torch.float32) / 127.5 - 1  # (K, 3)
    for j in range(4):
        x = int(phases[0, j]) + 2 * s
        right = (x + 63) // s  # the cell column the view's last pixel column lies in
        new = mask[0, j, :, right] & ~left_to_dit[0, j, :, right]
        assert int(new.sum()) >= 6, j  # the entering column, less cells a view cuts off
        raw = values[:, j][None] * carto.std[:k] + carto.mean[:k]
        with torch.no_grad():
            canvas = ae.decoder(raw).clamp(-1, 1)[0]
        for row in torch.nonzero(new).flatten().tolist():
            cell = canvas[:, row * s : (row + 1) * s, right * s : x + 64]
            err = (cell[None] - book[:, :, None, None]).abs().amax(dim=(1, 2, 3))
            assert float(err.min()) < 0.05, (j, row)  # a flat tile in one of the codebook's colours
    with pytest.raises(ValueError, match="codebook has 8"):
        drawing.set_prior(type(world.plugin.terrain)(replace(world.plugin.terrain.cfg, classes=5)))


def test_sessions_recall_together_as_each_would_alone(world):
    # Two sessions in one batch: one walked 3 tiles right (remembered tiles come back), the
    # other just started elsewhere (its entering column is drawn from the prior, with its own
    # salt). Each gets what it gets alone, so a batch never mixes sessions.
    drawing = Cartographer(world.decoder.ae, 64)
    drawing.set_prior(world.plugin.terrain)
    seed = free_worlds(1, 24, 1_050_000, keys="d")[0]
    sim = simulate(seed, [frozenset("d")] * 24)
    z0, z24 = encode(world, sim.frames[0]), encode(world, sim.frames[24])
    walked = drawing.write(drawing.start(z0), torch.tensor([3, 0]), z24)
    p = drawing.phase(z24[:, 0][None])[0]
    back = torch.stack([p[0] - torch.arange(1, 5), p[1].expand(4)])
    other = encode(world, simulate(seed + 1, []).frames[0])
    q = drawing.phase(other[:, 0][None])[0]
    ahead = torch.stack([q[0] + torch.arange(8, 12), q[1].expand(4)])
    alone = [recall(drawing, walked, z24, back), recall(drawing, drawing.start(other), other, ahead)]
    values, mask, _ = drawing.recall(
        Atlas.stack([walked, drawing.start(other)]), torch.stack([z24, other]), torch.stack([back, ahead])
    )
    for i, (v, m) in enumerate(alone):
        assert torch.equal(mask[i], m) and m.any()
        assert torch.allclose(values[i][m.expand_as(v)], v[m.expand_as(v)], atol=1e-5)


# The creature memory: a creature that scrolls off the canvas is remembered at its tile and comes
# back with it, unless the latest frame already shows a creature beside that cell.

OFFSET = (2, 5)  # (x, y) px of the remembered creature's square in its tile


def with_creatures(world, z: torch.Tensor, cells: list[tuple[int, int]]) -> torch.Tensor:
    """The latent frame z (C, 1, h, w) with its creature layer replaced: one creature's square
    starting at `OFFSET` in each canvas cell (x, y) of `cells`, none elsewhere."""
    ae = world.decoder.ae
    g, s, cs = ae.cfg.canvas_cells, ae.cfg.spatial, ae.cfg.creature_slice
    present = torch.zeros(1, g, g, dtype=torch.bool)
    offsets = torch.zeros(1, 2, g, g, dtype=torch.long)
    for x, y in cells:
        present[0, y, x] = True
        offsets[0, :, y, x] = torch.tensor(OFFSET)
    raw = creature_channels(present, offsets, s)[0]
    out = z.clone()
    out[cs, 0] = (raw - ae.latents_mean[cs, 0]) / ae.latents_std[cs, 0]
    return out


def remembered(carto: Cartographer, atlas: Atlas, z: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """(cell x, cell y, px x, px y) of each creature `Cartographer.remembered` brings back."""
    met, where = carto.remembered(Atlas.stack([atlas]), z[None])
    return [(int(x), int(y), *where[0, :, y, x].tolist()) for y, x in met[0].nonzero().tolist()]


def chunk(
    carto: Cartographer, atlas: Atlas, before: torch.Tensor, moved: tuple[int, int], after: torch.Tensor
) -> Atlas:
    """The atlas after a chunk whose last frame is `before` on the old anchor, `after` on the new
    (as `TinyWorldPlugin.advance` files it)."""
    return carto.write(carto.file_creatures(atlas, before), torch.tensor(moved), after)


def test_a_creature_that_scrolls_off_the_canvas_comes_back_with_its_tile(world, carto):
    z = world.decoder.encode(simulate(1_050_000, []).frames[0][None])
    # The start frame shows a creature in canvas cell (3, 5); the anchor then moves a tile right a
    # chunk and the creature stands, so it lies one cell further left on each canvas.
    atlas = carto.start(with_creatures(world, z, [(3, 5)]))
    for cell in (3, 2, 1, 0):
        after = with_creatures(world, z, [(cell - 1, 5)] if cell else [])
        atlas = chunk(carto, atlas, with_creatures(world, z, [(cell, 5)]), (1, 0), after)
        assert remembered(carto, atlas, after) == []
    # Back one tile: its tile enters the canvas's left column, where the frame shows none.
    none = with_creatures(world, z, [])
    back = chunk(carto, atlas, none, (-1, 0), none)
    assert remembered(carto, back, none) == [(0, 5, *OFFSET)]
    # A creature the latest frame shows beside that cell is the same one: nothing comes back.
    assert remembered(carto, back, with_creatures(world, z, [(1, 6)])) == []
    # Refiled once its tile has been on the canvas for a chunk: gone if the frame shows none there.
    assert remembered(carto, chunk(carto, back, none, (0, 0), none), none) == []


def test_a_world_without_a_creature_layer_keeps_no_creature_memory(world):
    ae = FastAutoencoder(replace(world.decoder.ae.cfg, creatures=False))
    plain = Cartographer(ae, 64)
    z = torch.zeros(ae.cfg.latent_channels, 1, 12, 12)  # no creature channels
    atlas = plain.write(plain.start(z), torch.tensor([1, 0]), z)
    assert atlas.creature_at.numel() == 0 and atlas.creature_tags.numel() == 0
    assert plain.nbytes(4) == atlas.nbytes
