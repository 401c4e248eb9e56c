"""web/video.py: MP4 files, crisp for small worlds; `worldserve generate --video`."""

from pathlib import Path
from typing import get_args

import av
import numpy as np
import pytest

from models.registry import save_world
from web import cli
from web.errors import MediaError
from web.video import Mp4Settings, Mp4Writer, VideoStyle, mp4_settings
from web.yuv import yuv420_to_rgb

from .conftest import psnr
from .world_frames import default_world_frames


@pytest.mark.parametrize(
    ("style", "size", "expected"),
    [
        ("auto", (64, 64), Mp4Settings(4, "yuv420p", 18)),  # 256 px
        ("auto", (48, 32), Mp4Settings(8, "yuv420p", 18)),  # the shorter side to 256 px
        ("auto", (100, 100), Mp4Settings(4, "yuv420p", 18)),  # 2 would be 200 px; odd factors mix chroma
        ("auto", (128, 128), Mp4Settings(1, "yuv420p", 18)),  # large enough: as before
        ("auto", (640, 352), Mp4Settings(1, "yuv420p", 18)),
        ("upscale", (640, 352), Mp4Settings(2, "yuv420p", 18)),  # asked for: at least 2
        ("native", (64, 64), Mp4Settings(1, "yuv420p", 18)),
        ("yuv444", (64, 64), Mp4Settings(1, "yuv444p", 10)),
    ],
)
def test_mp4_settings(style: VideoStyle, size: tuple[int, int], expected: Mp4Settings) -> None:
    assert mp4_settings(style, *size) == expected


def test_unknown_style_is_a_media_error(tmp_path: Path) -> None:
    with pytest.raises(MediaError, match="video style"):
        Mp4Writer(tmp_path / "x.mp4", 64, 64, 16, style="crisp")  # type: ignore[arg-type]


def read_back(path: Path, settings: Mp4Settings) -> tuple[np.ndarray, av.video.stream.VideoStream]:
    """The model-size frames of a video (an upscaled one's blocks averaged back) and its stream."""
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        frames = [
            frame.to_ndarray(format="rgb24")
            if settings.scale == 1
            else yuv420_to_rgb(frame.to_ndarray(format="yuv420p"), settings.scale)
            for frame in container.decode(stream)
        ]
    return np.stack(frames), stream


def test_small_worlds_videos_keep_their_pixels(tmp_path: Path) -> None:
    frames = default_world_frames()  # tiny-world: 64x64 pixel art
    quality = {}
    for style in ("native", "upscale", "yuv444"):
        path = tmp_path / f"{style}.mp4"
        with Mp4Writer(path, 64, 64, 16, style=style) as writer:
            writer.write(frames[:16])
            writer.write(frames[16:])
        settings = mp4_settings(style, 64, 64)
        decoded, stream = read_back(path, settings)
        assert decoded.shape == frames.shape
        side = 64 * settings.scale
        assert (stream.codec_context.width, stream.codec_context.height) == (side, side)
        assert stream.codec_context.pix_fmt == settings.pix_fmt
        quality[style] = min(psnr(a, b) for a, b in zip(frames, decoded, strict=True))
    # 4:2:0 at the model's size blurs pixel art; each crisp style keeps every frame above 40 dB
    assert quality["native"] < 33 and quality["upscale"] >= 40 and quality["yuv444"] >= 40, quality
    # as a player shows the upscaled video (swscale's RGB, at 256 px): sharp blocks
    with av.open(str(tmp_path / "upscale.mp4")) as container:
        shown = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    blocks = frames.repeat(4, axis=1).repeat(4, axis=2)
    assert min(psnr(a, b) for a, b in zip(blocks, shown, strict=True)) >= 40


def test_generate_takes_every_style(capsys: pytest.CaptureFixture[str]) -> None:
    parse = cli._parser().parse_args
    assert parse(["generate"]).video == "auto"
    assert [parse(["generate", "--video", style]).video for style in get_args(VideoStyle)] == list(
        get_args(VideoStyle)
    )
    with pytest.raises(SystemExit):
        parse(["generate", "--video", "crisp"])
    assert "invalid choice" in capsys.readouterr().err


def test_generate_writes_the_style_asked_for(worlds, tmp_path: Path) -> None:
    save_world(worlds["tiny"], tmp_path / "tiny")  # 32x32: auto would upscale it 8x
    out = tmp_path / "run.mp4"
    args = ["generate", "--model", str(tmp_path / "tiny"), "--chunks", "2", "--out", str(out)]
    assert cli.main([*args, "--video", "yuv444"]) == 0
    with av.open(str(out)) as container:
        ctx = container.streams.video[0].codec_context
        assert (ctx.width, ctx.height, ctx.pix_fmt) == (32, 32, "yuv444p")
        assert len(list(container.decode(video=0))) == 7  # 3 + 4 frames
