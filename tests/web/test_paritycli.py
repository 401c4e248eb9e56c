"""`worldserve parity`: a JSON summary under tolerance for the converted golden directory, a
non-zero exit for a tampered golden, and a clear refusal for goldens it cannot replay yet."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import save_file

from runtime.parity import load_golden
from tests.fixtures.golden import GOLDEN
from tests.fixtures.golden.served import write_self_forcing_dir
from web.cli import main

SF = GOLDEN / "self_forcing_rollout.safetensors"


@pytest.fixture(scope="module")
def sf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_self_forcing_dir(tmp_path_factory.mktemp("sf"))


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
    golden = load_golden(SF)
    golden.tensors["latents"] = golden.tensors["latents"].clone()
    golden.tensors["latents"][0, 0, 4, 1, 1] += 0.01
    bad = tmp_path / "tampered.safetensors"
    save_file(golden.tensors, str(bad), metadata={k: json.dumps(v) for k, v in golden.meta.items()})
    assert main(["parity", "--model", str(sf_dir), "--golden", str(bad)]) == 1
    out = capsys.readouterr().out
    summary = json.loads(out.strip().splitlines()[-1])
    assert not summary["pass"] and summary["worst"] == "latents"
    assert "latents" in out and "ABOVE TOLERANCE" in out


def test_unsupported_golden_is_a_clear_error(sf_dir: Path, capsys) -> None:
    mg = GOLDEN / "matrix_game_universal_rollout.safetensors"
    assert main(["parity", "--model", str(sf_dir), "--golden", str(mg)]) == 2
    assert "matrix-game-2 goldens are not supported yet" in capsys.readouterr().err
