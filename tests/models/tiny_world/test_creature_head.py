"""The creature head (models/tiny_world/creature_head.py): it walks each creature by its predicted
moves, drops the ones that leave the canvas, meets new ones only in new tiles at its fitted rate
(the same ones for the same session state), and its training learns a walk from tracks."""

from __future__ import annotations

import numpy as np
import torch

from models.tiny_world.creature_head import CreatureHead, CreatureHeadConfig, clean_layers
from models.tiny_world.fast_decoder import creature_channels, read_creatures
from models.tiny_world.training.creatures import CreatureData, CreatureTraining, train_walk, walk_accuracy

S, G = 8, 4  # pixels per cell, cells per canvas side


def head(**kw) -> CreatureHead:
    return CreatureHead(CreatureHeadConfig(cell_channels=2, classes=3, spatial=S, **kw))


def layers_with(*corners: tuple[int, int], lags: int = 3) -> torch.Tensor:
    """(1, lags, 3, G, G) raw creature layers with creatures starting at canvas pixels `corners`,
    the same in every frame."""
    present = torch.zeros(1, G, G, dtype=torch.bool)
    offsets = torch.zeros(1, 2, G, G, dtype=torch.long)
    for x, y in corners:
        present[0, y // S, x // S] = True
        offsets[0, :, y // S, x // S] = torch.tensor([x % S, y % S])
    return creature_channels(present, offsets, S)[:, None].expand(-1, lags, -1, -1, -1)


def corners_of(present: torch.Tensor, offsets: torch.Tensor, s: int = S) -> list[tuple[int, int]]:
    """Canvas pixels where a frame's creatures start ((g, g) bool, (2, g, g) offsets)."""
    ys, xs = present.nonzero(as_tuple=True)
    at = zip(ys.tolist(), xs.tolist(), strict=True)
    return sorted((x * s + int(offsets[0, y, x]), y * s + int(offsets[1, y, x])) for y, x in at)


def test_a_zeroed_head_walks_every_creature_nowhere():
    h = head()
    with torch.no_grad():
        for p in h.parameters():
            p.zero_()
    present, offsets = h.walk(torch.randn(1, 2, G, G), layers_with((3, 5), (20, 9)), n=4)
    assert present.shape == (1, 4, G, G)
    for f in range(4):
        assert corners_of(present[0, f], offsets[0, f]) == [(3, 5), (20, 9)]


def test_creatures_move_as_the_head_predicts_and_one_that_leaves_the_canvas_is_dropped():
    h = head()
    m = h.cfg.max_step
    with torch.no_grad():
        h.out.weight.zero_()
        bias = torch.zeros(h.cfg.horizon, 2, h.cfg.moves)
        for f in range(h.cfg.horizon):
            bias[f, 0, m + min(f + 1, 2)] = 20.0  # x: +1, then +2 from the second frame on
            bias[f, 1, m - 1] = 20.0  # y: -1 every frame
        h.out.bias.copy_(bias.flatten())
    present, offsets = h.walk(torch.zeros(1, 2, G, G), layers_with((15, 8), (31, 20)), n=3)
    assert corners_of(present[0, 0], offsets[0, 0]) == [(16, 7)]  # (32, 19) is off the 32-px canvas
    assert corners_of(present[0, 1], offsets[0, 1]) == [(17, 7)]
    assert corners_of(present[0, 2], offsets[0, 2]) == [(17, 7)]


def test_creatures_are_met_only_in_new_tiles_at_the_fitted_rate_and_the_same_ones_again():
    h = head()
    with torch.no_grad():
        h.births[:, 0] = torch.tensor([-30.0, 30.0, 0.0])  # class 0 never, 1 always, 2 half the time
        h.births[:, 1:] = -30.0
        h.births[:, 1 + 2 * S + 5] = 30.0  # at pixel (5, 2) of the tile
    n = 32
    places = torch.stack(torch.meshgrid(torch.arange(n), torch.arange(n), indexing="xy"))[None]
    salt = torch.tensor([1234])
    for cls, low, high in ((-1, 0.0, 0.0), (0, 0.0, 0.0), (1, 1.0, 1.0), (2, 0.4, 0.6)):
        classes = torch.full((1, n, n), cls)
        met, where = h.born(classes, places, salt)
        assert low <= met.double().mean() <= high, cls
        assert (where[:, 0][met] == 5).all() and (where[:, 1][met] == 2).all()
    classes = torch.full((1, n, n), 2)
    again, _ = h.born(classes, places, salt)
    assert torch.equal(again, h.born(classes, places, salt)[0])
    assert not torch.equal(again, h.born(classes, places, torch.tensor([99]))[0])  # another session


def test_clean_layers_reads_generated_channels_as_the_encoder_writes_them():
    raw = layers_with((3, 5))[0, 0]
    noisy = raw + 0.1 * torch.randn(raw.shape, generator=torch.Generator().manual_seed(0))
    assert torch.equal(clean_layers(noisy, S), raw)
    assert torch.equal(read_creatures(clean_layers(noisy, S)[None], S)[0], read_creatures(raw[None], S)[0])


def diagonal_tracks(episodes: int, frames: int, creatures: int, seed: int) -> np.ndarray:
    """(E, N+1, K, 2) creatures walking diagonally at half a pixel a frame in world pixels."""
    rng = np.random.default_rng(seed)
    start = rng.integers(8, 24, size=(episodes, 1, creatures, 2)).astype(np.float64)
    sign = rng.choice([-1.0, 1.0], size=(episodes, 1, creatures, 2))
    phase = rng.integers(0, 2, size=(episodes, 1, creatures, 1))
    t = np.arange(frames + 1)[None, :, None, None]
    return (start + sign * np.floor((t + phase) / 2)).astype(np.int64)


def test_training_learns_a_walk_that_standing_still_does_not():
    e, n = 6, 24
    tracks = diagonal_tracks(e, n, 2, seed=0)
    zeros = np.zeros((e, n + 1, 2), dtype=np.int64)
    data = CreatureData(torch.zeros(e, n + 1, 2, G, G, dtype=torch.float16), zeros, zeros, tracks, S)
    h = head(width=16, layers=2)
    torch.manual_seed(0)
    tr = CreatureTraining(steps=150, batch=32, lr=1e-2, still=0.0)
    train_walk(h, data, np.arange(4), tr, progress=False)
    figures = walk_accuracy(h.eval(), data, np.arange(4, 6))
    assert figures["creatures"] > 0
    assert figures["frame_axes_exact"] > figures["frame_axes_standing_still"] + 0.3
