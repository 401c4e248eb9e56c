"""The self-forced phases' motion weights: `--sf-phase-weight` weighs the view's phase channels
(the motion) in the flow loss, and the log keeps their unweighted loss so runs compare;
`--sf-stop-weight` weighs the chunks in which a held key starts to be blocked (`stop_onsets`,
`stop_chunks`), the few that teach walls; `--sf-blocked` starts clips pressed against a wall
(`blocked_starts`), `--sf-off-centre` where the player stands off the view's centre."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from models.game import GameConfig, simulate
from models.registry import load_world
from models.tiny_world import ae_config, view_channels
from models.tiny_world.data import action_rows, sim_cameras
from models.tiny_world.train import main
from models.tiny_world.training.clips import blocked_starts, stop_chunks, stop_onsets
from tests.models.tiny_world.test_train_cli import train_tiny

TILED = ("--ae-tiled", "true", "--ae-sprite", "true", "--episode-frames", "16", "--sf-sprite-jitter", "2")


def test_the_phase_channels_weigh_as_set_in_the_sf_loss(tmp_path: Path):
    """Two runs alike up to the weight compute the same first sf step, so their logged losses
    differ by exactly the phase channels' extra share: (w - 1) * 4 / 15 of their loss."""
    plain = train_tiny(tmp_path / "plain", *TILED)
    heavy = train_tiny(tmp_path / "heavy", *TILED, "--sf-phase-weight", "9")
    cfg = ae_config(tiled=True, sprite=True)
    share = (cfg.phase_slice.stop - cfg.phase_slice.start) / cfg.latent_channels
    first, first_w = plain[0], heavy[0]
    assert first["phase_loss"] == pytest.approx(first_w["phase_loss"], rel=1e-5)
    assert first["phase_loss"] > 0
    assert first_w["loss"] - first["loss"] == pytest.approx(8 * share * first["phase_loss"], rel=1e-4)
    # The step after differs: the heavier weight moved the DiT another way.
    assert plain[1]["phase_loss"] != pytest.approx(heavy[1]["phase_loss"], rel=1e-6)


def wall_walk(seed: int, script: list[frozenset[str]]) -> tuple[torch.Tensor, ...]:
    """One episode of the game under `script`: action rows, cameras, players (1, N+1, ...)."""
    cfg = GameConfig()
    sim = simulate(seed, script, cfg)
    rows = action_rows(script)
    return tuple(torch.from_numpy(np.asarray(x))[None] for x in (rows, sim_cameras(sim, cfg), sim.player_pos))


def test_a_stop_onset_is_the_first_frame_a_held_key_is_blocked():
    """Walking into a wall (the eval's first wall probe: `d` from spawn in world 1_005_004 stops
    after 9 frames), then letting go and pressing again: the onsets are the first blocked frame
    and the first frame of the press again; walking freely and standing idle have none."""
    walk, rest = [frozenset("d")] * 16, [frozenset()] * 3
    rows, cams, players = wall_walk(1_005_004, walk + rest + [frozenset("d")] * 3)
    world_x = (cams + players)[0, :, 0]
    assert world_x[9] > world_x[8] and world_x[10] == world_x[9]  # moves 9 frames, then blocked
    assert stop_onsets(rows, cams, players)[0].nonzero().flatten().tolist() == [10, 20]
    free = wall_walk(1_005_004, [frozenset("a")] * 6 + rest)
    assert not stop_onsets(*free).any()


def test_blocked_starts_are_the_frames_pressed_against_a_wall():
    """The same walk: blocked from frame 10 while `d` is held (to frame 16), released for three
    frames, pressed again (blocked in frames 20-22). A clip may start where the press stays
    blocked into the next frame: frames 10-15 and 20-21, within the range asked for; the free
    walk and the rest are not among them."""
    walk, rest = [frozenset("d")] * 16, [frozenset()] * 3
    rows, cams, players = wall_walk(1_005_004, walk + rest + [frozenset("d")] * 3)
    assert blocked_starts(rows, cams, players, 0, 22).tolist() == [[0, f] for f in [*range(10, 16), 20, 21]]
    assert blocked_starts(rows, cams, players, 12, 20)[:, 1].tolist() == [12, 13, 14, 15, 20]
    free = wall_walk(1_005_004, [frozenset("a")] * 6 + rest)
    assert len(blocked_starts(*free, 0, 9)) == 0


def test_blocked_clips_train_from_the_cli_and_need_a_wall(tmp_path: Path):
    """World 13's random walk is pressed against a wall from frame 10: with every clip started
    there the log counts every clip as such, and the first step trains on other clips than a
    plain run's. Episodes too short to reach it are refused."""
    args = (*TILED, "--world-seed-base", "13", "--episodes", "1")
    plain = train_tiny(tmp_path / "plain", *args)
    walls = train_tiny(tmp_path / "walls", *args, "--sf-blocked", "1")
    assert [r["blocked_clips"] for r in walls] == [1.0, 1.0] and "blocked_clips" not in plain[0]
    assert walls[0]["loss"] != pytest.approx(plain[0]["loss"], rel=1e-4)
    with pytest.raises(SystemExit, match="pressed against a wall"):
        train_tiny(tmp_path / "short", *args, "--episode-frames", "8", "--sf-blocked", "1")


def test_off_centre_clips_train_from_the_cli_and_need_an_off_centre_player(tmp_path: Path):
    """World 13's random walk has the player off the view's centre (the camera stopped at the
    world's border): every clip starts there and the log says so. World 0's first 16 frames
    keep it centred, so asking for such clips there is refused rather than ignored."""
    args = (*TILED, "--episodes", "1", "--sf-off-centre", "1")
    rows = train_tiny(tmp_path / "border", *args, "--world-seed-base", "13")
    assert [r["off_centre_clips"] for r in rows] == [1.0, 1.0]
    with pytest.raises(SystemExit, match="off the view's centre"):
        train_tiny(tmp_path / "centred", *args, "--world-seed-base", "0")


