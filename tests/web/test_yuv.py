"""web/yuv.py: RGB <-> yuv420p at an integer coding scale."""

import numpy as np
import pytest

from web.yuv import rgb_to_yuv420, yuv420_to_rgb

from .conftest import psnr


@pytest.mark.parametrize("scale", [2, 4, 6, 8])
def test_round_trip_keeps_every_pixels_colour(scale: int) -> None:
    # Random pixels: neighbours share nothing, so any chroma mixing between pixels would show.
    rgb = np.random.default_rng(scale).integers(0, 256, (12, 10, 3), np.uint8)
    image = rgb_to_yuv420(rgb, scale)
    assert image.shape == (12 * scale * 3 // 2, 10 * scale) and image.dtype == np.uint8
    luma = image[: 12 * scale]
    assert np.array_equal(luma[::scale, ::scale].repeat(scale, 0).repeat(scale, 1), luma)  # blocks
    back = yuv420_to_rgb(image, scale)
    assert back.shape == rgb.shape
    assert psnr(rgb, back) >= 45  # only 8-bit limited-range rounding is lost
    assert np.abs(back.astype(int) - rgb).max() <= 6


def test_limited_range_bt601() -> None:
    rgb = np.array([[[0, 0, 0], [255, 255, 255]]], np.uint8)
    image = rgb_to_yuv420(rgb, 2)
    assert image[0, 0] == 16 and image[0, 2] == 235  # Y: black 16, white 235
    assert image.shape == (3, 4) and set(image[2:].ravel()) == {128}  # 2 luma rows; grey: no chroma


def test_bad_scales() -> None:
    with pytest.raises(ValueError, match="scale"):
        rgb_to_yuv420(np.zeros((2, 2, 3), np.uint8), 3)
    with pytest.raises(ValueError, match="scale"):
        rgb_to_yuv420(np.zeros((2, 2, 3), np.uint8), 0)
    with pytest.raises(ValueError, match="not coded at scale 4"):
        yuv420_to_rgb(np.zeros((12, 6), np.uint8), 4)
