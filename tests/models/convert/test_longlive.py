"""`worldserve convert --from longlive`: the LoRA merged as peft applies it (W + alpha/rank B A),
every LoRA key checked, the window / sink / re-cache recorded in worldserve.json, and the CLI end to
end on the tiny golden checkpoints (whose served parity is tests/runtime/test_prompt_switch.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from models.convert import longlive
from models.convert.keymap import ConversionError
from models.convert.output import convert_sources
from models.registry import load_world
from tests.fixtures.golden import GOLDEN
from tests.fixtures.golden.served import longlive_config, write_longlive_dir
from web.cli import main

BASE, LORA = GOLDEN / "longlive_tiny_base.pt", GOLDEN / "longlive_tiny_lora.pt"


def _lora(module: str, a: torch.Tensor, b: torch.Tensor) -> dict[str, torch.Tensor]:
    p = f"base_model.model.{module}"
    return {f"{p}.lora_A.weight": a, f"{p}.lora_B.weight": b}


def test_merge_is_w_plus_alpha_over_rank_b_a() -> None:
    g = torch.Generator().manual_seed(0)
    w, a, b = torch.randn(6, 5, generator=g), torch.randn(2, 5, generator=g), torch.randn(6, 2, generator=g)
    state = {"model.blocks.0.ffn.0.weight": w, "model.blocks.0.ffn.0.bias": torch.zeros(6)}
    merged = longlive.merge_lora(state, _lora("blocks.0.ffn.0", a, b), alpha=8)
    torch.testing.assert_close(merged["model.blocks.0.ffn.0.weight"], w + 4 * b @ a)
    assert merged["model.blocks.0.ffn.0.bias"] is state["model.blocks.0.ffn.0.bias"]
    assert state["model.blocks.0.ffn.0.weight"] is w  # the input is not changed


@pytest.mark.parametrize(
    ("lora", "message"),
    [
        ({"base_model.model.blocks.0.q.lora_A.weight": torch.zeros(2, 5)}, "has no lora_B"),
        (_lora("blocks.9.q", torch.zeros(2, 5), torch.zeros(6, 2)), "does not have"),
        (_lora("blocks.0.ffn.0", torch.zeros(2, 4), torch.zeros(6, 2)), "do not fit"),
        ({"blocks.0.q.weight": torch.zeros(1)}, "not a peft"),
    ],
)
def test_a_bad_lora_is_refused(lora: dict, message: str) -> None:
    state = {"model.blocks.0.ffn.0.weight": torch.zeros(6, 5)}
    with pytest.raises(ConversionError, match=message):
        longlive.merge_lora(state, lora, alpha=1)


def test_the_directory_records_window_sink_and_recache(tmp_path: Path) -> None:
    out = write_longlive_dir(tmp_path)
    meta = json.loads((out / "worldserve.json").read_text())
    assert meta["family"] == "longlive" and meta["requires"] == ["text_prompts"]
    inf = meta["inference"]
    assert (inf["local_attn_size"], inf["sink_size"], inf["global_sink"]) == (9, 3, True)
    assert inf["prompt_switch"] == "recache" and inf["adapter"]["alpha"] == 8
    assert meta["world"]["prompt_switch"] == "recache"
    tcfg = meta["transformer"]
    assert (tcfg["window_frames"], tcfg["sink_frames"], tcfg["chunk_frames"]) == (6, 3, 3)
    world = load_world(out)
    assert world.config.text_prompts and world.transformer.cfg.keep_latents


def test_the_published_settings() -> None:
    cfg = longlive.model_config({})
    assert (cfg.sink_frames, cfg.window_frames, cfg.num_layers) == (3, 9, 30)  # 12 frames, sinks included
    assert longlive.ADAPTER == {"rank": 256, "alpha": 256}


def test_a_lora_is_required_and_belongs_to_longlive_only() -> None:
    with pytest.raises(ConversionError, match="needs the LoRA"):
        convert_sources("longlive", [BASE], longlive_config())
    with pytest.raises(ConversionError, match="only belongs to --from longlive"):
        convert_sources("self-forcing", [BASE, LORA], longlive_config())


def test_cli_convert_from_longlive(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({k: v for k, v in longlive_config().items() if k != "vae"}))
    out = tmp_path / "ll"
    assert (
        main(["convert", "--from", "longlive", str(LORA), str(BASE), "--config", str(cfg), "--out", str(out)])
        == 0
    )
    said = capsys.readouterr().out
    assert "wrote longlive" in said and "serving it still needs: text_prompts, vae" in said
    sources = json.loads((out / "worldserve.json").read_text())["sources"]  # each file by its keys
    assert sorted(sources, key=lambda s: s["role"]) == [
        {"file": "longlive_tiny_lora.pt", "role": "lora"},
        {"file": "longlive_tiny_base.pt", "role": "transformer"},
    ]
