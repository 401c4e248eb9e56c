"""Small configs shared by the model tests (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch

from models.causal_wan import ActionConfig, CausalWan, CausalWanConfig


def tiny_config(**overrides) -> CausalWanConfig:
    """A 2-layer, 2-head Wan with 4 latent channels."""
    base = dict(
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=4,
        out_channels=4,
        text_dim=8,
        freq_dim=16,
        ffn_dim=32,
        num_layers=2,
        chunk_frames=2,
        window_frames=16,
    )
    base.update(overrides)
    return CausalWanConfig(**base)


def tiny_actions(**overrides) -> ActionConfig:
    """An action module on the first block: 3 keys, mouse, a 2-vector, 2 video frames per latent."""
    base = dict(
        keys=("w", "a", "d"),
        mouse=True,
        vector_dim=2,
        frames_per_latent=2,
        blocks=1,
        key_dim=8,
        motion_dim=8,
        heads=2,
    )
    base.update(overrides)
    return ActionConfig(**base)


@pytest.fixture
def make_model():
    """Build a seeded CausalWan in eval mode."""

    def make(cfg: CausalWanConfig, seed: int = 0) -> CausalWan:
        torch.manual_seed(seed)
        return CausalWan(cfg).eval()

    return make


def tiny_mg_config(**overrides) -> CausalWanConfig:
    """An I2V Wan (4 noise + 4 conditioning channels, 16-wide image tokens) with Matrix-Game's
    action module in block 0: 3 keys + mouse, 2 heads of 64, 4 raw frames per latent frame."""
    from models.causal_wan import ActionConfig
    from models.matrix_game.action import MGActionConfig

    mg = MGActionConfig(
        keyboard_dim_in=3,
        hidden_size=8,
        img_hidden_size=64,
        keyboard_hidden_dim=128,
        mouse_hidden_dim=128,
        heads_num=2,
        local_attn_size=5,
        blocks=(0,),
    )
    action = ActionConfig(
        kind="matrix-game", matrix_game=mg.to_dict(), keys=("w", "a", "d"), frames_per_latent=4, blocks=1
    )
    base = dict(
        attention_head_dim=32,
        in_channels=8,
        out_channels=4,
        image_dim=16,
        null_text_len=3,
        window_frames=5,
        cond_frames=8,
        action=action,
    )
    return tiny_config(**(base | overrides))
