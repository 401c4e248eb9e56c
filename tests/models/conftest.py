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
