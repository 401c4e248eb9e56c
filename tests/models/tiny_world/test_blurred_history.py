"""Degraded history, as the model's own rollout leaves it: history frames after the start frame
blurred (`sf_blur`), predicted one chunk ahead (`sf_onestep`) or slowed (`sf_warp`), with the
game's sharp frames as targets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from models.tiny_world.train import main
from models.tiny_world.training.history import gaussian_blur
from tests.models.tiny_world.test_train_cli import TINY, train_tiny


def test_gaussian_blur_spreads_a_point_by_its_sigma_and_keeps_its_mass():
    x = torch.zeros(3, 3, 21, 21)
    x[:, :, 10, 10] = 1.0
    y = gaussian_blur(x, torch.tensor([0.0, 1.0, 2.0]))
    assert torch.equal(y[0], x[0])  # sigma 0: unchanged
    for i in (1, 2):
        torch.testing.assert_close(y[i].sum(), torch.tensor(3.0))
        xs = torch.arange(21.0) - 10
        var = (y[i, 0] * xs**2).sum() / y[i, 0].sum()
        assert abs(var.item() - float(i) ** 2) < 0.05 * i**2  # the spread is sigma^2 along x
        assert torch.allclose(y[i, 0], y[i, 0].T)  # separable: the same along y


def test_blurred_history_trains_from_the_cli_and_rebuilds_a_cache_made_otherwise(tmp_path: Path):
    sf = ["--sf-steps", "2", "--sf-batch", "2", "--sf-clip-chunks", "2", "--sf-p-self", "0", "--sf-blur", "1"]
    assert main(["--out", str(tmp_path / "a"), *TINY, *sf]) == 0
    blurred = load_file(str(tmp_path / "a" / "blurred.safetensors"))["latents"]
    sharp = load_file(str(tmp_path / "a" / "latents.safetensors"))["latents"]
    assert blurred.shape == sharp.shape and not torch.equal(blurred, sharp)
    log = [json.loads(line) for line in (tmp_path / "a" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if r["stage"] == "sf" and "loss" in r] == [1, 2]

    # Same data and autoencoder seed, colour jitter on: the cache from run a is not reused.
    (tmp_path / "b").mkdir()
    for name in ("latents.safetensors", "blurred.safetensors"):
        (tmp_path / "b" / name).write_bytes((tmp_path / "a" / name).read_bytes())
    assert main(["--out", str(tmp_path / "b"), *TINY, *sf, "--sf-jitter", "0.05"]) == 0
    jittered = load_file(str(tmp_path / "b" / "blurred.safetensors"))["latents"]
    assert jittered.shape == blurred.shape and not torch.equal(jittered, blurred)


@pytest.mark.parametrize("tiled", ["false", "true"])
def test_slowed_history_trains_only_the_last_chunk(tmp_path: Path, tiled: str):
    sf = ["--sf-steps", "2", "--sf-batch", "2", "--sf-clip-chunks", "2", "--sf-p-self", "0"]
    latents = ["--ae-tiled", tiled, "--ae-sprite", tiled]
    assert main(["--out", str(tmp_path), *TINY, *sf, *latents, "--sf-blur", "0", "--sf-warp", "1"]) == 0
    log = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    rows = [r for r in log if r["stage"] == "sf" and "loss" in r]
    assert [r["supervised"] for r in rows] == [0.5, 0.5]  # of two chunks, only the second is trained
    assert not (tmp_path / "blurred.safetensors").exists()  # no blur asked for


def test_one_step_history_trains_from_the_cli(tmp_path: Path):
    sf = ["--sf-steps", "2", "--sf-batch", "2", "--sf-clip-chunks", "2", "--sf-p-self", "0"]
    rows = train_tiny(tmp_path, *sf, "--sf-blur", "0", "--sf-onestep", "1")
    assert [r["step"] for r in rows] == [1, 2]
    assert (tmp_path / "model" / "worldserve.json").is_file()
