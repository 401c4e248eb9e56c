"""Matrix-Game 2.0 conversion: the three published variants map strictly at full size, and the
converted tiny golden checkpoint's action module reproduces the original."""

import json

import pytest

from models.convert import matrix_game
from models.convert.keymap import ConversionError
from models.mg_action import MGActionModule
from tests.fixtures.golden import GOLDEN, load_golden


def _table(name: str) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v) for k, v in json.loads((GOLDEN / "original_keys.json").read_text())[name].items()}


@pytest.mark.parametrize("variant", ["universal", "gta_drive", "templerun"])
def test_published_variants_map_strictly(variant: str) -> None:
    table = _table(f"matrix_game_2_{variant}")
    assert matrix_game.check_shapes(table) == variant  # detected from the shapes, then checked
    ignored = [k for k in table if k.endswith("_norm.weight") and ".action_model." in k]
    assert len(ignored) == 15 * (4 if variant != "templerun" else 2)


def test_published_configs_match_upstream_files_via_the_fixture() -> None:
    # the fixture's tables come from the original config.json files; a wrong constant here breaks them
    for variant in ("universal", "gta_drive", "templerun"):
        table = _table(f"matrix_game_2_{variant}")
        cfg = matrix_game.PUBLISHED[variant]
        assert table["model.patch_embedding.weight"] == (cfg["dim"], cfg["in_dim"], 1, 2, 2)
        kb = cfg["action_config"]["keyboard_dim_in"]
        assert table["model.blocks.14.action_model.keyboard_embed.0.weight"] == (128, kb)
        assert "model.blocks.15.action_model.keyboard_embed.0.weight" not in table


def test_wrong_variant_config_is_rejected_with_the_keys() -> None:
    with pytest.raises(ConversionError, match=r"keyboard_embed\.0\.weight"):
        matrix_game.check_shapes(_table("matrix_game_2_gta_drive"), matrix_game.PUBLISHED["universal"])


@pytest.mark.parametrize("variant", ["universal", "templerun"])
def test_converted_tiny_checkpoint_loads_the_action_module(variant: str) -> None:
    _w, meta = load_golden(f"matrix_game_{variant}_tiny")
    state, name, cfg = matrix_game.convert(GOLDEN / f"matrix_game_{variant}_tiny.safetensors", meta["config"])
    assert name == "custom" and "condition_embedder.image_embedder.ff.net.0.proj.weight" in state
    module = MGActionModule(matrix_game.action_config(cfg))
    prefix = "blocks.0.action_model."
    module.load_state_dict(
        {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}, strict=True
    )
    g, _rmeta = load_golden(f"matrix_game_{variant}_rollout")
    cache = module.new_cache()
    x = g["action0.in.c0.s0"]
    out = module(x, (3, 2, 3), 0, cache, g["keyboard"][:, :9], g["mouse"][:, :9] if "mouse" in g else None)
    assert (out - g["action0.out.c0.s0"]).abs().max() < 1e-4
