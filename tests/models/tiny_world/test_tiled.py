"""The trainer with tile-aligned latents (`--ae-tiled true`): every episode frame, sharp and
blurred, is encoded at the phase of the game's camera, the phase net is trained, and the exported
model serves sessions through the engine on its 10x10 canvas grid."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from models.fast_decoder import read_phase
from models.registry import load_world
from models.tiny_world.data import action_rows
from models.tiny_world.train import rollout_history, tile_crossings
from models.world import Conditioning
from tests.models.tiny_world.test_teacher_forcing import serve_random_policy
from tests.models.tiny_world.test_train_cli import train_tiny


def test_tile_crossings_mark_the_frames_whose_view_enters_another_tile():
    x = torch.tensor([5.0, 6, 7, 8, 9, 8, 7, 7])  # right across the edge at 8, then back
    cams = torch.stack([x, torch.full_like(x, 3.0)], dim=-1)[None]
    assert tile_crossings(cams, 8)[0].tolist() == [False, False, True, False, False, True, False]
    down = torch.tensor([[[0.0, 15.0], [0.0, 16.0]]])
    assert tile_crossings(down, 8).tolist() == [[True]]


def test_tiled_run_encodes_at_the_cameras_phase_and_serves(tmp_path: Path):
    out = tmp_path / "run"
    sf = train_tiny(out, "--ae-tiled", "true", "--sf-wrap", "7")
    assert all("crossing_frames" in r for r in sf)
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert all("phase_acc" in r for r in log if r["stage"] == "ae" and "loss" in r)

    data = load_file(str(out / "latents.safetensors"))
    lat, cams = data["latents"].float(), data["cameras"]
    assert lat.shape == (2, 13, 12, 10, 10)
    world = load_world(out / "model")
    ae = world.decoder.ae
    raw = lat * ae.latents_std[:, 0] + ae.latents_mean[:, 0]  # (E, F, C, h, w)
    want = (cams.round().long() % 8).reshape(-1, 2)
    assert torch.equal(read_phase(raw.reshape(-1, 12, 10, 10)[:, 8:], 8), want)
    blurred = load_file(str(out / "blurred.safetensors"))["latents"].float()
    raw_b = blurred * ae.latents_std[:, 0] + ae.latents_mean[:, 0]
    assert torch.equal(read_phase(raw_b.reshape(-1, 12, 10, 10)[:, 8:], 8), want)

    assert world.latent_shape == (12, 10, 10)
    seed, n_chunks, chunk = 1_000_321, 3, world.chunk_frames
    served, script = serve_random_policy(world, seed, n_chunks)
    assert served.shape == (1 + n_chunks * chunk, 64, 64, 3)
    assert np.ptp(served) > 0

    # The session snaps every generated chunk's phase before it becomes history; the trainer's
    # rollout does the same, and with the engine's noise it shows the session's frames.
    start = world.init_state(Conditioning(seed=seed)).start_latents
    x0 = torch.zeros(1, 12, 1 + n_chunks * chunk, 10, 10)
    x0[0, :, :1] = start
    actions = torch.from_numpy(action_rows(script))[None, :, None]
    noise = lambda j, k: world.noise(seed, j + 1, k, chunk)[None]  # noqa: E731
    sched, dit = world.config.schedule, world.transformer
    with torch.no_grad():
        snapped = rollout_history(
            dit, x0, actions, sched, torch.Generator(), noise, canonical=world.decoder.canonical
        )
        raw = rollout_history(dit, x0, actions, sched, torch.Generator(), noise)
    mine, _ = world.decoder.decode(snapped[0], world.decoder.init_cache())
    assert np.abs(mine.numpy().astype(int) - served.astype(int)).max() <= 1
    assert not torch.allclose(
        snapped[:, :, 1 + chunk :], raw[:, :, 1 + chunk :]
    )  # the snap changed the history
