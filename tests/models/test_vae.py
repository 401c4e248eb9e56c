"""Streaming decode with a kept feature cache == diffusers' whole-clip AutoencoderKLWan.decode;
a batch of sessions decodes as each session alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLWan

from models.tiny_world.fast_decoder import FastAEConfig, FastAutoencoder, FastStreamingDecoder
from models.vae import WanStreamingVAE, decode_batch, to_uint8


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


@torch.no_grad()
def test_batched_decode_equals_per_session(vae):
    stream = WanStreamingVAE(vae)
    gen = torch.Generator().manual_seed(3)
    # sessions at every cache phase: fresh, after 1 latent frame ("Rep" entries), after 3 (twice)
    caches = [stream.init_cache()]
    for k in (1, 3, 3):
        caches.append(stream.decode_float(torch.randn(4, k, 8, 8, generator=gen), stream.init_cache())[1])
    chunks = [torch.randn(4, 2, 8, 8, generator=gen) for _ in caches]
    snapshot = [[f.clone() if isinstance(f, torch.Tensor) else f for f in c.feats] for c in caches]
    videos, new = stream.decode_float_batch(chunks, caches)
    for b, (z, c) in enumerate(zip(chunks, caches, strict=True)):
        solo_video, solo_cache = stream.decode_float(z, c)
        assert videos[b].shape == solo_video.shape
        assert (videos[b] - solo_video).abs().max().item() <= 1e-5  # fp32, conv over a bigger batch
        assert new[b].frames == solo_cache.frames
        for x, y in zip(new[b].feats, solo_cache.feats, strict=True):
            if isinstance(y, torch.Tensor):
                assert x.shape == y.shape and (x - y).abs().max().item() <= 1e-5
            else:
                assert x == y
    assert [v.shape[1] for v in videos] == [3, 4, 4, 4]
    for old, c in zip(snapshot, caches, strict=True):  # the caches passed in are untouched
        for x, y in zip(old, c.feats, strict=True):
            assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
    # the next chunk from the batch's caches goes on exactly like a solo stream
    z = torch.randn(4, 1, 8, 8, generator=gen)
    (after_batch,), _ = stream.decode_float_batch([z], [new[2]])
    after_solo, _ = stream.decode_float(z, stream.decode_float(chunks[2], caches[2])[1])
    assert (after_batch - after_solo).abs().max().item() <= 1e-5


@torch.no_grad()
def test_decode_batch_takes_a_batch_tensor_and_loops_other_decoders(vae):
    stream = WanStreamingVAE(vae)
    z = torch.randn(2, 4, 2, 8, 8)
    frames, new = decode_batch(stream, z, [stream.init_cache()] * 2)
    assert [f.shape for f in frames] == [(3, 32, 32, 3)] * 2 and [c.frames for c in new] == [2, 2]
    assert (frames[1].int() - stream.decode(z[1], stream.init_cache())[0].int()).abs().max() <= 1
    fast = FastStreamingDecoder(
        FastAutoencoder(
            FastAEConfig(
                latent_channels=4, spatial=2, enc_channels=(4, 4), dec_channels=(4, 4), dec_up_blocks=(0,)
            )
        )
    )
    frames, new = decode_batch(fast, z, [fast.init_cache()] * 2)
    assert torch.equal(frames[0], fast.decode(z[0], fast.init_cache())[0]) and new[1].frames == 2
    with pytest.raises(ValueError, match="3 latent chunks for 2 caches"):
        decode_batch(stream, torch.randn(3, 4, 1, 8, 8), [stream.init_cache()] * 2)
