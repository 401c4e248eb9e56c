"""Streaming decode with a kept feature cache == diffusers' whole-clip AutoencoderKLWan.decode."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLWan

from models.vae import WanStreamingVAE, to_uint8


@pytest.fixture(scope="module")
def vae() -> AutoencoderKLWan:
    torch.manual_seed(0)
    return AutoencoderKLWan(
        base_dim=8,
        z_dim=4,
        dim_mult=[1, 2, 2],
        num_res_blocks=1,
        temperal_downsample=[False, True],
        latents_mean=[0.1, -0.2, 0.3, 0.0],
        latents_std=[1.5, 0.5, 2.0, 1.0],
        scale_factor_temporal=2,
        scale_factor_spatial=4,
    ).eval()


@torch.no_grad()
@pytest.mark.parametrize("splits", [[1, 1, 1, 1, 1, 1], [3, 3], [1, 2, 3], [6]])
def test_streaming_decode_equals_whole_decode(vae, splits):
    stream = WanStreamingVAE(vae)
    z = torch.randn(4, sum(splits), 8, 8)
    raw = z[None] * stream.std + stream.mean  # the VAE's own latent space
    whole = vae.decode(raw).sample[0]
    cache = stream.init_cache()
    parts, start = [], 0
    for n in splits:
        video, cache = stream.decode_float(z[:, start : start + n], cache)
        parts.append(video)
        start += n
    got = torch.cat(parts, dim=1)
    assert got.shape == whole.shape == (3, 1 + 2 * (sum(splits) - 1), 32, 32)
    assert (got - whole).abs().max().item() <= 1e-5


@torch.no_grad()
def test_decode_leaves_the_given_cache_untouched(vae):
    stream = WanStreamingVAE(vae)
    z = torch.randn(4, 4, 8, 8)
    _, cache = stream.decode_float(z[:, :2], stream.init_cache())
    snapshot = [f.clone() if isinstance(f, torch.Tensor) else f for f in cache.feats]
    a, _ = stream.decode(z[:, 2:], cache)
    b, _ = stream.decode(z[:, 2:], cache)  # same cache again: same frames
    assert torch.equal(a, b)
    for old, now in zip(snapshot, cache.feats, strict=True):
        assert torch.equal(old, now) if isinstance(old, torch.Tensor) else old == now
    assert a.dtype == torch.uint8 and a.shape == (4, 32, 32, 3)


@torch.no_grad()
def test_encode_then_decode_shapes(vae):
    stream = WanStreamingVAE(vae)
    frame = np.random.default_rng(0).integers(0, 256, (1, 32, 32, 3), dtype=np.uint8)
    z = stream.encode(frame)
    assert z.shape == (4, 1, 8, 8)
    frames, cache = stream.decode(z, stream.init_cache())
    assert frames.shape == (1, 32, 32, 3) and cache.frames == 1


def test_to_uint8_range():
    v = torch.tensor([-2.0, -1.0, 0.0, 1.0, 3.0]).view(1, 5, 1, 1).expand(3, 5, 1, 1)
    assert to_uint8(v)[:, 0, 0, 0].tolist() == [0, 0, 128, 255, 255]
