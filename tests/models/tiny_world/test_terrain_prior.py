"""The terrain prior (models/tiny_world/terrain_prior.py) and its training (models/tiny_world/terrain.py): it
learns a map's local structure from the maps alone, draws only the tiles it is asked to, each a
fixed function of the context and the tile's place, and later passes see the earlier ones."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from models.game import GameConfig, generate_world
from models.tiny_world import WEIGHTS_DIR
from models.tiny_world.terrain_prior import (
    PASS_SPAN,
    TerrainPrior,
    TerrainPriorConfig,
    pass_order,
    pass_sizes,
    uniform,
)
from models.tiny_world.training.prior import (
    TerrainTrainConfig,
    class_maps,
    evaluate,
    examples,
    known_mask,
    train_terrain,
)

CODEBOOK = json.loads((WEIGHTS_DIR / "vae" / "config.json").read_text())["codebook"]


def stripes(n: int, size: int = 12) -> np.ndarray:
    """`n` maps of 3 classes in vertical stripes two tiles wide, each map's stripes shifted: a
    tile's class is its left neighbours' rule (a b b c c a a ...), unknowable from frequencies."""
    cols = (np.arange(size)[None, :] + np.arange(n)[:, None]) // 2 % 3
    return np.repeat(cols[:, None, :], size, axis=1)


@pytest.fixture(scope="module")
def striped() -> TerrainPrior:
    prior, figures = train_terrain(
        stripes(40), CODEBOOK[:3], TerrainTrainConfig(steps=300, batch=64, lr=3e-3, width=64, held_out=8)
    )
    assert figures["accuracy"] > 0.9 and figures["cross_entropy"] < 0.5 * figures["frequency_cross_entropy"]
    return prior


def test_config_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="odd"):
        TerrainPriorConfig(classes=8, window=4)
    with pytest.raises(ValueError, match="at least 2"):
        TerrainPriorConfig(classes=1)


def test_the_draw_is_a_fixed_spread_hash_of_the_place():
    ys, xs = torch.meshgrid(torch.arange(-50, 50), torch.arange(-50, 50), indexing="ij")
    places = torch.stack([xs, ys])
    u = uniform(places)
    assert torch.equal(u, uniform(places.clone()))
    assert float(u.min()) >= 0 and float(u.max()) < 1
    counts = torch.histc(u.float(), bins=10, min=0, max=1)
    assert counts.min() > 800 and counts.max() < 1200  # 10 000 places, ~1000 a decile
    assert (u[:, 1:] != u[:, :-1]).float().mean() > 0.99  # neighbours differ
    # Places count from each session's start: its salt keeps sessions from sharing draws.
    other = uniform(places, torch.tensor(12345))
    assert (other != u).float().mean() > 0.99 and abs(
        float(torch.corrcoef(torch.stack([u, other]).flatten(1))[0, 1])
    ) < 0.05


def test_class_maps_are_the_games_tiles_in_codebook_order():
    # The shipped codebook, fit on frames, holds every colour the game's terrain is drawn in.
    maps = class_maps([0, 1], CODEBOOK, GameConfig())
    rgb = np.asarray(CODEBOOK)[maps]
    assert np.array_equal(rgb[0], generate_world(0, GameConfig()).rgb)
    assert np.array_equal(rgb[1], generate_world(1, GameConfig()).rgb)
    # A codebook whose entries are off the game's colours: each tile is its nearest entry.
    book = (np.asarray(CODEBOOK) + np.array([3, -2, 1])).clip(0, 255)
    assert np.array_equal(class_maps([0, 1], book.tolist(), GameConfig()), maps)
    # Fewer entries than the game's colours: the missing ones go to their nearest.
    light = [c for i, c in enumerate(CODEBOOK) if i % 2]
    coarse = class_maps([0], light, GameConfig())
    assert coarse.max() < len(light) and len(np.unique(coarse)) == len(light)
    with pytest.raises(ValueError, match="codebook of RGB"):
        class_maps([0], [], GameConfig())


def test_a_session_knows_the_side_behind_the_moving_edge():
    rng = np.random.default_rng(0)
    masks = np.stack([known_mask(rng, 7) for _ in range(2000)])
    assert not masks[:, 3, 3].any()  # never the tile itself
    behind, ahead = masks[:, :, :3].mean(), masks[:, :, 4:].mean()
    assert behind > 0.7 and ahead < 0.2
    # Rotated and mirrored in `examples`, every side is the known one about as often.
    windows, _ = examples(np.zeros((4, 12, 12), dtype=np.int64), rng, 4000, 7, unknown=3)
    known = (windows != 3).float()
    sides = [known[:, :, :3].mean(), known[:, :, 4:].mean(), known[:, :3].mean(), known[:, 4:].mean()]
    assert max(sides) - min(sides) < 0.05


def test_fill_draws_the_fresh_tiles_by_what_it_learned_and_leaves_the_rest(striped):
    maps = stripes(1, size=20)[0]  # rows all alike: a b b c c a a b b ...
    g, r = 6, 3
    region = torch.full((g + 2 * r, g + 2 * r), striped.cfg.unknown)
    region[:, : r + 3] = torch.from_numpy(maps[: g + 2 * r, : r + 3])  # known up to canvas column 2
    fresh = torch.zeros(g, g, dtype=torch.bool)
    fresh[:, 3] = True  # the column coming into view
    ys, xs = torch.meshgrid(torch.arange(g), torch.arange(g), indexing="ij")
    places = torch.stack([xs + 100, ys + 7])
    out = striped.fill(region, fresh, places)
    assert torch.equal(out[:, 3], torch.full((g,), int(maps[0, r + 3])))  # the stripes' rule
    assert torch.equal(out[~fresh], region[r : r + g, r : r + g][~fresh])  # nothing else drawn
    assert torch.equal(out, striped.fill(region, fresh, places))  # a fixed function
    # A batch of sessions (leading axis, each its own salt and place) draws what each draws alone.
    other = torch.full_like(region, striped.cfg.unknown)
    salts = torch.tensor([5, 9])
    there = places + torch.tensor([-3, 2])[:, None, None]  # another canvas corner: other passes
    both = striped.fill(
        torch.stack([region, other]), torch.stack([fresh, fresh]), torch.stack([places, there]), salts
    )
    assert torch.equal(both[0], striped.fill(region, fresh, places, salts[0]))
    assert torch.equal(both[1], striped.fill(other, fresh, there, salts[1]))


def test_the_passes_go_coarse_to_fine_and_never_draw_neighbours_together():
    ys, xs = torch.meshgrid(torch.arange(-9, 11), torch.arange(5, 25), indexing="ij")
    order = pass_order(xs, ys)
    assert (order[:, 1:] != order[:, :-1]).all() and (order[1:] != order[:-1]).all()
    # Along a line: every fourth tile first, then the midpoints between them, then the rest.
    line = pass_order(torch.arange(0, 8), torch.zeros(8, dtype=torch.long))
    assert line.tolist() == [0, 2, 1, 3, 0, 2, 1, 3]
    sizes = pass_sizes(3 * PASS_SPAN)
    assert len(sizes) == 2 * PASS_SPAN - 1 and sum(sizes) == (3 * PASS_SPAN) ** 2
    assert list(sizes) == torch.bincount(pass_order(xs[:12, :12], ys[:12, :12]).flatten()).tolist()


def test_later_passes_see_the_earlier(striped):
    # Nothing known but the fresh tiles themselves: later tiles are drawn next to the earlier
    # ones, so a column comes out of one class where independent draws would mix them.
    g, r = 8, 3
    region = torch.full((g + 2 * r, g + 2 * r), striped.cfg.unknown)
    fresh = torch.zeros(g, g, dtype=torch.bool)
    fresh[:, 4] = True
    ys, xs = torch.meshgrid(torch.arange(g), torch.arange(g), indexing="ij")
    agree = []
    for shift in range(20):
        col = striped.fill(region, fresh, torch.stack([xs + 31 * shift, ys]))[:, 4]
        odd, even = col[1::2], col[0::2]
        agree.append(float((odd == even).float().mean()))
    assert np.mean(agree) > 0.6  # three classes: independent draws would agree about a third


def test_training_is_deterministic_given_its_seed():
    cfg = TerrainTrainConfig(steps=20, batch=16, width=16, held_out=2)
    a, fa = train_terrain(stripes(8), CODEBOOK[:3], cfg, seed=3)
    b, fb = train_terrain(stripes(8), CODEBOOK[:3], cfg, seed=3)
    assert fa == fb
    assert all(
        torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )
    assert evaluate(a, stripes(2), 0)["examples"] == 8192


def test_the_cli_adds_a_prior_to_a_model_directory(tmp_path, capsys):
    from models.registry import load_world
    from models.tiny_world.terrain import main

    out = tmp_path / "with_prior"
    n = torch.get_num_threads()
    try:
        assert main(["--model", str(WEIGHTS_DIR), "--out", str(out), "--steps", "2", "--threads", "1"]) == 0
        assert (
            main(["--model", str(WEIGHTS_DIR), "--out", str(out), "--steps", "2"]) == 2
        )  # refuses to overwrite
    finally:
        torch.set_num_threads(n)
    assert "exists" in capsys.readouterr().err
    world = load_world(out)
    assert world.plugin.terrain is not None and world.plugin.cartographer.prior is world.plugin.terrain
    shipped = json.loads((WEIGHTS_DIR / "worldserve.json").read_text())
    assert json.loads((out / "worldserve.json").read_text())["world"] == shipped["world"]
