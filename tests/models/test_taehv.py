"""TAEHV: the real taew2_1 key/shape table loads strictly, bad state dicts are named, streaming
decode == whole-clip decode, sessions batch, and a world decodes through the engine with it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from models.registry import build_world, load_state, load_taehv, tiny_random_configs
from models.taehv import TAEHV, TAEHVConfig, TAEHVDecoder, TGrow, TPool
from models.world import Conditioning
from runtime.engine import Engine
from tests.runtime.conftest import committed, keys

# taew2_1.safetensors, key for key: read from madebyollin/taehv `taehv.py` at commit 1f14a56 (the
# TAEHV class with its defaults: encoder/decoder `nn.Sequential` indices, MemBlock
# `conv.{0,2,4}`, TPool/TGrow `conv` 1x1 without bias, stride-2 encoder convs without bias).
MEMBLOCKS = {  # prefix -> width (3x3 convs: 2w -> w, w -> w, w -> w, each with a bias)
    **{f"encoder.{i}": 64 for i in (4, 5, 6, 9, 10, 11, 14, 15, 16)},
    **{f"decoder.{i}": 256 for i in (3, 4, 5)},
    **{f"decoder.{i}": 128 for i in (9, 10, 11)},
    **{f"decoder.{i}": 64 for i in (15, 16, 17)},
}
OTHER_KEYS = {
    "encoder.0.weight": (64, 3, 3, 3),
    "encoder.0.bias": (64,),
    "encoder.2.conv.weight": (64, 128, 1, 1),  # TPool stride 2
    "encoder.3.weight": (64, 64, 3, 3),
    "encoder.7.conv.weight": (64, 128, 1, 1),  # TPool stride 2
    "encoder.8.weight": (64, 64, 3, 3),
    "encoder.12.conv.weight": (64, 64, 1, 1),  # TPool stride 1
    "encoder.13.weight": (64, 64, 3, 3),
    "encoder.17.weight": (16, 64, 3, 3),
    "encoder.17.bias": (16,),
    "decoder.1.weight": (256, 16, 3, 3),
    "decoder.1.bias": (256,),
    "decoder.7.conv.weight": (256, 256, 1, 1),  # TGrow stride 1
    "decoder.8.weight": (128, 256, 3, 3),
    "decoder.13.conv.weight": (256, 128, 1, 1),  # TGrow stride 2
    "decoder.14.weight": (64, 128, 3, 3),
    "decoder.19.conv.weight": (128, 64, 1, 1),  # TGrow stride 2
    "decoder.20.weight": (64, 64, 3, 3),
    "decoder.22.weight": (3, 64, 3, 3),
    "decoder.22.bias": (3,),
}


def real_key_table() -> dict[str, tuple[int, ...]]:
    table = dict(OTHER_KEYS)
    for prefix, w in MEMBLOCKS.items():
        table |= {
            f"{prefix}.conv.0.weight": (w, 2 * w, 3, 3),
            f"{prefix}.conv.0.bias": (w,),
            f"{prefix}.conv.2.weight": (w, w, 3, 3),
            f"{prefix}.conv.2.bias": (w,),
            f"{prefix}.conv.4.weight": (w, w, 3, 3),
            f"{prefix}.conv.4.bias": (w,),
        }
    return table


def synthetic_state(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=gen) * 0.05 for k, s in real_key_table().items()}


# A small TAEHV of the same structure: 8 latent channels, 2 video frames per latent frame.
TINY = TAEHVConfig(
    latent_channels=8,
    enc_width=8,
    enc_time_down=(True, False, False),
    dec_widths=(16, 8, 8, 8),
    dec_time_up=(False, False, True),
    blocks=2,
)


@pytest.fixture(scope="module")
def tiny() -> TAEHVDecoder:
    torch.manual_seed(0)
    model = TAEHV(TINY)
    with torch.no_grad():  # larger weights than the default init, so frames are not all mid-grey
        for p in model.parameters():
            p.mul_(2.0)
    return TAEHVDecoder(model)


# -- weights --------------------------------------------------------------------------------------


def test_the_real_key_table_loads_strictly(tmp_path: Path):
    table = real_key_table()
    assert len(table) == 128 and sum(int(np.prod(s)) for s in table.values()) == 11_315_539
    state = synthetic_state()
    path = tmp_path / "taew2_1.safetensors"
    save_file(state, str(path))
    dec = load_taehv(path)  # the taew2_1 config by default
    own = dec.model.state_dict()
    assert own.keys() == state.keys()
    assert all(torch.equal(own[k], state[k]) for k in state)
    assert dec.layout.frames_per_latent == 4 and dec.layout.first_is_single and dec.spatial == 8
    frames, cache = dec.decode(torch.randn(16, 2, 4, 4), dec.init_cache())
    assert frames.shape == (1 + 4, 32, 32, 3) and frames.dtype == torch.uint8 and cache.frames == 2


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (lambda s: s.pop("decoder.13.conv.weight"), "decoder.13.conv.weight"),
        (lambda s: s.__setitem__("decoder.6.conv.weight", torch.zeros(1)), "decoder.6.conv.weight"),
        (
            lambda s: s.__setitem__("decoder.19.conv.weight", torch.zeros(64, 64, 1, 1)),
            "decoder.19.conv.weight",
        ),
    ],
    ids=["missing", "unexpected", "mis-shaped"],
)
def test_a_bad_state_dict_is_refused_naming_the_key(tmp_path: Path, edit, named):
    state = synthetic_state()
    edit(state)
    path = tmp_path / "bad.safetensors"
    save_file(state, str(path))
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        load_state(TAEHV(TAEHVConfig()), path)


def test_missing_weights_file_is_a_clear_error(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="no TAEHV weights"):
        load_taehv(tmp_path / "nope.safetensors")


def test_time_layers_keep_the_reference_frame_order():
    # TPool: frames t*s .. t*s+s-1 sit side by side in channels, oldest first
    pool = TPool(1, 2)
    with torch.no_grad():
        pool.conv.weight.copy_(torch.tensor([1.0, 0.0]).view(1, 2, 1, 1))  # keep the older frame
    x = torch.arange(4.0).view(1, 4, 1, 1, 1)  # frames 0, 1, 2, 3
    assert pool(x).flatten().tolist() == [0.0, 2.0]
    # TGrow: channel block j of frame t becomes frame t*s + j
    grow = TGrow(1, 2)
    with torch.no_grad():
        grow.conv.weight.copy_(torch.tensor([1.0, 10.0]).view(2, 1, 1, 1))
    assert grow(torch.tensor([1.0, 2.0]).view(1, 2, 1, 1, 1)).flatten().tolist() == [1.0, 10.0, 2.0, 20.0]


# -- streaming ------------------------------------------------------------------------------------


@torch.no_grad()
@pytest.mark.parametrize("splits", [[1, 1, 1, 1, 1], [2, 3], [1, 4], [3, 2]])
def test_streaming_decode_equals_whole_clip(tiny: TAEHVDecoder, splits):
    # fp32: chunked vs whole differ only by conv batch sizes; stated bound 1e-5 on [-1, 1] pixels
    z = torch.randn(8, sum(splits), 4, 6)
    whole, _ = tiny.decode_float(z, tiny.init_cache())
    assert whole.shape == (3, 1 + 2 * (sum(splits) - 1), 32, 48)
    assert whole.std() > 0.05  # not a constant picture
    cache, parts, start = tiny.init_cache(), [], 0
    for n in splits:
        video, cache = tiny.decode_float(z[:, start : start + n], cache)
        parts.append(video)
        start += n
    assert (torch.cat(parts, dim=1) - whole).abs().max().item() <= 1e-5
    assert cache.frames == sum(splits)


@torch.no_grad()
def test_the_history_matters_and_the_given_cache_is_untouched(tiny: TAEHVDecoder):
    z = torch.randn(8, 4, 4, 4)
    _, cache = tiny.decode_float(z[:, :2], tiny.init_cache())
    snapshot = [f.clone() for f in cache.feats]
    a, _ = tiny.decode(z[:, 2:], cache)
    b, _ = tiny.decode(z[:, 2:], cache)  # same cache again: same frames
    assert torch.equal(a, b) and a.shape == (4, 32, 32, 3)
    assert all(torch.equal(x, y) for x, y in zip(snapshot, cache.feats, strict=True))
    _, other = tiny.decode_float(-z[:, :2], tiny.init_cache())
    c, _ = tiny.decode(z[:, 2:], other)  # same latents, another history
    assert not torch.equal(a, c)


@torch.no_grad()
def test_batched_decode_equals_per_session(tiny: TAEHVDecoder):
    gen = torch.Generator().manual_seed(1)
    history = [torch.randn(8, k, 4, 4, generator=gen) for k in (0, 1, 3, 2)]
    caches = [tiny.init_cache()]
    for h in history[1:]:
        caches.append(tiny.decode_float(h, tiny.init_cache())[1])
    chunks = [torch.randn(8, n, 4, 4, generator=gen) for n in (2, 2, 2, 1)]  # one with another n
    videos, new = tiny.decode_float_batch(chunks, caches)  # one forward for the three n=2 sessions
    for b, (z, c) in enumerate(zip(chunks, caches, strict=True)):
        solo_video, solo_cache = tiny.decode_float(z, c)
        assert videos[b].shape == solo_video.shape
        assert (videos[b] - solo_video).abs().max() <= 1e-5  # fp32, conv over a bigger batch
        assert new[b].frames == solo_cache.frames
        for x, y in zip(new[b].feats, solo_cache.feats, strict=True):
            assert x.shape == y.shape and (x - y).abs().max() <= 1e-5
    assert [v.shape[1] for v in videos] == [3, 4, 4, 2]
    frames, _ = tiny.decode_batch(chunks, caches)
    for f, v in zip(frames, videos, strict=True):
        assert f.dtype == torch.uint8 and f.shape == (v.shape[1], 32, 32, 3)


@torch.no_grad()
def test_encode_shapes(tiny: TAEHVDecoder):
    frames = np.random.default_rng(0).integers(0, 256, (5, 32, 48, 3), dtype=np.uint8)
    assert tiny.encode(frames).shape == (8, 3, 4, 6)  # 5 frames padded to 6, 2 per latent
    assert tiny.encode(frames[:1]).shape == (8, 1, 4, 6)


def test_config_round_trip_and_validation():
    assert TAEHVConfig.from_dict(TINY.to_dict()) == TINY
    assert TAEHVConfig.from_name("taew2_1") == TAEHVConfig()
    with pytest.raises(ValueError, match="time"):
        TAEHVConfig(enc_time_down=(True, False, False))
    with pytest.raises(ValueError, match="unknown TAEHV config"):
        TAEHVConfig.from_name("taew9")


# -- through the engine ---------------------------------------------------------------------------


def test_a_world_with_the_taehv_decoder_runs_through_the_engine():
    world_cfg, dit, _ = tiny_random_configs()
    world = build_world(replace(world_cfg, id="taehv"), dit, TINY, seed=0, decoder="taehv")
    engine = Engine({"taehv": world})
    engine.add_stream("s", "taehv", Conditioning(seed=3))
    shapes = [committed(engine, "s", keys(k)).frames.shape for k in ("w", "d", "a")]
    # 2 latent frames a chunk; the stream's first latent frame is one video frame
    assert shapes == [(3, 64, 64, 3), (4, 64, 64, 3), (4, 64, 64, 3)]
    assert engine.runner.streams["s"].state.decoder.frames == 6
