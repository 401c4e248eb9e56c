"""Per-session frame encoders (H.264, JPEG, raw) and the matching decoders for clients.

An encoder is stateful, belongs to one session, and is driven by one thread at a time (the
server runs encoders in a small pool, off the event loop and off the engine thread); nothing in
here starts threads, and libx264 is held to ``threads`` (default 1) so that pool stays the only
parallelism. Frames in are (T, H, W, 3) uint8 RGB, committed frames only.

* H.264: libx264 ``preset=ultrafast``, ``tune=zerolatency``, no B-frames, one packet per frame,
  BT.601 limited range signalled in the SPS, Annex-B with SPS/PPS repeated in front of every
  IDR, so a decoder can start at any keyframe (WebCodecs ``VideoDecoder`` takes Annex-B when it
  gets no ``description``). The stream starts with an IDR; :meth:`FrameEncoder.force_keyframe`
  asks for another (on request, after a drop). ``codec_string`` is the WebCodecs
  ``avc1.PPCCLL`` read from the SPS the encoder writes. Small worlds are coded upscaled
  (:func:`h264_settings`): 4:2:0 chroma at 64x64 halves the colour resolution of pixel art
  (28.2 dB on tiny-world); coded at 2x with each pixel's colour in its own chroma sample
  (web.yuv) it is 48.1 dB at 0.82x the bytes (benchmarks/h264_small.py). ``ready.codec.scale``
  tells the client, whose decoder averages each scale x scale block back to the model's size.
* JPEG: Pillow (libjpeg-turbo); measured faster than PyAV's mjpeg (0.06 vs 0.08 ms at 64x64,
  0.69 vs 1.21 ms at 640x360, one thread). Every frame is a keyframe, at the model's size.
  Small worlds keep their chroma (:func:`jpeg_settings`): on tiny-world, 4:2:0 at quality 90
  is 28.4 dB (mean; 26.6 worst), 4:4:4 at 96 is 46.0 dB (41.7 worst) for 1.6x the bytes (2.7 KB
  a frame) and 0.085 vs 0.076 ms of encode a frame (benchmarks/jpeg_small.py). Larger worlds
  stay 4:2:0 at 90: on smooth 640x352 frames 4:4:4 at 96 is 2.9x the bytes for 2 dB more.
* Raw: the uint8 array itself; the codec packs it as a wire array.

Decoders (for the SDK): :class:`H264Decoder`, :func:`decode_jpeg` and :class:`ChunkDecoder`,
which turns one session's ``frames`` messages back into arrays whatever the codec.
"""

import io
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from fractions import Fraction
from typing import ClassVar, Literal

import av
import numpy as np
from av.video.frame import PictureType
from PIL import Image

from web.errors import MediaError
from web.messages import Codec, CodecInfo, Frames
from web.yuv import rgb_to_yuv420, yuv420_to_rgb

__all__ = [
    "ChunkDecoder",
    "EncodedChunk",
    "FrameEncoder",
    "H264Decoder",
    "H264Encoder",
    "JpegEncoder",
    "RawEncoder",
    "codec_string_from_sps",
    "decode_jpeg",
    "encode_still",
    "h264_settings",
    "jpeg_settings",
    "make_encoder",
    "nal_units",
]

# H.264 NAL unit types (ITU-T H.264 table 7-1) that matter here.
NAL_IDR = 5
NAL_SEI = 6
NAL_SPS = 7
NAL_PPS = 8

_START_CODE = re.compile(b"\x00\x00\x01")

# Worlds whose shorter side is below this many pixels are small: pixel art whose colours 4:2:0
# chroma would halve. Their H.264 is coded upscaled (h264_settings), their JPEG is 4:4:4
# (jpeg_settings), and an MP4 of them is upscaled by default (web.video).
SMALL_SIDE = 128
# CRF per coding scale: an upscaled frame is flat in each block, so it holds its quality with
# fewer bits per pixel; at 2x, CRF 21 is 0.82x the bytes of the unscaled CRF-18 stream (the
# limit we set is 2x; 1.37x on the previous tiny-world's softer frames) for 48.1 dB
# (benchmarks/h264_small.py).
H264_CRF = {1: 18, 2: 21, 4: 26}

