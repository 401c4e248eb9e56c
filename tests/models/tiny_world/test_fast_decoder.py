"""The fast streaming autoencoder: chunked decode == whole decode, the cache is never mutated,
shapes follow the frame layout (per-frame latents and a Wan-like 4x temporal layout)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from models.tiny_world.fast_decoder import FastAEConfig, FastAutoencoder, FastStreamingDecoder

SMALL = dict(enc_channels=(4, 8, 8), dec_channels=(8, 8, 4), dec_up_blocks=(1, 0), spatial=4)


def make(**overrides) -> FastStreamingDecoder:
    torch.manual_seed(0)
    cfg = FastAEConfig(**{**SMALL, "latent_channels": 4, **overrides})
    ae = FastAutoencoder(cfg)
    for p in ae.parameters():  # zero-initialised residual convs would hide temporal mistakes
        p.data.normal_(0, 0.2)
    ae.set_normalisation(torch.tensor([0.1, -0.2, 0.3, 0.0]), torch.tensor([1.5, 0.5, 2.0, 1.0]))
    return FastStreamingDecoder(ae)


LAYOUTS = {
    "per-frame": dict(temporal=1, temporal_kernel=1),
    "kernel-3": dict(temporal=1, temporal_kernel=3),
    "wan-like": dict(temporal=4, first_is_single=True, temporal_kernel=2),
}


@torch.no_grad()
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("splits", [[1, 1, 1, 1, 1, 1], [3, 3], [1, 2, 3], [6]])
def test_streaming_decode_equals_whole_decode(layout, splits):
    dec = make(**LAYOUTS[layout])
    z = torch.randn(4, sum(splits), 6, 6)
    whole = dec.ae.decode_float(z[None])[0].clamp(-1, 1)
    cache = dec.init_cache()
    parts, start = [], 0
    for n in splits:
        video, cache = dec.decode_float(z[:, start : start + n], cache)
        parts.append(video)
        start += n
    got = torch.cat(parts, dim=1)
    tf = dec.ae.cfg.temporal
    expected_t = dec.layout.video_frames(0, sum(splits))
    assert got.shape == whole.shape == (3, expected_t, 24, 24)
    assert expected_t == (1 + (sum(splits) - 1) * tf if dec.layout.first_is_single else sum(splits) * tf)
    assert (got - whole).abs().max().item() <= 1e-4  # batch-size-dependent conv kernels differ by ~1e-5
    assert cache.frames == sum(splits)


@torch.no_grad()
@pytest.mark.parametrize("layout", LAYOUTS)
def test_decode_leaves_the_given_cache_untouched(layout):
    dec = make(**LAYOUTS[layout])
    z = torch.randn(4, 4, 6, 6)
    _, cache = dec.decode(z[:, :2], dec.init_cache())
    snapshot = [f.clone() for f in cache.feats]
    a, new = dec.decode(z[:, 2:], cache)
    b, _ = dec.decode(z[:, 2:], cache)  # same cache again: same frames
    assert torch.equal(a, b)
    assert cache.frames == 2 and new.frames == 4
    for old, now in zip(snapshot, cache.feats, strict=True):
        assert torch.equal(old, now)
    assert a.dtype == torch.uint8 and a.shape == (2 * dec.ae.cfg.temporal, 24, 24, 3)
    if dec.ae.cfg.temporal_kernel > 1:  # the history really matters
        c, _ = dec.decode(z[:, 2:], dec.init_cache())
        assert not torch.equal(a, c)


@torch.no_grad()
@pytest.mark.parametrize("layout", LAYOUTS)
def test_encode_shapes_and_round_trip_of_normalisation(layout):
    dec = make(**LAYOUTS[layout])
    tf = dec.ae.cfg.temporal
    n_frames = 1 + 2 * tf if dec.layout.first_is_single else 3 * tf
    frames = np.random.default_rng(0).integers(0, 256, size=(n_frames, 24, 24, 3), dtype=np.uint8)
    z = dec.encode(frames)
    assert z.shape == (4, 3, 6, 6)
    raw = dec.ae.encode_raw(torch.from_numpy(frames).float().div(127.5).sub(1).permute(3, 0, 1, 2)[None])
    assert torch.allclose(z * dec.ae.latents_std + dec.ae.latents_mean, raw[0], atol=1e-5)
    video, _ = dec.decode(z, dec.init_cache())
    assert video.shape == (n_frames, 24, 24, 3)


def test_config_round_trip_and_validation():
    cfg = FastAEConfig.wan_like()
    assert FastAEConfig.from_dict({"_class_name": "FastAutoencoder", **cfg.to_dict()}) == cfg
    assert cfg.layout.frames_per_latent == 4 and cfg.layout.first_is_single
    with pytest.raises(ValueError, match="power of two"):
        FastAEConfig(spatial=6)
    with pytest.raises(ValueError, match="widths"):
        FastAEConfig(spatial=4)
    with pytest.raises(ValueError, match="latents_mean"):
        dataclasses.replace(FastAEConfig(), latents_mean=[0.0])


@torch.no_grad()
@pytest.mark.parametrize("layout", LAYOUTS)
def test_batched_decode_equals_each_session_alone(layout):
    dec = make(**LAYOUTS[layout])
    gen = torch.Generator().manual_seed(1)
    caches = [dec.init_cache()]  # session 0 starts now; the others are mid-stream
    for n in (2, 3, 2):
        _, c = dec.decode(torch.randn(4, n, 6, 6, generator=gen), dec.init_cache())
        caches.append(c)
    z = [torch.randn(4, 2, 6, 6, generator=gen) for _ in caches]
    frames, new = dec.decode_batch(z, caches)
    for b in range(len(caches)):
        alone, cache = dec.decode(z[b], caches[b])
        assert frames[b].shape == alone.shape and frames[b].dtype == torch.uint8
        assert (frames[b].int() - alone.int()).abs().max().item() <= 1  # conv batch size: ~1e-5
        assert new[b].frames == cache.frames
        for x, y in zip(new[b].feats, cache.feats, strict=True):
            assert torch.allclose(x, y, atol=1e-6)
