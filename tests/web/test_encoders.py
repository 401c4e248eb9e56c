"""web/encoders.py: H.264 / JPEG / raw encoders and the client-side decoders."""

import io

import av
import numpy as np
import pytest
from PIL import Image, JpegImagePlugin

from web import codec
from web import messages as m
from web.encoders import (
    NAL_IDR,
    NAL_PPS,
    NAL_SPS,
    ChunkDecoder,
    H264Decoder,
    H264Encoder,
    JpegEncoder,
    RawEncoder,
    codec_string_from_sps,
    decode_jpeg,
    h264_settings,
    jpeg_settings,
    make_encoder,
    nal_units,
)
from web.errors import MediaError

from .conftest import psnr, run, serving
from .world_frames import default_world_frames


def natural_frames(n: int, height: int, width: int) -> np.ndarray:
    """(n, H, W, 3) uint8: smooth gradients, a drifting texture and two moving soft-edged shapes.

    Edges are a few pixels soft, as in camera or VAE output; a hard saturated colour edge would
    measure 4:2:0 chroma subsampling (which every H.264 stream a browser decodes has), not the
    encoder.
    """
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    s = min(height, width)
    edge = max(4.0, s / 24)
    out = np.empty((n, height, width, 3), np.uint8)
    for t in range(n):
        img = np.stack(
            [
                60 + 120 * x / width + 20 * np.sin(t / 9),
                50 + 150 * y / height,
                128 + 50 * np.sin((x + y) / (0.1 * s) + t / 5),
            ],
            axis=-1,
        )
        cy, cx = height * (0.5 + 0.25 * np.sin(t / 7)), width * (0.2 + 0.6 * t / n)
        disc = np.clip((s / 6 - np.hypot(y - cy, x - cx)) / edge, 0, 1)[..., None]
        img = img * (1 - disc) + np.array([210, 190, 110]) * disc
        by, bx = height * 0.25, width * (0.8 - 0.5 * t / n)
        box = np.clip((s / 10 - np.abs(y - by)) / edge, 0, 1) * np.clip(
            (s / 10 - np.abs(x - bx)) / edge, 0, 1
        )
        img = img * (1 - box[..., None]) + np.array([50, 60, 130]) * box[..., None]
        out[t] = img.clip(0, 255).astype(np.uint8)
    return out


@pytest.fixture(scope="module")
def tiny_world_frames() -> np.ndarray:
    return default_world_frames()


def nal_types(unit: bytes) -> list[int]:
    return [nal[0] & 0x1F for nal in nal_units(unit)]


# -- H.264 --------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [64, 256])
def test_h264_round_trip_psnr(size: int) -> None:
    frames = natural_frames(32, size, size)
    encoded = H264Encoder(size, size, 30).encode(frames)
    assert len(encoded) == len(frames)  # one packet per frame
    decoder = H264Decoder()
    decoded = []
    for unit, _ in encoded:
        out = decoder.decode(unit)
        assert len(out) == 1  # no reordering delay: one frame out per unit in
        decoded.extend(out)
    assert all(frame.shape == (size, size, 3) and frame.dtype == np.uint8 for frame in decoded)
    assert min(psnr(a, b) for a, b in zip(frames, decoded, strict=True)) >= 35


def decode_all(encoder: H264Encoder, frames: np.ndarray) -> tuple[np.ndarray, int]:
    """``frames`` through ``encoder`` and a decoder told its scale: (decoded frames, bytes)."""
    units = [unit for unit, _ in encoder.encode(frames)]
    decoder = ChunkDecoder("h264", scale=encoder.scale)
    msg = m.Frames(chunk=1, frame0=0, count=len(units), codec="h264", key=True, data=units)
    return decoder.decode(msg), sum(len(unit) for unit in units)


def test_h264_keeps_the_default_worlds_pixel_art(tiny_world_frames: np.ndarray) -> None:
    # 4:2:0 chroma at 64x64 smears pixel-art colour edges (about 31 dB at CRF 18); the session
    # encoder codes an upscaled frame instead, at no more than twice the bytes.
    frames = tiny_world_frames
    assert frames.shape == (32, 64, 64, 3)
    old, old_bytes = decode_all(H264Encoder(64, 64, 16, crf=18), frames)  # the previous setting
    encoder = make_encoder("h264", 64, 64, 16)
    assert isinstance(encoder, H264Encoder)
    new, new_bytes = decode_all(encoder, frames)
    assert new.shape == frames.shape  # model-size frames out
    old_db = np.mean([psnr(a, b) for a, b in zip(frames, old, strict=True)])
    new_db = np.mean([psnr(a, b) for a, b in zip(frames, new, strict=True)])
    worst = min(psnr(a, b) for a, b in zip(frames, new, strict=True))
    assert old_db < 33 and new_db >= old_db + 10 and worst >= 35, (old_db, new_db, worst)
    assert new_bytes <= 2 * old_bytes, (new_bytes, old_bytes)
    assert encoder.info == m.CodecInfo(name="h264", codec="avc1.42c00a", scale=2)  # 128x128 coded


