"""The tiny world's registrations: the `tiny-world` name, the "game" start image, the "fast"
decoder kind, and the key gate and terrain prior a tiny-world directory may carry (its
worldserve.json "gate" / "terrain").

Importing this module registers them with `models.registry` (it is listed in `models.families`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from models.fast_decoder import FastAEConfig, FastAutoencoder, FastStreamingDecoder
from models.key_gate import KeyGate, KeyGateConfig
from models.registry import DecoderKind, Part, load_state, load_world, register, save_part
from models.terrain_prior import TerrainPrior, TerrainPriorConfig
from models.tiny_world import NAME, WEIGHTS_DIR, start_image
from models.world import World

GATE_WEIGHTS = "gate/key_gate.safetensors"  # a world's key gate, relative to its directory
TERRAIN_WEIGHTS = "terrain/terrain_prior.safetensors"  # a world's terrain prior, likewise


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


def save_gate(gate: KeyGate, path: str | Path) -> None:
    """Write a key gate into a model directory: its weights, and its config as worldserve.json's
    "gate" entry (the rest of the directory is left as it is)."""
    save_part(gate, gate.cfg.to_dict(), "gate", GATE_WEIGHTS, path)


def save_terrain(prior: TerrainPrior, path: str | Path) -> None:
    """Write a terrain prior into a model directory, as `save_gate` a gate ("terrain" entry)."""
    save_part(prior, prior.cfg.to_dict(), "terrain", TERRAIN_WEIGHTS, path)


def _load_gate(world: World, config: dict, root: Path) -> None:
    gate = KeyGate(KeyGateConfig.from_dict(config))
    load_state(gate, root / GATE_WEIGHTS)
    world.set_gate(gate)


def _save_gate(world: World, root: Path) -> None:
    if world.gate is not None:
        save_gate(world.gate, root)


def _load_terrain(world: World, config: dict, root: Path) -> None:
    prior = TerrainPrior(TerrainPriorConfig.from_dict(config))
    load_state(prior, root / TERRAIN_WEIGHTS)
    world.set_terrain(prior)


def _save_terrain(world: World, root: Path) -> None:
    if world.terrain is not None:
        save_terrain(world.terrain, root)


register(NAME, tiny_world)
register("game", game_start_image, kind="start_image")
register(
    "fast",
    DecoderKind(_fast_autoencoder, FastStreamingDecoder, _fast_module, _fast_config),  # type: ignore[arg-type]
    kind="decoder",
)
register("gate", Part(_load_gate, _save_gate), kind="part")
register("terrain", Part(_load_terrain, _save_terrain), kind="part")
