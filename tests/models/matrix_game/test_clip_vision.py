"""models/matrix_game/clip_vision.py against the original Wan CLIP visual tower (golden fixture), and the
full-size checkpoint key table."""

import json

import pytest
import torch

from models.convert import clip
from models.convert.keymap import ConversionError
from models.matrix_game.clip_vision import CLIPVision, CLIPVisionConfig
from tests.fixtures.golden import GOLDEN, load_golden


def _tiny() -> tuple[CLIPVision, dict]:
    g, meta = load_golden("clip_vision_tiny")
    c = meta["config"]
    cfg = CLIPVisionConfig(
        image_size=c["image_size"],
        patch_size=c["patch_size"],
        dim=c["dim"],
        mlp_ratio=c["mlp_ratio"],
        num_heads=c["num_heads"],
        num_layers=c["num_layers"],
        out_dim=c["out_dim"],
        eps=c["norm_eps"],
    )
    model = CLIPVision(cfg).eval()
    model.load_state_dict(
        {k[len("visual.") :]: v for k, v in g.items() if k.startswith("visual.")}, strict=True
    )
    return model, g


def test_reproduces_the_original_tower_with_preprocessing() -> None:
    model, g = _tiny()
    out = model.encode(g["input"][:, :, 0])  # (B, 3, 1, H, W) video -> one frame
    assert out.shape == g["output"].shape == (1, 5, 64)
    assert (out - g["output"]).abs().max() < 1e-4


def test_last_block_is_not_run() -> None:
    model, g = _tiny()
    with torch.no_grad():
        model.transformer[-1].mlp[2].weight.add_(1.0)  # changing the last block changes nothing
    assert (model.encode(g["input"][:, :, 0]) - g["output"]).abs().max() < 1e-4


def test_full_checkpoint_maps_strictly() -> None:
    table = json.loads((GOLDEN / "original_keys.json").read_text())["clip_xlm_roberta_vit_h_14"]
    table = {k: tuple(v) for k, v in table.items()}
    clip.check_shapes(table)
    assert CLIPVisionConfig().tokens == 257
    del table["visual.pos_embedding"]
    with pytest.raises(ConversionError, match="missing 1: pos_embedding"):
        clip.check_shapes(table)


def test_convert_reads_a_checkpoint_and_drops_the_text_tower(tmp_path) -> None:
    from safetensors.torch import save_file

    model, g = _tiny()
    src = tmp_path / "clip.safetensors"
    tensors = {k: v for k, v in g.items() if k.startswith("visual.")}
    save_file(
        tensors | {"textual.token_embedding.weight": torch.zeros(4, 2), "log_scale": torch.zeros(())},
        str(src),
    )
    state = clip.convert(src, model.cfg)
    assert state.keys() == model.state_dict().keys()
    assert torch.equal(state["pos_embedding"], g["visual.pos_embedding"])
