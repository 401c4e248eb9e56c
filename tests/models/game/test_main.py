"""Tests for models/game/__main__.py: the CLI writes PNG frames and sim.npz."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from models.game import GameConfig, encode_actions, parse_action_script, simulate
from models.game.__main__ import main

ROOT = Path(__file__).resolve().parents[3]


def test_cli_writes_frames_and_npz(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = "d*4,a*2,,space"
    assert main(["--seed", "3", "--actions", script, "--size", "96", "--out", str(tmp_path)]) == 0
    actions = parse_action_script(script)
    expected = simulate(3, actions, GameConfig(size=96))
    pngs = sorted(tmp_path.glob("frame_*.png"))
    assert [p.name for p in pngs] == [f"frame_{i:05d}.png" for i in range(len(actions) + 1)]
    np.testing.assert_array_equal(np.asarray(Image.open(pngs[-1])), expected.frames[-1])
    with np.load(tmp_path / "sim.npz") as npz:
        np.testing.assert_array_equal(npz["frames"], expected.frames)
        np.testing.assert_array_equal(npz["player_pos"], expected.player_pos)
        np.testing.assert_array_equal(npz["actions"], encode_actions(actions))
        assert str(npz["script"]) == "d*4,a*2,,space" and int(npz["seed"]) == 3
    assert "sim.npz" in capsys.readouterr().out


def test_cli_reads_json_actions(tmp_path: Path) -> None:
    path = tmp_path / "moves.json"
    path.write_text(json.dumps([["d"], ["d", "w"], [], ["space"]]))
    out = tmp_path / "out"
    assert main(["--seed", "1", "--actions", str(path), "--out", str(out), "--no-png"]) == 0
    assert not list(out.glob("*.png"))
    with np.load(out / "sim.npz") as npz:
        assert npz["frames"].shape == (5, 64, 64, 3)
        assert str(npz["script"]) == "d,w+d,,space"


def test_cli_runs_as_a_module(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "models.game", "--seed", "2", "--random", "8", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert "wrote" in proc.stdout
    assert len(list(tmp_path.glob("frame_*.png"))) == 9
    bad = subprocess.run(
        [sys.executable, "-m", "models.game", "--seed", "2", "--actions", "d,q", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "unknown key" in bad.stderr
