"""The tiny world's registrations: the `tiny-world` name, the "game" start image, the "fast"
decoder kind, its plug-in (motion head, atlas, terrain prior: models/tiny_world/plugin.py), which
a worldserve.json "plugin" block with "name": "tiny_world" loads, and the DiT input features
"sprite_marker" (models/tiny_world/marker.py) of DiTs trained with `--marker`.

Importing this module registers them with `models.registry` (it is listed in `models.families`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from models.registry import DecoderKind, load_world, register
from models.tiny_world import NAME, WEIGHTS_DIR, start_image
from models.tiny_world.fast_decoder import FastAEConfig, FastAutoencoder, FastStreamingDecoder
from models.tiny_world.marker import FEATURES, load_features
from models.tiny_world.plugin import TinyWorldPlugin, load_plugin
from models.world import World


def tiny_world(device: torch.device | str, dtype: torch.dtype) -> World:
    """`tiny-world`: the shipped model directory (models/tiny_world/weights)."""
    return load_world(WEIGHTS_DIR, device, dtype)


def game_start_image(spec: dict, root: Path) -> Callable[[int], np.ndarray]:
    """The "game" start image: the built-in simulator's first frame for the session's seed."""
    size = int(spec.get("size", 64))
    return lambda seed: start_image(seed, size)


def _fast_autoencoder(config: FastAEConfig | dict) -> FastAutoencoder:
    return FastAutoencoder(config if isinstance(config, FastAEConfig) else FastAEConfig.from_dict(config))


def _fast_module(decoder: FastStreamingDecoder) -> FastAutoencoder:
    return decoder.ae


def _fast_config(module: FastAutoencoder) -> dict:
    return {"_class_name": "FastAutoencoder", **module.cfg.to_dict()}


register(NAME, tiny_world)
register("game", game_start_image, kind="start_image")
register(
    "fast",
    DecoderKind(_fast_autoencoder, FastStreamingDecoder, _fast_module, _fast_config),  # type: ignore[arg-type]
    kind="decoder",
)
register(TinyWorldPlugin.name, load_plugin, kind="plugin")
register(FEATURES, load_features, kind="input_features")