JpegSubsampling = Literal["4:2:0", "4:4:4"]
_PIL_SUBSAMPLING: dict[str, int] = {"4:4:4": 0, "4:2:0": 2}  # Pillow's subsampling codes


@dataclass(frozen=True)
class EncodedChunk:
    """One chunk, ready to go into a ``frames`` message."""

    data: list[bytes] | np.ndarray  # one payload per frame, or the (T, H, W, 3) uint8 array (raw)
    key: bool  # the first frame is a keyframe (a decoder can start here)


def _check_frames(frames: np.ndarray, size: tuple[int, int] | None = None) -> np.ndarray:
    """``frames`` as a C-contiguous (T, H, W, 3) uint8 array; ``size`` = (height, width) if fixed."""
    if not isinstance(frames, np.ndarray) or frames.dtype != np.uint8 or frames.ndim != 4:
        raise MediaError("frames must be a (T, H, W, 3) uint8 array")
    if frames.shape[3] != 3 or 0 in frames.shape:
        raise MediaError(f"frames must be (T, H, W, 3) with T, H, W >= 1, got {frames.shape}")
    if size is not None and frames.shape[1:3] != size:
        raise MediaError(f"frames are {frames.shape[1]}x{frames.shape[2]}, encoder is {size[0]}x{size[1]}")
    return np.ascontiguousarray(frames)


class FrameEncoder(ABC):
    """The server's view of an encoder: one chunk in, one :class:`EncodedChunk` out."""

    codec: ClassVar[Codec]  # the protocol's name for the codec

    @property
    def info(self) -> CodecInfo:
        """What ``ready.codec`` says about this encoder."""
        return CodecInfo(name=self.codec)

    @abstractmethod
    def encode_chunk(self, frames: np.ndarray) -> EncodedChunk:
        """Encode the (T, H, W, 3) uint8 frames of one chunk."""

    def force_keyframe(self) -> None:  # noqa: B027 - an optional hook, a no-op for intra-only codecs
        """Make the next frame a keyframe. Intra-only codecs: every frame already is one."""