@pytest.mark.parametrize(("size", "scale"), [((64, 64), 2), ((32, 48), 4), ((128, 96), 2), ((256, 128), 1)])
def test_h264_settings_scale_small_worlds(size: tuple[int, int], scale: int) -> None:
    assert h264_settings(*size)[0] == scale
    encoder = make_encoder("h264", *size, 16)
    assert isinstance(encoder, H264Encoder) and encoder.scale == scale
    (unit, _), *_ = encoder.encode(np.zeros((1, size[1], size[0], 3), np.uint8))
    (frame,) = av.CodecContext.create("h264", "r").decode(av.Packet(unit))
    assert (frame.width, frame.height) == (size[0] * scale, size[1] * scale)


def test_h264_decoder_downscales_exactly() -> None:
    frames = np.random.default_rng(0).integers(0, 256, (2, 8, 8, 3), np.uint8)
    units = [unit for unit, _ in H264Encoder(8, 8, 16, crf=0, scale=2).encode(frames)]
    decoder = H264Decoder(scale=2)
    decoded = [frame for unit in units for frame in decoder.decode(unit)]
    assert [frame.shape for frame in decoded] == [(8, 8, 3)] * 2
    with pytest.raises(MediaError, match="scale"):
        H264Encoder(8, 8, 16, scale=3)


def test_h264_stream_starts_with_sps_pps_idr() -> None:
    encoded = H264Encoder(64, 64, 30).encode(natural_frames(5, 64, 64))
    first, key = encoded[0]
    assert key
    assert first.startswith(b"\x00\x00\x00\x01")  # Annex-B
    types = nal_types(first)
    assert types[:2] == [NAL_SPS, NAL_PPS] and NAL_IDR in types
    assert [key for _, key in encoded[1:]] == [False] * 4
    assert all(NAL_SPS not in nal_types(unit) for unit, _ in encoded[1:])


def test_h264_signals_its_colour_space() -> None:
    unit, _ = H264Encoder(64, 64, 30).encode(natural_frames(1, 64, 64))[0]
    (frame,) = av.CodecContext.create("h264", "r").decode(av.Packet(unit))
    assert (frame.colorspace, frame.color_range) == (6, 1)  # BT.601 (SMPTE 170M), limited range


def test_force_keyframe_gives_idr_with_parameter_sets() -> None:
    encoder = H264Encoder(64, 64, 30)
    frames = natural_frames(6, 64, 64)
    encoder.encode(frames[:3])
    encoder.force_keyframe()
    (unit, key), (_, next_key) = encoder.encode(frames[3:5])
    assert key and not next_key
    assert nal_types(unit)[:2] == [NAL_SPS, NAL_PPS] and NAL_IDR in nal_types(unit)
    assert encoder.encode_chunk(frames[5:]).key is False
    encoder.force_keyframe()
    assert encoder.encode_chunk(frames[5:]).key is True


def test_decoder_joins_at_a_later_keyframe() -> None:
    frames = natural_frames(20, 64, 64)
    encoder = H264Encoder(64, 64, 30)
    units = [unit for unit, _ in encoder.encode(frames[:12])]  # 8..11 get dropped for a slow client,
    encoder.force_keyframe()  # so the server forces an IDR for the next frame
    units += [unit for unit, _ in encoder.encode(frames[12:])]
    late = H264Decoder()  # e.g. a client that attached mid-stream
    assert late.decode(units[5]) == []  # a P-frame before any IDR is skipped
    kept = H264Decoder()  # a client that saw 0..7, missed 8..11
    assert len([frame for unit in units[:8] for frame in kept.decode(unit)]) == 8
    for decoder in (late, kept):
        decoded = [frame for unit in units[12:] for frame in decoder.decode(unit)]
        assert len(decoded) == 8
        assert min(psnr(a, b) for a, b in zip(frames[12:], decoded, strict=True)) >= 35


