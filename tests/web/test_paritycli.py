"""`worldserve parity`: a JSON summary under tolerance for the converted golden directories
(Self-Forcing, Matrix-Game 2.0), a non-zero exit for a tampered golden, and a clear refusal for a
golden the model cannot replay."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import save_file

from runtime.parity import load_golden
from tests.fixtures.golden import GOLDEN
from tests.fixtures.golden.served import write_longlive_dir, write_matrix_game_dir, write_self_forcing_dir
from web.cli import main

SF = GOLDEN / "self_forcing_rollout.safetensors"
MG = GOLDEN / "matrix_game_gta_drive_rollout.safetensors"


@pytest.fixture(scope="module")
def sf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_self_forcing_dir(tmp_path_factory.mktemp("sf"))


@pytest.fixture(scope="module")
def mg_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_matrix_game_dir(tmp_path_factory.mktemp("mg"), "gta_drive")


def _tampered(tmp_path: Path, src: Path, name: str, index: tuple[int, ...], delta: float) -> Path:
    golden = load_golden(src)
    golden.tensors[name] = golden.tensors[name].clone()
    golden.tensors[name][index] += delta
    bad = tmp_path / "tampered.safetensors"
    save_file(golden.tensors, str(bad), metadata={k: json.dumps(v) for k, v in golden.meta.items()})
    return bad


def test_parity_passes_and_prints_a_json_summary(sf_dir: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "parity.json"
    assert main(["parity", "--model", str(sf_dir), "--golden", str(SF), "--json", str(out)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    assert summary["pass"] and summary["max_abs_diff"] < 1e-4 and summary["compared"] == 85
    assert summary["family"] == "self-forcing" and set(summary["groups"]) >= {"block", "ctx", "latents", "x0"}
    assert any(line.startswith("latents ") for line in lines)
    assert json.loads(out.read_text()) == summary


def test_a_tampered_golden_exits_non_zero(sf_dir: Path, tmp_path: Path, capsys) -> None:
    bad = _tampered(tmp_path, SF, "latents", (0, 0, 4, 1, 1), 0.01)
    assert main(["parity", "--model", str(sf_dir), "--golden", str(bad)]) == 1
    out = capsys.readouterr().out
    summary = json.loads(out.strip().splitlines()[-1])
    assert not summary["pass"] and summary["worst"] == "latents"
    assert "latents" in out and "ABOVE TOLERANCE" in out


def test_matrix_game_parity_passes(mg_dir: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "parity.json"
    assert main(["parity", "--model", str(mg_dir), "--golden", str(MG), "--json", str(out)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    assert summary["pass"] and summary["max_abs_diff"] < 1e-4 and summary["compared"] == 67
    assert summary["family"] == "matrix-game-2" and not summary["not_produced"]
    assert set(summary["groups"]) == {"input", "t", "flow", "x0", "block", "ctx", "latents"}
    assert json.loads(out.read_text()) == summary


def test_a_tampered_matrix_game_golden_exits_non_zero(mg_dir: Path, tmp_path: Path, capsys) -> None:
    bad = _tampered(tmp_path, MG, "x0.c1.s2", (0, 3, 2, 1, 1), 0.01)
    assert main(["parity", "--model", str(mg_dir), "--golden", str(bad)]) == 1
    out = capsys.readouterr().out
    summary = json.loads(out.strip().splitlines()[-1])
    assert not summary["pass"] and summary["worst"] == "x0.c1.s2"
    assert "ABOVE TOLERANCE" in out


def test_a_golden_the_model_cannot_replay_is_a_clear_error(sf_dir: Path, capsys) -> None:
    assert main(["parity", "--model", str(sf_dir), "--golden", str(MG)]) == 2
    assert "is image-conditioned, model" in capsys.readouterr().err


def test_longlive_switching_parity_passes(tmp_path: Path, capsys) -> None:
    ll = write_longlive_dir(tmp_path)
    golden = GOLDEN / "longlive_rollout.safetensors"
    assert main(["parity", "--model", str(ll), "--golden", str(golden)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["pass"] and summary["family"] == "longlive" and summary["compared"] == 169