class H264Encoder(FrameEncoder):
    """H.264 (libx264) Annex-B encoder for one session; see the module docstring.

    ``crf``: x264's constant-rate factor, lower = better and bigger. 18, not x264's 23: bits are
    cheap at these sizes (~4 KiB a frame at 640x360) and 23 drops 64x64 frames below 35 dB PSNR.
    ``keyint``: most frames between IDRs (default 10 s of video; more come on request).
    ``threads``: libx264's thread count. ``scale``: frames (``width`` x ``height``, the model's
    size) are coded at ``scale`` times that size, each pixel a scale x scale block (1, 2 or 4:
    even factors give each pixel whole 4:2:0 chroma samples; see web.yuv). The coded width and
    height must be even; odd ones raise MediaError rather than being padded, which would change
    the decoded size.
    """

    codec = "h264"

    def __init__(
        self,
        width: int,
        height: int,
        fps: float,
        *,
        crf: int = 18,
        keyint: int | None = None,
        threads: int = 1,
        scale: int = 1,
    ) -> None:
        if scale not in H264_CRF:
            raise MediaError(f"H.264 scale must be one of {sorted(H264_CRF)}, got {scale}")
        coded_w, coded_h = width * scale, height * scale
        if coded_w < 2 or coded_h < 2 or coded_w % 2 or coded_h % 2:
            raise MediaError(f"H.264 (yuv420p) needs an even width and height, got {coded_w}x{coded_h}")
        if not fps > 0:
            raise MediaError(f"fps must be positive, got {fps}")
        self.width = width  # pixels, of the frames in
        self.height = height  # pixels
        self.scale = scale  # coded at width * scale x height * scale
        self.fps = Fraction(fps).limit_denominator(1001)  # frames per second (29.97 -> 30000/1001)
        self.crf = crf
        self.keyint = keyint if keyint is not None else max(1, round(fps * 10))  # frames
        self.threads = threads
        self._ctx = self._open()
        self._pts = 0  # frames encoded so far
        self._force_key = False  # next frame must be an IDR
        self._sps: bytes | None = None  # the stream's SPS NAL unit, once known

    def _open(self) -> av.VideoCodecContext:
        ctx = av.CodecContext.create("libx264", "w")
        ctx.width = self.width * self.scale
        ctx.height = self.height * self.scale
        ctx.pix_fmt = "yuv420p"
        ctx.time_base = 1 / self.fps
        ctx.framerate = self.fps
        ctx.gop_size = self.keyint
        ctx.max_b_frames = 0
        ctx.thread_count = self.threads
        # The RGB -> yuv420p conversion is BT.601, limited range; say so in the SPS (VUI) so that
        # browsers do not guess (an unspecified matrix may be taken as BT.709 at HD sizes).
        ctx.color_primaries = ctx.color_trc = ctx.colorspace = 6  # AVCOL_*_SMPTE170M (BT.601)
        ctx.color_range = 1  # AVCOL_RANGE_MPEG (limited)
        # forced-idr: a forced keyframe is an IDR (decodable from scratch), not a recovery point.
        # Without a global header, libx264 repeats SPS/PPS in-band before every IDR (Annex-B).
        ctx.options = {"preset": "ultrafast", "tune": "zerolatency", "crf": str(self.crf), "forced-idr": "1"}
        ctx.open()
        return ctx

    def force_keyframe(self) -> None:
        self._force_key = True

    def encode(self, frames: np.ndarray) -> list[tuple[bytes, bool]]:
        """One Annex-B access unit per frame, with whether it is an IDR (SPS/PPS in front)."""
        out = []
        for rgb in _check_frames(frames, (self.height, self.width)):
            if self.scale > 1:  # our own conversion: each pixel's colour in its own chroma samples
                frame = av.VideoFrame.from_ndarray(rgb_to_yuv420(rgb, self.scale), format="yuv420p")
            else:
                frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")  # converted to yuv420p in encode
            frame.pts = self._pts
            if self._force_key:
                frame.pict_type = PictureType.I
                self._force_key = False
            packets = self._ctx.encode(frame)
            if len(packets) != 1:  # zerolatency has no lookahead: a frame in, its packet out
                raise MediaError(f"libx264 returned {len(packets)} packets for frame {self._pts}")
            self._pts += 1
            payload, key = bytes(packets[0]), packets[0].is_keyframe
            if key and self._sps is None:
                self._sps = _find_sps(payload)
            out.append((payload, key))
        return out

    def encode_chunk(self, frames: np.ndarray) -> EncodedChunk:
        encoded = self.encode(frames)
        return EncodedChunk(data=[payload for payload, _ in encoded], key=encoded[0][1])

    @property
    def codec_string(self) -> str:
        """WebCodecs codec string, e.g. ``avc1.42c01e``, from the SPS this encoder writes.

        Before the first frame, the SPS comes from the first keyframe of a throwaway encoder with
        the same settings (profile and level depend only on them), so ``ready`` can carry it.
        """
        if self._sps is None:
            black = np.zeros((self.height * self.scale, self.width * self.scale, 3), np.uint8)
            probe = self._open().encode(av.VideoFrame.from_ndarray(black, format="rgb24"))
            self._sps = _find_sps(bytes(probe[0]))
        return codec_string_from_sps(self._sps)

    @property
    def info(self) -> CodecInfo:
        return CodecInfo(name=self.codec, codec=self.codec_string, scale=self.scale)


