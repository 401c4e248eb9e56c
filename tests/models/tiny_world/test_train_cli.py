"""The training CLI runs end to end on a tiny budget, stops at a time limit with a checkpoint,
and --resume finishes the run and exports a loadable model directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from models.registry import load_world
from models.tiny_world.creatures import main as add_creature_head
from models.tiny_world.train import main
from models.world import Conditioning
from runtime.engine import Engine
from tests.runtime.conftest import committed, keys

TINY = [
    "--episodes", "2", "--episode-frames", "12", "--ae-steps", "3", "--ae-batch", "2",
    "--dit-steps", "3", "--dit-batch", "1", "--clip-chunks", "1", "--warmup", "1",
    "--ckpt-every", "100", "--log-every", "1", "--no-progress", "--threads", "1",
    "--sf-steps", "2", "--sf-batch", "1", "--sf-clip-chunks", "1",
    # plain latents and a blurred-history sf stage (L's recipe): small and quick; tests of the
    # tile-aligned recipe (the defaults) pass its flags after these
    "--ae-tiled", "false", "--ae-sprite", "false", "--sf-blur", "0.5", "--sf-sprite-jitter", "0",
    "--sf2-steps", "0", "--motion-steps", "0", "--terrain-steps", "0",
    "--ae-creatures", "false", "--sf-creature-start", "false", "--creature-steps", "0",
]  # fmt: skip


def train_tiny(out: Path, *args: str) -> list[dict]:
    """Run the training CLI on the TINY budget plus `args` (torch's thread count restored after);
    returns the sf stage's logged steps."""
    n = torch.get_num_threads()
    try:
        assert main(["--out", str(out), *TINY, *args]) == 0
    finally:
        torch.set_num_threads(n)
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    return [r for r in log if r["stage"] == "sf" and "loss" in r]


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_train_stops_at_the_time_limit_and_resumes(tmp_path: Path, capsys):
    out = tmp_path / "run"
    assert main(["--out", str(out), "--seed", "3", "--minutes", "0", *TINY]) == 0
    assert "time limit" in capsys.readouterr().out
    state = torch.load(out / "ckpt.pt", weights_only=False)
    assert state["stage"] == "ae" and state["step"] == 1 and state["config"]["seed"] == 3
    assert not (out / "model").exists()

    with pytest.raises(SystemExit):  # an existing run needs --resume
        main(["--out", str(out), *TINY])
    assert main(["--out", str(out), "--resume", "--no-progress", "--threads", "1"]) == 0
    assert "done" in capsys.readouterr().out
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if r["stage"] == "ae"] == [1, 2, 3]
    assert [r["step"] for r in log if r["stage"] == "dit"] == [1, 2, 3]
    assert [r["step"] for r in log if r["stage"] == "sf"] == [1, 2]  # the default second stage
    assert (out / "blurred.safetensors").is_file()  # its blurred history
    assert json.loads((out / "train_summary.json").read_text())["config"]["seed"] == 3

    world = load_world(out / "model")
    assert world.config.id == "tiny-world" and world.config.image_start
    state = world.init_state(Conditioning(seed=5))  # the seed's start frame, encoded
    assert state.start_latents.shape == (8, 1, 8, 8)


def test_self_forced_stage_runs_after_the_dit_and_from_a_model_directory(tmp_path: Path, capsys):
    first = tmp_path / "run"
    sf_args = [
        "--sf-steps",
        "2",
        "--sf-batch",
        "2",
        "--sf-clip-chunks",
        "2",
        "--sf-p-self",
        "1",
        "--sf-mask",
        "true",
    ]
    assert main(["--out", str(first), *TINY, *sf_args]) == 0
    log = [json.loads(line) for line in (first / "train_log.jsonl").read_text().splitlines()]
    sf = [r for r in log if r["stage"] == "sf" and "loss" in r]
    assert [r["step"] for r in sf] == [1, 2]
    assert all(r["history_mse"] >= 0.0 for r in sf)
    assert all(0.0 < r["supervised"] <= 1.0 for r in sf)  # the masked loss ran
    assert torch.load(first / "ckpt.pt", weights_only=False)["config"]["sf_mask"] is True
    assert load_world(first / "model").config.id == "tiny-world"

    second = tmp_path / "finetune"  # a second stage from an exported model directory
    args = ["--out", str(second), "--init-from", str(first / "model"), *TINY, "--sf-steps", "1"]
    assert main([*args, "--sf-batch", "1", "--sf-clip-chunks", "1"]) == 0
    log = [json.loads(line) for line in (second / "train_log.jsonl").read_text().splitlines()]
    assert [r["stage"] for r in log if "loss" in r] == ["sf"]  # neither the AE nor the DiT retrained
    assert "done" in capsys.readouterr().out


