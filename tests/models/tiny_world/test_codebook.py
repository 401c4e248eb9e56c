"""The autoencoder's codebook, fit on frames (models/tiny_world/training/codebook.py and the
`python -m models.tiny_world.codebook` command): it recovers the flat colours frames are drawn in,
leaves out cells that are not flat, is the same for a seed, and is stored as the autoencoder
config's "codebook" (an older directory's "palette" read as the same)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from models.tiny_world import WEIGHTS_DIR, ae_config
from models.tiny_world.codebook import load_autoencoder, main
from models.tiny_world.fast_decoder import FastAEConfig
from models.tiny_world.training.codebook import choose_k, fit_codebook, flat_colours, kmeans

COLOURS = np.array([[20, 20, 20], [30, 200, 60], [40, 40, 220], [240, 240, 240]])
MAGENTA = np.array([255, 0, 255])


@pytest.fixture(scope="module")
def ae():
    return load_autoencoder(WEIGHTS_DIR)[0]


def tiled_frames(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """`n` 64 x 64 frames of 8-px flat tiles in `COLOURS`, each at a random sub-tile offset, with
    a magenta blob (a sprite: not flat) over its centre; (frames, offsets)."""
    rng = np.random.default_rng(seed)
    frames = np.empty((n, 64, 64, 3), np.uint8)
    offsets = rng.integers(0, 8, size=(n, 2))
    for i, (ox, oy) in enumerate(offsets):
        tiles = COLOURS[rng.integers(0, len(COLOURS), size=(10, 10))]
        frames[i] = np.repeat(np.repeat(tiles, 8, 0), 8, 1)[oy : oy + 64, ox : ox + 64]
        frames[i, 29:35, 29:35] = MAGENTA
    return frames, offsets


def test_the_fit_recovers_the_flat_colours_of_frames(ae):
    frames, offsets = tiled_frames(12)
    colours = flat_colours(ae, frames, offsets)
    assert len(colours) > 8 * len(frames)  # most of each frame's cells count
    near = np.abs(colours[:, None] - COLOURS[None]).max(-1).min(-1)
    assert near.max() < 1  # every counted cell is one tile's colour: none mixes two tiles ...
    assert np.abs(colours - MAGENTA).max(-1).min() > 50  # ... or holds part of the sprite
    assert fit_codebook(colours, len(COLOURS)) == sorted(COLOURS.tolist())
    # Offsets that put the cells across the tiles: cells mix two colours and are not counted.
    shifted = flat_colours(ae, frames, (offsets + 4) % 8)
    assert len(shifted) < len(colours) / 4


def noisy_clusters(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Points around 5 well-separated RGB centres (2 levels of noise), unevenly many of each."""
    centres = np.array([[40, 86, 170], [62, 134, 50], [92, 82, 78], [216, 196, 122], [222, 40, 36]], float)
    rng = np.random.default_rng(seed)
    label = rng.choice(5, size=3000, p=[0.4, 0.3, 0.15, 0.1, 0.05])
    return centres[label] + rng.normal(0, 2, size=(3000, 3)), centres


def test_kmeans_finds_separated_clusters_the_same_way_for_a_seed():
    points, centres = noisy_clusters()
    got, inertia = kmeans(points, 5, seed=7)
    again, inertia_again = kmeans(points, 5, seed=7)
    assert np.array_equal(got, again) and inertia == inertia_again
    order = np.lexsort(got.T[::-1])
    assert np.abs(got[order] - centres).max() < 0.5 and 10 < inertia < 14  # 3 x 2^2: the noise alone
    book = fit_codebook(points, 5, seed=7)
    assert book == fit_codebook(points, 5, seed=7) == fit_codebook(points, 5, seed=8)
    assert book == np.rint(centres).astype(int).tolist()
    assert choose_k(points) == 5  # the smallest k that covers the cells
    with pytest.raises(ValueError, match="into 9 clusters"):
        kmeans(points[:8], 9)


def test_fewer_colours_than_entries_are_the_codebook():
    colours = np.array([[10, 20, 30], [10, 20, 30], [200, 100, 0]], float)
    assert fit_codebook(colours, 8) == [[10, 20, 30], [200, 100, 0]]
    with pytest.raises(ValueError, match=r"\(M, 3\) colours"):
        fit_codebook(np.zeros((0, 3)), 8)


def test_the_codebook_round_trips_and_an_older_palette_is_read_as_it():
    cfg = FastAEConfig.from_dict({**ae_config(tiled=True, sprite=True).to_dict(), "codebook": [[1, 2, 3]]})
    data = cfg.to_dict()
    assert data["codebook"] == [[1, 2, 3]] and "palette" not in data
    assert FastAEConfig.from_dict(data) == cfg
    old = {k: v for k, v in data.items() if k != "codebook"} | {"palette": [[1, 2, 3]]}
    assert FastAEConfig.from_dict(old) == cfg
    assert ae_config(tiled=True, sprite=True).codebook == []  # fit by the `ae` stage, not copied
    shipped = json.loads((WEIGHTS_DIR / "vae" / "config.json").read_text())
    assert "palette" not in shipped and len(shipped["codebook"]) == 8


def test_the_command_fits_a_directorys_codebook(tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(WEIGHTS_DIR / "vae", model / "vae")
    config = json.loads((model / "vae" / "config.json").read_text())
    shipped = config.pop("codebook")
    (model / "vae" / "config.json").write_text(json.dumps({**config, "palette": [[0, 0, 0]]}))
    assert main(["--model", str(model), "--episodes", "2", "--frames", "8", "--threads", "1"]) == 0
    written = json.loads((model / "vae" / "config.json").read_text())
    assert "palette" not in written and {k: v for k, v in written.items() if k != "codebook"} == config
    assert 2 <= len(written["codebook"]) <= 8
    assert all(c in shipped for c in written["codebook"])  # the colours these frames' tiles hold
    assert "codebook written" in capsys.readouterr().out


def test_a_resumed_run_keeps_its_codebook_and_reads_an_older_palette(tmp_path):
    from models.tiny_world.training.config import TrainConfig
    from models.tiny_world.training.trainer import Trainer, save_checkpoint

    cfg = TrainConfig(motion_steps=0, terrain_steps=0, ae_creatures=False, sf_creature_start=False)
    run = Trainer(cfg, tmp_path, None, progress=False)
    run.ae.cfg.codebook = [[1, 2, 3], [200, 100, 0]]
    run.stage = "dit"  # the `ae` stage fit it
    run.checkpoint()
    again = Trainer(cfg, tmp_path, None, progress=False)
    assert again.ae.cfg.codebook == []
    again.resume()
    assert again.ae.cfg.codebook == [[1, 2, 3], [200, 100, 0]]
    # A checkpoint written before the rename holds the copied palette under its old name.
    state = torch.load(run.ckpt_path, weights_only=False)
    state["ae_cfg"]["palette"] = state["ae_cfg"].pop("codebook")
    save_checkpoint(run.ckpt_path, state)
    old = Trainer(cfg, tmp_path, None, progress=False)
    old.resume()
    assert old.ae.cfg.codebook == [[1, 2, 3], [200, 100, 0]]