class JpegEncoder(FrameEncoder):
    """One baseline JPEG per frame (Pillow); ``quality`` 1..100 as in Pillow; ``subsampling``
    4:2:0 (each 2x2 block shares its colour) or 4:4:4 (every pixel keeps its own)."""

    codec = "jpeg"

    def __init__(self, quality: int = 90, subsampling: JpegSubsampling = "4:2:0") -> None:
        if not 1 <= quality <= 100:
            raise MediaError(f"JPEG quality must be in 1..100, got {quality}")
        if subsampling not in _PIL_SUBSAMPLING:
            raise MediaError(f"JPEG subsampling must be 4:2:0 or 4:4:4, got {subsampling!r}")
        self.quality = quality
        self.subsampling = subsampling

    def encode(self, frames: np.ndarray) -> list[tuple[bytes, bool]]:
        """One JPEG per frame; every frame is a keyframe."""
        out = []
        for rgb in _check_frames(frames):
            buf = io.BytesIO()
            Image.fromarray(rgb).save(
                buf, format="JPEG", quality=self.quality, subsampling=_PIL_SUBSAMPLING[self.subsampling]
            )
            out.append((buf.getvalue(), True))
        return out

    def encode_chunk(self, frames: np.ndarray) -> EncodedChunk:
        return EncodedChunk(data=[payload for payload, _ in self.encode(frames)], key=True)


class RawEncoder(FrameEncoder):
    """Passes the uint8 frames through (robotics clients want exact pixels). The array is not
    copied here; :func:`web.codec.encode` copies it into the message."""

    codec = "raw"

    def encode_chunk(self, frames: np.ndarray) -> EncodedChunk:
        return EncodedChunk(data=_check_frames(frames), key=True)


def h264_settings(width: int, height: int) -> tuple[int, int]:
    """(scale, crf) of a session's H.264 stream for a world of this size.

    Worlds under :data:`SMALL_SIDE` px on their shorter side are coded 2x (4x below half of
    it), so their colours survive 4:2:0 chroma subsampling; larger ones at their own size.
    """
    side = min(width, height)
    scale = 1 if side >= SMALL_SIDE else 2 if side >= SMALL_SIDE // 2 else 4
    return scale, H264_CRF[scale]


def jpeg_settings(width: int, height: int) -> tuple[int, JpegSubsampling]:
    """(quality, subsampling) of a session's JPEG frames for a world of this size.

    Worlds under :data:`SMALL_SIDE` px on their shorter side are 4:4:4 at quality 96 (every
    pixel keeps its colour; 96 rather than 95 keeps tiny-world's worst frame above 40 dB);
    larger ones 4:2:0 at 90.
    """
    return (96, "4:4:4") if min(width, height) < SMALL_SIDE else (90, "4:2:0")


def make_encoder(codec: Codec, width: int, height: int, fps: float) -> FrameEncoder:
    """A fresh encoder for one session, with the default settings of its codec (small worlds'
    H.264 is coded upscaled, the client learns the scale from ``ready.codec.scale``; their JPEG
    keeps every pixel's colour at the model's size)."""
    if codec == "h264":
        scale, crf = h264_settings(width, height)
        return H264Encoder(width, height, fps, crf=crf, scale=scale)
    if codec == "jpeg":
        quality, subsampling = jpeg_settings(width, height)
        return JpegEncoder(quality, subsampling)
    if codec == "raw":
        return RawEncoder()
    raise MediaError(f"unknown codec {codec!r}")


# -- H.264 bitstream helpers --------------------------------------------------------------------


def nal_units(stream: bytes) -> list[bytes]:
    """The NAL units of an Annex-B byte stream, start codes removed."""
    starts = [m.end() for m in _START_CODE.finditer(stream)]
    ends = [s - 3 for s in starts[1:]] + [len(stream)]
    # A 4-byte start code leaves its leading zero on the previous unit; a NAL never ends in 0x00
    # (its RBSP ends with a stop bit), so trailing zeros are always start-code bytes.
    return [stream[s:e].rstrip(b"\x00") for s, e in zip(starts, ends, strict=True)]


def _find_sps(stream: bytes) -> bytes:
    for nal in nal_units(stream):
        if nal and nal[0] & 0x1F == NAL_SPS:
            return nal
    raise MediaError("no SPS in the keyframe")


def codec_string_from_sps(sps: bytes) -> str:
    """WebCodecs/RFC 6381 ``avc1.PPCCLL`` from an SPS NAL unit (header byte included).

    The three bytes after the header are profile_idc, the constraint flags and level_idc; no
    emulation-prevention byte can fall among them because profile_idc is never 0.
    """
    if len(sps) < 4 or sps[0] & 0x1F != NAL_SPS:
        raise MediaError("not an SPS NAL unit")
    return f"avc1.{sps[1]:02x}{sps[2]:02x}{sps[3]:02x}"


