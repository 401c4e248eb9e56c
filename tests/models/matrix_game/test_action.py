"""models/matrix_game/action.py against the original Matrix-Game 2.0 action module (golden fixtures)."""

import pytest
import torch

from models.matrix_game.action import MGActionConfig, MGActionModule, window_actions
from tests.fixtures.golden import load_golden

UNUSED_NORMS = ("img_attn_q_norm", "img_attn_k_norm", "key_attn_q_norm", "key_attn_k_norm")


def _module(variant: str) -> tuple[MGActionModule, dict, dict]:
    weights, meta = load_golden(f"matrix_game_{variant}_tiny")
    cfg = meta["config"]
    module = MGActionModule(MGActionConfig.from_original(cfg["action_config"], cfg["local_attn_size"]))
    prefix = "model.blocks.0.action_model."
    state = {
        k[len(prefix) :]: v
        for k, v in weights.items()
        if k.startswith(prefix) and k[len(prefix) :].split(".")[0] not in UNUSED_NORMS
    }
    module.load_state_dict(state, strict=True)
    rollout, rmeta = load_golden(f"matrix_game_{variant}_rollout")
    return module, rollout, rmeta


@pytest.mark.parametrize("variant", ["universal", "templerun", "gta_drive"])
def test_reproduces_the_original_over_a_rollout(variant: str) -> None:
    """Every call of block 0's action module in the original 3-chunk rollout (3-4 denoising steps
    and the context pass per chunk, the caches rolling past the 6-frame window) within 1e-4."""
    module, g, meta = _module(variant)
    roll = meta["rollout"]
    h, w = roll["latent_hw"]
    n = roll["num_frame_per_block"]
    steps = len(roll["denoising_step_list"])
    cache = module.new_cache()
    worst = 0.0
    for chunk in range(roll["chunks"]):
        start = chunk * n
        raw = 1 + 4 * (start + n - 1)
        for tag in [f"s{i}" for i in range(steps)] + ["ctx"]:
            x = g[f"action0.in.c{chunk}.{tag}"]
            with torch.no_grad():
                out = module(
                    x,
                    (n, h // 2, w // 2),
                    start,
                    cache,
                    keyboard=g["keyboard"][:, :raw],
                    mouse=g["mouse"][:, :raw] if "mouse" in g else None,
                )
            want = g[f"action0.out.c{chunk}.{tag}"]
            assert (want - x).abs().max() > 1e-2  # the module does something at this call
            worst = max(worst, (out - want).abs().max().item())
    assert worst < 1e-4, worst
    assert len(cache.keyboard) <= module.cfg.local_attn_size


def test_last_raw_action_has_no_effect_and_windows_pad_with_frame_zero() -> None:
    raw = torch.arange(13.0).view(1, 13, 1)  # latent frames 0..3
    win = window_actions(raw, 1, 3, 4, 3)
    assert win.shape == (1, 3, 12, 1)
    assert win[0, 0, :, 0].tolist() == [0.0] * 8 + [0.0, 1.0, 2.0, 3.0]  # frame 1: raw -8..3
    assert win[0, 2, :, 0].tolist() == [float(i) for i in range(12)]  # frame 3: raw 0..11, not 12
    with pytest.raises(ValueError, match="raw frames"):
        window_actions(raw[:, :5], 1, 3, 4, 3)


def test_cache_keeps_only_the_window() -> None:
    module, _g, _ = _module("universal")
    cache = module.new_cache()
    x = torch.randn(1, 3 * 6, 64)
    acts = torch.zeros(1, 1 + 4 * 11, 4), torch.zeros(1, 1 + 4 * 11, 2)
    for start in (0, 3, 6, 9):
        module(x, (3, 2, 3), start, cache, *acts)
    assert sorted(cache.keyboard) == list(range(6, 12)) and sorted(cache.mouse) == list(range(6, 12))


def test_config_rejects_sizes_the_rope_cannot_take() -> None:
    with pytest.raises(ValueError, match="heads_num"):
        MGActionConfig(keyboard_hidden_dim=100, heads_num=2, mouse_hidden_dim=128)
