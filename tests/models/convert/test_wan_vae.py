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
