"""Write frames to an MP4 file (H.264 via PyAV): the CLI's one-shot output and recorded episodes.

H.264 players take 4:2:0 chroma, which halves the colour resolution of a small pixel-art world
and shows it as a thumbnail. A video's ``style`` (:func:`mp4_settings`) decides how it is coded;
PSNR against the raw frames of tiny-world (64x64, 96 frames), bytes per frame:

* ``native``: the model's size, 4:2:0, CRF 18 (what players expect): 27.6 dB, 134 B.
* ``upscale``: each pixel an s x s block (nearest neighbour, s even, so each pixel keeps its own
  chroma samples: web.yuv), the shorter side at least :data:`UPSCALE_MIN_SIDE` px; 4:2:0, CRF 18,
  so it plays everywhere and opens at a size one can see: 52.0 dB (blocks averaged back; 45.2 dB
  against the upscaled frames as a player shows them), 258 B.
* ``yuv444``: the model's size, 4:4:4 (every pixel its own colour; H.264's High 4:4:4 profile,
  which ffmpeg and VLC play but many browsers and hardware decoders do not), CRF 10 (at 18 it
  is 39.9 dB): 46.9 dB, 164 B.
* ``auto``: ``upscale`` for worlds whose shorter side is under
  :data:`web.encoders.SMALL_SIDE` px, ``native`` for larger ones.
"""

import math
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from types import TracebackType
from typing import Literal, get_args

import av
import numpy as np

from web.encoders import SMALL_SIDE
from web.errors import MediaError
from web.yuv import rgb_to_yuv420

__all__ = ["UPSCALE_MIN_SIDE", "Mp4Settings", "Mp4Writer", "VideoStyle", "mp4_settings"]

VideoStyle = Literal["auto", "native", "upscale", "yuv444"]
UPSCALE_MIN_SIDE = 256  # px: the shorter side of an upscaled video is at least this


@dataclass(frozen=True)
class Mp4Settings:
    """How a video is coded: ``scale`` x the model's size, in ``pix_fmt``, at x264's ``crf``."""

    scale: int  # each model pixel is a scale x scale block (1: the model's size)
    pix_fmt: Literal["yuv420p", "yuv444p"]
    crf: int  # lower = better and bigger


def mp4_settings(style: VideoStyle, width: int, height: int) -> Mp4Settings:
    """The coding of a ``width`` x ``height`` world's video in ``style`` (see the module doc).

    An upscaled video's scale is the smallest even factor that brings the shorter side to
    :data:`UPSCALE_MIN_SIDE` px (2 for worlds already that large), e.g. 4 for 64 px, 8 for 32.
    """
    if style not in get_args(VideoStyle):
        raise MediaError(f"video style must be one of {', '.join(get_args(VideoStyle))}, got {style!r}")
    if style == "auto":
        style = "upscale" if min(width, height) < SMALL_SIDE else "native"
    if style == "upscale":
        scale = max(2, 2 * math.ceil(UPSCALE_MIN_SIDE / (2 * min(width, height))))
        return Mp4Settings(scale, "yuv420p", 18)
    return Mp4Settings(1, "yuv444p", 10) if style == "yuv444" else Mp4Settings(1, "yuv420p", 18)


class Mp4Writer:
    """An MP4 file being written, one (T, H, W, 3) uint8 chunk at a time; ``width`` x ``height``
    is the model's size, ``style`` how it is coded (default ``native``: read-back code, such as
    recorded episodes, gets the model's frames back as they are); ``crf`` overrides the style's."""

    def __init__(
        self,
        path: str | Path,
        width: int,
        height: int,
        fps: float,
        crf: int | None = None,
        *,
        style: VideoStyle = "native",
    ) -> None:
        self.settings = mp4_settings(style, width, height)
        self.path = Path(path)
        self.frames = 0  # frames written so far
        self._container = av.open(str(self.path), "w")
        self._stream = self._container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1001))
        self._stream.width = width * self.settings.scale
        self._stream.height = height * self.settings.scale
        self._stream.pix_fmt = self.settings.pix_fmt
        # What both conversions (web.yuv's and swscale's default) use: BT.601, limited range.
        # Said in the stream so players do not guess BT.709 for an upscaled, HD-sized picture.
        ctx = self._stream.codec_context
        ctx.color_primaries = ctx.color_trc = ctx.colorspace = 6  # AVCOL_*_SMPTE170M (BT.601)
        ctx.color_range = 1  # AVCOL_RANGE_MPEG (limited)
        crf = self.settings.crf if crf is None else crf
        self._stream.options = {"preset": "veryfast", "crf": str(crf)}

    def write(self, frames: np.ndarray) -> None:
        """Append frames, (T, H, W, 3) uint8 RGB."""
        scale = self.settings.scale
        for rgb in frames:
            if scale > 1:  # each pixel's own colour in its chroma samples, not swscale's filter
                yuv = rgb_to_yuv420(np.ascontiguousarray(rgb), scale)
                frame = av.VideoFrame.from_ndarray(yuv, format="yuv420p")
            else:
                frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb), format="rgb24")
            self._container.mux(self._stream.encode(frame))
            self.frames += 1

    def close(self) -> None:
        """Flush the encoder and finish the file."""
        self._container.mux(self._stream.encode(None))
        self._container.close()

    def __enter__(self) -> "Mp4Writer":
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