def test_a_run_checkpointed_before_the_second_phase_resumes_without_it(tmp_path: Path, capsys):
    out = tmp_path / "run"
    assert main(["--out", str(out), "--minutes", "0", *TINY, "--sf2-steps", "0"]) == 0
    state = torch.load(out / "ckpt.pt", weights_only=False)
    del state["config"]["sf2_steps"], state["config"]["sf2_view_start"], state["config"]["sf2_jitter_centred"]
    torch.save(state, out / "ckpt.pt")  # as written before `sf2` existed
    assert main(["--out", str(out), "--resume", "--no-progress", "--threads", "1"]) == 0
    assert "done" in capsys.readouterr().out
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["stage"] for r in log if "loss" in r][-1] == "sf"  # no second phase appended
    assert load_world(out / "model").plugin.settings.carry_channels == ()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--sf-sprite-jitter", "4"], "need a sprite layer"),
        (
            ["--sf-sprite-jitter", "0", "--sf-view-start", "true"],
            "--sf-view-start needs tile-aligned latents",
        ),
        (
            ["--sf-sprite-jitter", "0", "--sf2-steps", "10", "--sf2-view-start", "true"],
            "--sf2-view-start needs tile-aligned latents",
        ),
    ],
)
def test_an_sf_stage_the_latents_cannot_serve_stops_before_any_training(flags, message, tmp_path: Path):
    # sf settings that need the tile-aligned recipe's latents, on plain ones: refused up front,
    # not after the autoencoder and the DiT have trained.
    with pytest.raises(SystemExit, match=message):
        main(
            [
                "--out",
                str(tmp_path / "run"),
                "--ae-tiled",
                "false",
                "--ae-sprite",
                "false",
                "--ae-creatures",
                "false",
                "--sf-creature-start",
                "false",
                "--motion-steps",
                "0",
                *flags,
            ]
        )
    assert not (tmp_path / "run" / "train_log.jsonl").exists()


def test_a_run_with_a_creature_layer_trains_and_serves_its_creatures(tmp_path: Path):
    """`--ae-creatures`: the autoencoder gets the creature layer (3 more channels, last), the DiT
    reads and writes them, its loss on them is logged, and with `--sf-creature-start` the served
    world carries them from the latest frame like the view's phase."""
    train_tiny(
        tmp_path / "run",
        "--ae-tiled", "true", "--ae-sprite", "true", "--ae-creatures", "true", "--sf-blur", "0",
        "--sf-creature-start", "true", "--sf-view-start", "true", "--creature-weight", "4",
    )  # fmt: skip
    log = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert any("creature_acc" in r for r in log if r["stage"] == "ae")
    assert any("creature_loss" in r for r in log if r["stage"] == "sf")
    world = load_world(tmp_path / "run" / "model")
    ae = world.decoder.ae
    assert ae.cfg.creatures and ae.cfg.creature_slice == slice(15, 18)
    assert world.transformer.cfg.in_channels == world.transformer.cfg.out_channels == 18
    assert world.plugin.settings.carry_channels == (8, 9, 10, 11, 15, 16, 17)


def test_a_run_with_creatures_a_motion_head_and_a_terrain_prior_trains_and_serves_a_creature_head(
    tmp_path: Path,
):
    """The `creatures` stage after the terrain prior: its figures are logged and the exported
    world walks its creatures with the head."""
    train_tiny(
        tmp_path / "run",
        "--ae-tiled", "true", "--ae-sprite", "true", "--ae-creatures", "true", "--sf-blur", "0",
        "--sf-creature-start", "true", "--sf-view-start", "true", "--motion-steps", "2",
        "--terrain-steps", "2", "--creature-steps", "2",
    )  # fmt: skip
    log = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    (record,) = [r for r in log if r["stage"] == "creatures"]
    assert {"frame_axes_exact", "entries_per_chunk", "creatures_by_class"} <= record.keys()
    world = load_world(tmp_path / "run" / "model")
    head = world.plugin.creatures
    assert head is not None and head.cfg.classes == len(world.decoder.ae.cfg.codebook)
    saved = torch.load(tmp_path / "run" / "ckpt.pt", weights_only=False)["creatures"]
    assert torch.equal(head.births, saved["births"])
    engine = Engine({"m": world})
    engine.add_stream("s", "m", Conditioning(seed=5))
    committed(engine, "s", keys("d"))
    assert engine.runner.streams["s"].state.plugin_state.trail is not None


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--ae-tiled", "false", "--ae-sprite", "false", "--ae-creatures", "true", "--motion-steps", "0"],
            "--ae-creatures need",
        ),
        (
            ["--ae-creatures", "false", "--sf-creature-start", "true"],
            "--sf-creature-start needs a creature layer",
        ),
        (["--ae-creatures", "true", "--creature-weight", "0"], "--creature-weight"),
    ],
)
def test_creature_settings_that_cannot_work_are_refused_up_front(flags, message, tmp_path: Path):
    with pytest.raises(SystemExit, match=message):
        main(["--out", str(tmp_path / "run"), *flags])
    assert not (tmp_path / "run" / "train_log.jsonl").exists()