def test_a_chunk_weighs_as_a_stop_when_any_of_its_frames_is_an_onset():
    onsets = torch.zeros(2, 21, dtype=torch.bool)
    onsets[0, 5] = onsets[1, 0] = onsets[1, 11] = True  # episode 1's frame 0 is never a noisy frame
    e = np.array([0, 1, 1])
    idx = np.array([0, 0, 3])[:, None] + np.arange(9)[None, :]  # start frame + 2 chunks of 4
    got = stop_chunks(onsets, e, idx, 4)
    assert got.tolist() == [[False, True], [False, False], [False, True]]


def test_the_stop_chunks_weigh_as_set_in_the_sf_loss(tmp_path: Path):
    """A run with stop chunks in its first sf batch computes another first loss with the weight
    (the weighted mean over the noisy latents), and logs the share of stop chunks. World 13's
    random walk starts to be blocked in frame 10: every 12-frame clip of its 17 holds it."""
    args = (*TILED, "--world-seed-base", "13", "--episodes", "2", "--sf-batch", "4", "--sf-clip-chunks", "3")
    plain = train_tiny(tmp_path / "plain", *args)
    heavy = train_tiny(tmp_path / "heavy", *args, "--sf-stop-weight", "50")
    assert heavy[0]["stop_chunks"] > 0 and "stop_chunks" not in plain[0]
    assert heavy[0]["loss"] != pytest.approx(plain[0]["loss"], rel=1e-4)
    assert heavy[0]["phase_loss"] == pytest.approx(plain[0]["phase_loss"], rel=1e-5)  # the same step


def test_the_motion_weights_are_positive_and_the_phase_weight_needs_tile_aligned_latents(tmp_path: Path):
    with pytest.raises(SystemExit, match="tile-aligned latents"):
        train_tiny(tmp_path / "a", "--sf-phase-weight", "4")
    with pytest.raises(SystemExit, match="loss weights > 0"):
        train_tiny(tmp_path / "b", *TILED, "--sf-stop-weight", "0")


def test_the_third_phase_trains_sf2s_settings_with_the_phase_weight(tmp_path: Path):
    """`sf3` follows `sf2` from its EMA and computes exactly what `--init-from` the sf2 phase's
    export does with sf2's settings and the phase weight as the sf stage's (how its shipped
    weights were made: model card, AU)."""
    three = train_tiny(
        tmp_path / "three", *TILED, "--sf2-steps", "2", "--sf3-steps", "2", "--sf3-phase-weight", "9"
    )
    log = [json.loads(line) for line in (tmp_path / "three" / "train_log.jsonl").read_text().splitlines()]
    trained = [(r["stage"], r["step"]) for r in log if "loss" in r and r["stage"].startswith("sf")]
    assert trained == [("sf", 1), ("sf", 2), ("sf2", 1), ("sf2", 2), ("sf3", 1), ("sf3", 2)]
    assert len(three) == 2
    assert load_world(tmp_path / "three" / "model").plugin.settings.carry_channels == view_channels()

    train_tiny(tmp_path / "two", *TILED, "--sf2-steps", "2", "--sf3-steps", "0")
    again = train_tiny(
        tmp_path / "again",
        *(*TILED, "--init-from", str(tmp_path / "two" / "model"), "--sf2-steps", "0"),
        *("--sf-view-start", "true", "--sf-jitter-centred", "true", "--sf-phase-weight", "9"),
    )
    sf3 = [r for r in log if r["stage"] == "sf3" and "loss" in r]
    assert [r["loss"] for r in again] == [r["loss"] for r in sf3]
    assert [r["phase_loss"] for r in again] == [r["phase_loss"] for r in sf3]


def test_no_phase_runs_after_one_of_no_steps(tmp_path: Path):
    """Each self-forced phase continues the one before it: `--sf-steps 0` trains none of them,
    `--sf2-steps 0` neither sf2 nor sf3, whatever their own steps say."""
    train_tiny(tmp_path / "none", *TILED, "--sf-steps", "0", "--sf2-steps", "2", "--sf3-steps", "2")
    log = [json.loads(line) for line in (tmp_path / "none" / "train_log.jsonl").read_text().splitlines()]
    assert {r["stage"] for r in log if "loss" in r} == {"ae", "dit"}
    assert load_world(tmp_path / "none" / "model").plugin.settings.carry_channels == ()
    train_tiny(tmp_path / "one", *TILED, "--sf3-steps", "2")  # TINY: --sf2-steps 0
    log = [json.loads(line) for line in (tmp_path / "one" / "train_log.jsonl").read_text().splitlines()]
    assert [r["stage"] for r in log if "loss" in r][-1] == "sf"


def test_a_run_checkpointed_before_the_third_phase_resumes_without_it(tmp_path: Path):
    out = tmp_path / "run"
    train_tiny(out, *TILED, "--sf2-steps", "2", "--minutes", "0")
    state = torch.load(out / "ckpt.pt", weights_only=False)
    del state["config"]["sf3_steps"], state["config"]["sf3_phase_weight"]
    torch.save(state, out / "ckpt.pt")  # as written before `sf3` existed (AS's run)
    n = torch.get_num_threads()
    try:
        assert main(["--out", str(out), "--resume", "--no-progress", "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(n)
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["stage"] for r in log if "loss" in r][-1] == "sf2"
