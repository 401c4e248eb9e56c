"""Wan 2.1 VAE: the original key set (built by the original code on meta) maps strictly onto
AutoencoderKLWan, and agrees with diffusers' own converter key for key."""

import json

import pytest
from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

from models.convert import wan_vae
from models.convert.keymap import ConversionError
from tests.fixtures.golden import GOLDEN


def _table() -> dict[str, tuple[int, ...]]:
    return {
        k: tuple(v) for k, v in json.loads((GOLDEN / "original_keys.json").read_text())["wan21_vae"].items()
    }


def test_full_size_maps_strictly() -> None:
    wan_vae.check_shapes(_table())


def test_agrees_with_diffusers_converter() -> None:
    table = _table()
    ours = wan_vae.key_map(list(table)).rename
    theirs = convert_wan_vae_to_diffusers({k: k for k in table})  # values carry the source key
    assert theirs == {dst: src for src, dst in ours.items()}  # theirs: diffusers name -> source key


def test_unknown_and_missing_keys_are_named() -> None:
    table = _table()
    table["decoder.extra.0.weight"] = (1,)
    del table["encoder.conv1.weight"]
    with pytest.raises(
        ConversionError, match=r"missing 1: encoder.conv_in.weight.*unexpected 1: decoder.extra.0.weight"
    ):
        wan_vae.check_shapes(table)


def test_converted_tiny_vae_matches_the_original_numerically(tmp_path) -> None:
    """A tiny original VAE (made by the original code) converted and run by diffusers'
    AutoencoderKLWan: the same encoder mean and decoded frames within 1e-4."""
    import torch
    from diffusers import AutoencoderKLWan
    from safetensors.torch import save_file

    from tests.fixtures.golden import load_golden

    g, meta = load_golden("wan_vae_tiny")
    src = tmp_path / "tiny_vae.safetensors"
    save_file({k: v for k, v in g.items() if k not in ("input", "encoded", "latent", "decoded")}, str(src))
    state, cfg = wan_vae.convert(src, meta["config"])
    vae = AutoencoderKLWan(**cfg).eval()
    vae.load_state_dict(state, strict=True)
    with torch.no_grad():
        mean = vae.encode(g["input"]).latent_dist.mean
        frames = vae.decode(g["latent"]).sample
    assert (mean - g["encoded"]).abs().max() < 1e-4
    assert (frames - g["decoded"].clamp(-1, 1)).abs().max() < 1e-4  # diffusers clamps its output