@pytest.mark.parametrize(
    ("width", "height", "expected"),
    [(64, 64, "avc1.42c00a"), (256, 256, "avc1.42c00d"), (640, 352, "avc1.42c01e")],
)
def test_codec_string(width: int, height: int, expected: str) -> None:
    # ultrafast = Constrained Baseline (profile 0x42, constraint_set0+1 = 0xc0); the level grows
    # with frame size and rate. Known before the first frame, and equal to the stream's SPS.
    encoder = H264Encoder(width, height, 30)
    assert encoder.codec_string == expected
    unit, _ = encoder.encode(np.zeros((1, height, width, 3), np.uint8))[0]
    sps = next(nal for nal in nal_units(unit) if nal[0] & 0x1F == NAL_SPS)
    assert codec_string_from_sps(sps) == encoder.codec_string == expected
    assert encoder.info == m.CodecInfo(name="h264", codec=expected, scale=1)


def test_bitstream_helpers_on_literals() -> None:
    stream = b"\x00\x00\x00\x01\x67\x64\x00\x1f\xac\x00\x00\x01\x68\xee\x3c\x80\x00\x00\x01\x65\x88\x84"
    assert nal_units(stream) == [b"\x67\x64\x00\x1f\xac", b"\x68\xee\x3c\x80", b"\x65\x88\x84"]
    assert codec_string_from_sps(b"\x67\x64\x00\x1f\xac") == "avc1.64001f"  # High, level 3.1
    with pytest.raises(MediaError):
        codec_string_from_sps(b"\x68\xee\x3c\x80")  # a PPS


@pytest.mark.parametrize(
    "frames",
    [
        np.zeros((1, 64, 32, 3), np.uint8),  # wrong size
        np.zeros((1, 64, 64, 4), np.uint8),
        np.zeros((64, 64, 3), np.uint8),  # one frame without the T axis
        np.zeros((1, 64, 64, 3), np.float32),
        np.zeros((0, 64, 64, 3), np.uint8),
    ],
)
def test_encoders_reject_bad_frames(frames: np.ndarray) -> None:
    with pytest.raises(MediaError):
        H264Encoder(64, 64, 30).encode(frames)
    if frames.shape[1:3] == (64, 64):
        with pytest.raises(MediaError):
            JpegEncoder().encode(frames)


def test_h264_rejects_odd_sizes() -> None:
    with pytest.raises(MediaError, match="even"):
        H264Encoder(63, 64, 30)


# -- JPEG and raw ----------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [64, 256])
def test_jpeg_round_trip(size: int) -> None:
    frames = natural_frames(4, size, size)
    encoded = JpegEncoder(quality=90).encode(frames)
    assert all(key for _, key in encoded)
    assert all(unit.startswith(b"\xff\xd8") for unit, _ in encoded)
    assert min(psnr(a, decode_jpeg(unit)) for a, (unit, _) in zip(frames, encoded, strict=True)) >= 30


def jpeg_round_trip(encoder: JpegEncoder, frames: np.ndarray) -> tuple[np.ndarray, int]:
    """``frames`` through ``encoder``, the wire and the SDK's decoder: (decoded frames, bytes)."""
    chunk = encoder.encode_chunk(frames)
    msg = m.Frames(chunk=1, frame0=0, count=len(frames), codec="jpeg", key=chunk.key, data=chunk.data)
    return ChunkDecoder("jpeg").decode(codec.parse_server(codec.encode(msg))), sum(map(len, chunk.data))


def test_jpeg_keeps_the_default_worlds_pixel_art(tiny_world_frames: np.ndarray) -> None:
    # 4:2:0 halves the colour resolution of 64x64 pixel art (about 28 dB at quality 90); the
    # session encoder keeps every pixel's colour (4:4:4) at the model's size.
    frames = tiny_world_frames
    old, old_bytes = jpeg_round_trip(JpegEncoder(90, "4:2:0"), frames)  # the previous setting
    encoder = make_encoder("jpeg", 64, 64, 16)
    assert isinstance(encoder, JpegEncoder)
    new, new_bytes = jpeg_round_trip(encoder, frames)
    assert new.shape == frames.shape  # model-size frames: nothing for a client to rescale
    old_db = np.mean([psnr(a, b) for a, b in zip(frames, old, strict=True)])
    worst = min(psnr(a, b) for a, b in zip(frames, new, strict=True))
    assert old_db < 33 and worst >= 40, (old_db, worst)
    assert new_bytes <= 2 * old_bytes, (new_bytes, old_bytes)
    assert encoder.info == m.CodecInfo(name="jpeg")  # ready.codec says nothing new


