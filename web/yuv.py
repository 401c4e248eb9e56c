"""RGB <-> yuv420p for H.264 streams coded at an integer multiple of the frame size.

A world frame coded at an even ``scale`` (2, 4, ...) times its size, each pixel a scale x scale
block, has whole 4:2:0 chroma samples of its own (scale / 2 per axis). Converting here (rather
than upscaling RGB and letting swscale subsample) puts each pixel's own colour in its chroma
samples, with no filter mixing in the neighbours' colours; the way back averages each block's
luma and chroma and converts at the frame's size (benchmarks/h264_small.py measures the whole
path). Session streams use 2 and 4 (web.encoders), upscaled MP4s up to what reaches 256 px
(web.video).

Colours are BT.601, limited range: what the encoder's SPS signals (SMPTE 170M, MPEG range).
"""

import numpy as np

__all__ = ["rgb_to_yuv420", "yuv420_to_rgb"]

_BT601 = np.array(  # rows: Y, Cb, Cr from R, G, B (full range, 0..255 in and out)
    [[0.299, 0.587, 0.114], [-0.168736, -0.331264, 0.5], [0.5, -0.418688, -0.081312]]
)
_SPAN = np.array([219.0, 224.0, 224.0]) / 255  # limited range: Y 16..235, Cb/Cr 16..240
_OFFSET = np.array([16.0, 128.0, 128.0], np.float32)
_TO_YUV = (_BT601.T * _SPAN).astype(np.float32)  # rgb @ _TO_YUV + _OFFSET
_TO_RGB = (np.linalg.inv(_BT601).T / _SPAN[:, None]).astype(np.float32)  # (yuv - _OFFSET) @ _TO_RGB


def _check_scale(scale: int) -> int:
    if scale < 2 or scale % 2:
        raise ValueError(f"scale must be even and >= 2 (whole chroma samples per pixel), got {scale}")
    return scale // 2  # chroma samples per pixel, per axis


def rgb_to_yuv420(rgb: np.ndarray, scale: int) -> np.ndarray:
    """(H, W, 3) uint8 RGB -> the (3/2 * sH, sW) uint8 yuv420p image (PyAV's layout) of the frame
    upscaled ``scale`` times (nearest): Y plane, then Cb, then Cr."""
    chroma = _check_scale(scale)
    yuv = np.clip(np.rint(rgb.astype(np.float32) @ _TO_YUV + _OFFSET), 0, 255).astype(np.uint8)
    luma = yuv[..., 0].repeat(scale, axis=0).repeat(scale, axis=1)
    cb, cr = (yuv[..., i].repeat(chroma, axis=0).repeat(chroma, axis=1) for i in (1, 2))
    return np.concatenate([luma.ravel(), cb.ravel(), cr.ravel()]).reshape(-1, luma.shape[1])


def yuv420_to_rgb(image: np.ndarray, scale: int) -> np.ndarray:
    """The inverse of :func:`rgb_to_yuv420`: a decoded (3/2 * sH, sW) yuv420p image -> (H, W, 3)
    uint8 RGB, each pixel from the mean of its block's luma and chroma samples."""
    chroma = _check_scale(scale)
    rows, width = image.shape
    height = rows * 2 // 3
    if rows % 3 or height % scale or width % scale:
        raise ValueError(f"a {width}x{height} yuv420p image is not coded at scale {scale}")
    h, w = height // scale, width // scale
    planes = image.ravel()
    luma = planes[: height * width].reshape(h, scale, w, scale).mean(axis=(1, 3), dtype=np.float32)
    cb, cr = (
        planes[height * width + i * (height * width // 4) :][: height * width // 4]
        .reshape(h, chroma, w, chroma)
        .mean(axis=(1, 3), dtype=np.float32)
        for i in (0, 1)
    )
    rgb = (np.stack([luma, cb, cr], axis=-1) - _OFFSET) @ _TO_RGB
    return np.clip(np.rint(rgb), 0, 255).astype(np.uint8)