def test_init_from_a_model_without_creatures_tunes_the_layer_in_and_keeps_the_rest(tmp_path: Path):
    """`--init-from DIR --ae-creatures true`: the `ae` stage trains the creature layer and the cell
    encoder only (the cell decoder, phase and sprite parts, statistics and codebook stay, so the
    latents keep their meaning), then the `sf` stage; the DiT and the motion head come out widened."""
    tiled = ["--ae-tiled", "true", "--ae-sprite", "true", "--sf-blur", "0", "--sf-view-start", "true"]
    train_tiny(tmp_path / "run", *tiled, "--motion-steps", "2")
    before = load_world(tmp_path / "run" / "model")
    assert not before.decoder.ae.cfg.creatures and before.plugin.motion is not None
    train_tiny(
        tmp_path / "tuned",
        *tiled,
        "--init-from", str(tmp_path / "run" / "model"), "--ae-creatures", "true",
        "--sf-creature-start", "true", "--motion-steps", "0",
    )  # fmt: skip
    log = [json.loads(line) for line in (tmp_path / "tuned" / "train_log.jsonl").read_text().splitlines()]
    assert any(r.get("add_creatures") for r in log)
    assert [r["stage"] for r in log if "loss" in r] == ["ae"] * 3 + ["sf"] * 2  # no dit stage
    after = load_world(tmp_path / "tuned" / "model")
    old, new = before.decoder.ae, after.decoder.ae
    assert new.cfg.creatures and new.cfg.codebook == old.cfg.codebook
    torch.testing.assert_close(new.latents_mean[:15], old.latents_mean)
    torch.testing.assert_close(new.latents_std[:15], old.latents_std)
    for part in ("decoder", "phase", "sprite_net", "sprite_decoder"):
        kept = getattr(old, part).state_dict()
        for name, value in getattr(new, part).state_dict().items():
            assert torch.equal(value, kept[name]), f"{part}.{name} changed"
    assert not torch.equal(new.encoder.net[0].weight, old.encoder.net[0].weight)  # the encoder learned
    assert after.transformer.cfg.in_channels == 18
    head = after.plugin.motion.state_dict()["convs.0.weight"]
    assert head.shape[1] == 20 and not head[:, 15:18].any()  # the widened head reads no creature
    assert after.plugin.settings.carry_channels == (8, 9, 10, 11, 15, 16, 17)


def test_adding_creatures_without_an_sf_stage_is_refused(tmp_path: Path):
    # Without a self-forced stage the widened DiT would be served without its channels carried.
    train_tiny(tmp_path / "run", "--ae-tiled", "true", "--ae-sprite", "true", "--sf-blur", "0")
    with pytest.raises(SystemExit, match="--sf-steps must be > 0"):
        train_tiny(
            tmp_path / "tuned",
            "--ae-tiled", "true", "--ae-sprite", "true", "--sf-blur", "0", "--sf-steps", "0",
            "--init-from", str(tmp_path / "run" / "model"), "--ae-creatures", "true",
        )  # fmt: skip


def test_adding_a_creature_head_to_a_model_without_a_creature_layer_is_refused(tmp_path: Path):
    train_tiny(tmp_path / "run", "--ae-tiled", "true", "--ae-sprite", "true", "--sf-blur", "0")
    with pytest.raises(SystemExit, match="no creature layer"):
        add_creature_head(["--model", str(tmp_path / "run" / "model"), "--no-progress"])
    assert not (tmp_path / "run" / "model" / "creatures").exists()