# Pillow's get_sampling: 0 is 4:4:4 (every pixel its own colour), 2 is 4:2:0.
@pytest.mark.parametrize(
    ("size", "quality", "sampling"),
    [((64, 64), 96, 0), ((32, 48), 96, 0), ((128, 96), 96, 0), ((256, 128), 90, 2)],
)
def test_jpeg_settings_keep_small_worlds_chroma(size: tuple[int, int], quality: int, sampling: int) -> None:
    encoder = make_encoder("jpeg", *size, 16)
    assert isinstance(encoder, JpegEncoder)
    assert (encoder.quality, encoder.subsampling) == jpeg_settings(*size) and encoder.quality == quality
    (unit, _), *_ = encoder.encode(np.zeros((1, size[1], size[0], 3), np.uint8))
    with Image.open(io.BytesIO(unit)) as image:
        assert image.size == size and JpegImagePlugin.get_sampling(image) == sampling


def test_jpeg_rejects_bad_settings() -> None:
    with pytest.raises(MediaError, match="quality"):
        JpegEncoder(101)
    with pytest.raises(MediaError, match="subsampling"):
        JpegEncoder(90, "4:2:2")  # type: ignore[arg-type]


def test_decode_jpeg_rejects_other_bytes() -> None:
    with pytest.raises(MediaError):
        decode_jpeg(b"not a jpeg")
    with pytest.raises(MediaError):
        decode_jpeg(b"\x89PNG\r\n\x1a\n" + b"\x00" * 32)


def test_raw_is_exact() -> None:
    frames = natural_frames(3, 16, 24)
    chunk = RawEncoder().encode_chunk(frames)
    assert chunk.key and np.array_equal(chunk.data, frames)


def test_make_encoder() -> None:
    assert isinstance(make_encoder("h264", 64, 64, 16), H264Encoder)
    assert isinstance(make_encoder("jpeg", 64, 64, 16), JpegEncoder)
    assert make_encoder("raw", 64, 64, 16).info == m.CodecInfo(name="raw")


# -- Through the wire: encoder -> frames message -> bytes -> ChunkDecoder ----------------------------


@pytest.mark.parametrize(("name", "min_psnr"), [("h264", 35.0), ("jpeg", 30.0), ("raw", None)])
def test_chunks_through_the_codec(name: m.Codec, min_psnr: float | None) -> None:
    frames = natural_frames(8, 64, 64)
    encoder = make_encoder(name, 64, 64, 16)
    decoder = ChunkDecoder(encoder.info.name, encoder.info.scale or 1)  # as a client reads `ready.codec`
    decoded = []
    for chunk_index, start in enumerate(range(0, 8, 4), start=1):
        chunk = encoder.encode_chunk(frames[start : start + 4])
        msg = m.Frames(chunk=chunk_index, frame0=start, count=4, codec=name, key=chunk.key, data=chunk.data)
        decoded.append(decoder.decode(codec.parse_server(codec.encode(msg))))
    out = np.concatenate(decoded)
    assert out.shape == frames.shape
    if min_psnr is None:
        assert np.array_equal(out, frames)
    else:
        assert min(psnr(a, b) for a, b in zip(frames, out, strict=True)) >= min_psnr


def test_sdk_receives_the_default_world_in_jpeg_at_40_db() -> None:
    # The whole path a JPEG client takes (the server's session encoder, the wire, the SDK's
    # decoder) against the same world's raw frames, stepped one session at a time.
    from models.registry import DEFAULT_MODEL, from_name
    from web.sdk import connect

    world = from_name(DEFAULT_MODEL)

    async def main() -> dict[str, np.ndarray]:
        got = {}
        async with serving({world.spec.id: world}, default_model=world.spec.id) as server:
            for name in ("raw", "jpeg"):
                async with connect(server.url, seed=5, mode="lockstep", codec=name) as s:
                    assert s.ready.codec.name == name
                    got[name] = np.concatenate([await s.step({"keys": [key]}) for key in "ddsa"])
        return got

    got = run(main())
    h, w = world.spec.height, world.spec.width
    assert got["jpeg"].shape == got["raw"].shape and got["raw"].shape[1:] == (h, w, 3)
    assert min(psnr(a, b) for a, b in zip(got["raw"], got["jpeg"], strict=True)) >= 40