# -- decoders (clients) -------------------------------------------------------------------------


class H264Decoder:
    """Annex-B access units in, (H, W, 3) uint8 RGB frames out; stateful, one per stream.

    Units before the first IDR are skipped (returns no frames), so a decoder can join a stream
    at any keyframe, e.g. after frames were dropped. ``scale`` (``ready.codec.scale``): the
    stream is coded at that multiple of the model's size; each scale x scale block is averaged
    back into one pixel (web.yuv), so frames come out at the model's size.
    """

    def __init__(self, *, threads: int = 1, scale: int = 1) -> None:
        self._ctx = av.CodecContext.create("h264", "r")
        # Frame threading would hold back one frame per thread; one thread keeps it one-in-one-out.
        self._ctx.thread_count = threads
        self._ctx.thread_type = "SLICE"
        self._threads = threads  # also for the YUV -> RGB conversion (swscale's default is one per CPU)
        self._started = False  # an IDR has been seen
        self.scale = scale  # coded size / model size

    def decode(self, unit: bytes) -> list[np.ndarray]:
        """Frames completed by this access unit (one, for the encoder above)."""
        if not self._started:
            if not any(nal and nal[0] & 0x1F == NAL_IDR for nal in nal_units(unit)):
                return []
            self._started = True
        try:
            frames = self._ctx.decode(av.Packet(unit))
        except av.FFmpegError as exc:
            raise MediaError(f"H.264 decode failed: {exc}") from exc
        # swscale's own thread pool costs more than it saves on small frames, and on a busy machine
        # the caller waits for its workers to be scheduled (measured: 4 ms for a 64x64 frame).
        if self.scale == 1:
            return [frame.to_ndarray(format="rgb24", threads=self._threads) for frame in frames]
        try:
            return [yuv420_to_rgb(frame.to_ndarray(format="yuv420p"), self.scale) for frame in frames]
        except ValueError as exc:
            raise MediaError(str(exc)) from exc


def decode_jpeg(data: bytes) -> np.ndarray:
    """One JPEG as a writable (H, W, 3) uint8 RGB array."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            if image.format != "JPEG":
                raise MediaError(f"not a JPEG: {image.format}")
            return np.array(image.convert("RGB"))
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise MediaError(f"JPEG decode failed: {exc}") from exc


class ChunkDecoder:
    """Turns one session's ``frames`` messages back into (T, H, W, 3) uint8 arrays."""

    def __init__(self, codec: Codec, scale: int = 1) -> None:
        self.codec = codec  # the session's codec (ready.codec.name)
        self._h264 = H264Decoder(scale=scale) if codec == "h264" else None

    def set_scale(self, scale: int) -> None:
        """Use ``ready.codec.scale`` (H.264 frames come out at the model's size); no-op otherwise."""
        if self._h264 is not None:
            self._h264.scale = scale

    def decode(self, msg: Frames) -> np.ndarray:
        """The chunk's frames; for H.264 joined mid-stream, fewer (possibly 0) until an IDR."""
        if msg.codec != self.codec:
            raise MediaError(f"frames in {msg.codec} on a {self.codec} stream")
        if isinstance(msg.data, np.ndarray):
            return msg.data
        payloads = [msg.data] if isinstance(msg.data, bytes) else msg.data
        if self._h264 is not None:
            frames = [frame for unit in payloads for frame in self._h264.decode(unit)]
        else:
            frames = [decode_jpeg(payload) for payload in payloads]
        if not frames:
            return np.empty((0, 0, 0, 3), np.uint8)
        return np.stack(frames)


def encode_still(image: np.ndarray) -> bytes:
    """One picture shown on its own (``ready.frame``) as a JPEG: 4:4:4 at quality 95, since a
    single still costs little and small pixel-art worlds lose their colours to 4:2:0."""
    (rgb,) = _check_frames(image[None])
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="JPEG", quality=95, subsampling=0)
    return buf.getvalue()
