"""Named worlds and the loader for local model directories (never a hub).

A model directory has diffusers' layout plus one file of serving settings::

    DIR/worldserve.json                      {"world": WorldConfig, "transformer": CausalWanConfig,
                                              "decoder": {"kind": "wan" | "taehv" | ...},  (default wan)
                                              "start_image": {"kind": ..., ...},  (optional)
                                              "plugin": {"name": ..., ...}}  (optional, models/plugin.py)
    DIR/transformer/diffusion_pytorch_model.safetensors
    DIR/vae/config.json                      AutoencoderKLWan config, or a registered kind's config
    DIR/vae/diffusion_pytorch_model.safetensors
    DIR/...                                  what the world's plug-in saves (its own weights)

`transformer/config.json` is accepted too when worldserve.json has no "transformer" entry,
so a plain diffusers Wan checkpoint loads with only a small worldserve.json beside it.
The decoder kind picks the autoencoder class: diffusers' `AutoencoderKLWan` behind
`WanStreamingVAE`, `TAEHV` behind `TAEHVDecoder`, or a kind a family registers (`DecoderKind`).
A taehv entry reads no vae/config.json::

    "decoder": {"kind": "taehv",
                "config": "taew2_1" | TAEHVConfig dict,   (optional, default "taew2_1")
                "path": "taew2_1.safetensors"}             (optional, default the vae/ weights;
                                                            relative to DIR, or absolute)

`with_decoder(world, "taehv:PATH")` swaps a loaded world's decoder for TAEHV weights in a local
file, e.g. madebyollin/taehv's taew2_1.safetensors (`worldserve --decoder taehv:PATH`).
A "start_image" entry gives image-started worlds a seed -> frame function, so sessions need not
send `open.image` ("file": one image file, `{"kind": "file", "path": "start.png"}` relative to
DIR, the same frame for every seed; families register more kinds).
Converted directories (models/convert/output.py) list in "requires" what serving them needs; a
directory needing anything outside `SUPPORTED_REQUIREMENTS` is refused, and "text_prompts" marks
the world as taking prompts (`WorldConfig.text_prompts`; resolved by `World.prompts`).

Names, directory families, start-image kinds, plug-ins and decoder kinds are registered, not imported:
`register(name, loader, kind)` fills one table per kind, and the families listed (as module
names) in `models.families` register themselves when first imported, which the lookups here
trigger through importlib, so this module has no import edge to any family. Built in here:
the name `tiny-random` (seeded random weights, for tests), the decoder kinds "wan" and "taehv"
and the start-image kind "file"; everything else (the default world among it) comes from the
families' own loader modules.
"""

from __future__ import annotations

import importlib
import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from diffusers import AutoencoderKLWan
from safetensors.torch import load_file, save_file

from models.causal_wan import ActionConfig, CausalWan, CausalWanConfig
from models.names import DEFAULT_MODEL as DEFAULT_MODEL  # re-exported: the registry's default
from models.plugin import WorldPlugin
from models.sampler import FlowSchedule
from models.taehv import TAEHV, TAEHVConfig, TAEHVDecoder
from models.vae import StreamingDecoder, WanStreamingVAE
from models.world import World, WorldConfig

WEIGHTS = "diffusion_pytorch_model.safetensors"
# diffusers' own loader drops these keys (Wan I2V leftovers); so do we.
IGNORED_KEYS = ("norm_added_q",)
DECODER_KINDS = ("wan", "taehv")  # worldserve.json "decoder.kind" values built in; families add more
TAEHV_DEFAULT = "taew2_1"  # the TAEHV config of a taehv entry without one, and of `--decoder taehv:PATH`

# What `register` takes: "world", a name's builder(device, dtype) -> World; "family", the loader
# (root, meta, device, dtype) -> World of directories whose worldserve.json "family" is the name;
# "start_image", a factory (spec, root) -> seed -> frame for a "start_image.kind"; "plugin", the
# loader (root, block) -> `WorldPlugin` of a worldserve.json "plugin" block whose "name" it is;
# "decoder", a `DecoderKind` for a worldserve.json "decoder.kind"; "input_features", a factory
# (spec) -> `InputFeatures` for a DiT config's `input_features` entry whose "name" it is.
Kind = Literal["world", "family", "start_image", "plugin", "decoder", "input_features"]
KINDS: tuple[Kind, ...] = ("world", "family", "start_image", "plugin", "decoder", "input_features")


@dataclass(frozen=True)
class DecoderKind:
    """A decoder kind a family adds (worldserve.json "decoder.kind").

    `build(config)` is its autoencoder with random weights, from its vae/config.json dict or its
    config object; `streaming` the `StreamingDecoder` class built around that module; `module`
    the module inside such a decoder; `config(module)` the vae/config.json a saved world writes."""

    build: Callable[[Any], torch.nn.Module]
    streaming: type[StreamingDecoder]
    module: Callable[[StreamingDecoder], torch.nn.Module]
    config: Callable[[torch.nn.Module], dict]


class UnknownModelError(KeyError):
    """No model of that name (the protocol's `not_found`)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""  # the message, without KeyError's quotes


class UnsupportedModelError(ValueError):
    """A model directory needs something this server cannot run yet (its worldserve.json "requires")."""


# worldserve.json "requires" entries this build can serve (models/convert/output.py writes them).
# "text_prompts": sessions' prompts resolve through `World.prompts` (serve --prompt-embeds DIR);
# the Matrix-Game entries are what older conversions listed before the model ran them.
SUPPORTED_REQUIREMENTS: frozenset[str] = frozenset({"text_prompts", "mg_action_module", "image_conditioning"})


def tiny_random_configs() -> tuple[WorldConfig, CausalWanConfig, dict]:
    """`tiny-random`: seeded random weights, small enough for CPU tests (64x64, 4 frames a chunk)."""
    world = WorldConfig(
        id="tiny-random",
        fps=15.0,
        width=64,
        height=64,
        schedule=FlowSchedule(steps=(1000, 750, 500, 250), shift=3.0),
        description="random weights (noise video); for tests and smoke runs",
    )
    dit = CausalWanConfig(
        num_attention_heads=2,
        attention_head_dim=32,
        in_channels=8,
        out_channels=8,
        text_dim=16,
        freq_dim=32,
        ffn_dim=128,
        num_layers=4,
        chunk_frames=2,
        window_frames=6,
        sink_frames=1,
        action=ActionConfig(
            keys=("w", "a", "s", "d", "space"),
            mouse=True,
            vector_dim=2,
            frames_per_latent=2,
            blocks=2,
            key_dim=32,
            motion_dim=32,
            heads=2,
        ),
    )
    vae = {
        "base_dim": 8,
        "z_dim": 8,
        "dim_mult": [1, 2, 4],
        "num_res_blocks": 1,
        "temperal_downsample": [False, True],
        "latents_mean": [0.0] * 8,
        "latents_std": [1.0] * 8,
        "scale_factor_temporal": 2,
        "scale_factor_spatial": 4,
    }
    return world, dit, vae


def start_image_fn(spec: dict | None, root: Path | None = None) -> Callable[[int], np.ndarray] | None:
    """The seed -> start frame function a worldserve.json "start_image" entry names (None: none);
    a "file" path is relative to the model directory `root`."""
    if spec is None:
        return None
    return lookup("start_image", spec.get("kind"), "start_image kind")(spec, root or Path("."))


def file_start_image(spec: dict, root: Path) -> Callable[[int], np.ndarray]:
    """The "file" start image: one image file, relative to the model directory, for every seed."""
    from PIL import Image

    with Image.open(root / spec["path"]) as img:  # read once, at load
        frame = np.asarray(img.convert("RGB"), dtype=np.uint8)
    return lambda seed: frame


def build_decoder(
    vae: Any,
    kind: str = "wan",
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> StreamingDecoder:
    """A streaming decoder with random weights: Wan's VAE from its config dict, TAEHV from a
    TAEHVConfig or its dict, or a registered kind from its config."""
    if kind == "wan":
        assert isinstance(vae, dict)
        autoencoder = AutoencoderKLWan(**vae).to(device=device)
        if dtype != torch.float32:
            autoencoder = autoencoder.to(dtype=dtype)
        return WanStreamingVAE(autoencoder)
    if kind == "taehv":
        tcfg = vae if isinstance(vae, TAEHVConfig) else TAEHVConfig.from_dict(vae)
        return TAEHVDecoder(TAEHV(tcfg).to(device=device, dtype=dtype))
    kinds = registered("decoder")
    if kind in kinds:
        return kinds[kind].streaming(kinds[kind].build(vae).to(device=device, dtype=dtype))  # type: ignore[call-arg]
    raise ValueError(f"unknown decoder kind {kind!r}; known: {[*DECODER_KINDS, *sorted(kinds)]}")


def wrap_decoder(module: torch.nn.Module, kind: str) -> StreamingDecoder:
    """The streaming decoder of a decoder kind around its (loaded) module."""
    kinds = registered("decoder")
    if kind in kinds:
        return kinds[kind].streaming(module)  # type: ignore[call-arg]
    if kind == "taehv":
        return TAEHVDecoder(module)  # type: ignore[arg-type]
    return WanStreamingVAE(module)  # type: ignore[arg-type]


def taehv_config(spec: str | dict) -> TAEHVConfig:
    """A worldserve.json taehv "config": a published name (`models.taehv.CONFIGS`) or a dict."""
    return TAEHVConfig.from_name(spec) if isinstance(spec, str) else TAEHVConfig.from_dict(spec)


def load_taehv(
    path: str | Path,
    cfg: TAEHVConfig | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> TAEHVDecoder:
    """TAEHV weights from a local safetensors file (e.g. taew2_1.safetensors), loaded strictly."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no TAEHV weights at {path}")
    model = TAEHV(cfg or TAEHVConfig.from_name(TAEHV_DEFAULT))
    load_state(model, path)
    return TAEHVDecoder(model.to(device=device, dtype=dtype))


def with_decoder(world: World, spec: str) -> World:
    """`world` with its decoder replaced per a CLI spec: "taehv:PATH" (taew2_1-shaped weights)."""
    kind, sep, path = spec.partition(":")
    if kind != "taehv" or not sep or not path:
        raise ValueError(f"decoder {spec!r}: expected taehv:PATH (a local .safetensors file)")
    dec = load_taehv(path, device=world.device, dtype=world.dtype)
    out = World(
        world.config,
        world.transformer,
        dec,
        device=world.device,
        dtype=world.dtype,
        start_image=world._start_image,
        plugin=world.plugin,
    )
    out.prompts = world.prompts
    return out


def decoder_module(decoder: StreamingDecoder) -> torch.nn.Module:
    """The nn.Module holding a streaming decoder's weights."""
    for kind in registered("decoder").values():
        if isinstance(decoder, kind.streaming):
            return kind.module(decoder)
    if isinstance(decoder, WanStreamingVAE):
        return decoder.vae
    if isinstance(decoder, TAEHVDecoder):
        return decoder.model
    raise TypeError(f"cannot save a {type(decoder).__name__}")


def decoder_kind(decoder: StreamingDecoder) -> str:
    """The worldserve.json decoder kind of a streaming decoder."""
    if isinstance(decoder, TAEHVDecoder):
        return "taehv"
    for name, kind in registered("decoder").items():
        if isinstance(decoder, kind.streaming):
            return name
    return "wan"


def build_world(
    world: WorldConfig,
    dit: CausalWanConfig,
    vae: Any,
    seed: int | None = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    decoder: str = "wan",
    start_image: Callable[[int], np.ndarray] | None = None,
    plugin: WorldPlugin | None = None,
) -> World:
    """Construct a world from configs; weights random from `seed` (None: leave torch's RNG alone).

    `decoder` is the decoder kind ("wan": `vae` is an AutoencoderKLWan config; "taehv": a
    TAEHVConfig or its dict; a registered kind: its config object or dict).
    """
    if seed is not None:
        torch.manual_seed(seed)
    spec = dit.input_features
    features = lookup("input_features", spec.get("name"))(spec) if spec else None
    transformer = CausalWan(dit, features).to(device=device, dtype=dtype)
    dec = build_decoder(vae, decoder, device, dtype)
    return World(world, transformer, dec, device=device, dtype=dtype, start_image=start_image, plugin=plugin)


def load_state(module: torch.nn.Module, path: Path) -> None:
    """Load safetensors into `module` through an explicit key map: every key must exist on both
    sides (besides IGNORED_KEYS) with the same shape, or this raises with the full list."""
    state = {k: v for k, v in load_file(str(path)).items() if not any(i in k for i in IGNORED_KEYS)}
    own = module.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    mismatched = [
        f"{k}: file {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
        for k in own
        if k in state and state[k].shape != own[k].shape
    ]
    if missing or unexpected or mismatched:
        raise ValueError(
            f"{path}: missing {missing[:8]}, unexpected {unexpected[:8]}, mismatched {mismatched[:8]}"
        )
    module.load_state_dict(state, strict=True)


def save_world(
    world: World, path: str | Path, vae_config: dict | None = None, start_image: dict | None = None
) -> None:
    """Write a world as a model directory (see the module docstring).

    `vae_config` is the AutoencoderKLWan config of a Wan-decoder world (a registered decoder kind
    writes its own); `start_image` is the worldserve.json "start_image" entry, if any.
    """
    root = Path(path)
    (root / "transformer").mkdir(parents=True, exist_ok=True)
    (root / "vae").mkdir(parents=True, exist_ok=True)
    kind = decoder_kind(world.decoder)
    module = decoder_module(world.decoder)
    dec_meta: dict = {"kind": kind}
    if kind == "taehv":
        dec_meta["config"] = module.cfg.to_dict()  # type: ignore[union-attr]
    meta: dict = {
        "world": world.config.to_dict(),
        "transformer": world.transformer.cfg.to_dict(),
        "decoder": dec_meta,
    }
    if start_image is not None:
        meta["start_image"] = start_image
    if world.plugin is not None:
        meta["plugin"] = world.plugin.save(root)
    (root / "worldserve.json").write_text(json.dumps(meta, indent=2))
    kinds = registered("decoder")
    if kind in kinds:
        vae_config = kinds[kind].config(module)
    elif vae_config is None and kind == "wan":
        vae_config = {k: v for k, v in dict(module.config).items() if not k.startswith("_")}  # type: ignore[union-attr]
    if vae_config is not None:
        (root / "vae" / "config.json").write_text(json.dumps(vae_config, indent=2))
    save_file(
        {k: v.contiguous() for k, v in world.transformer.state_dict().items()},
        str(root / "transformer" / WEIGHTS),
    )
    save_file({k: v.contiguous() for k, v in module.state_dict().items()}, str(root / "vae" / WEIGHTS))


def load_plugin(root: Path, block: dict | None) -> WorldPlugin | None:
    """The plug-in a worldserve.json "plugin" block names (None: the world has none)."""
    if block is None:
        return None
    try:
        loader = lookup("plugin", block.get("name"))
    except ValueError as exc:
        raise ValueError(f"{root}: {exc}") from exc
    return loader(root, block)


def load_world(
    path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> World:
    """Load a model directory from local disk."""
    root = Path(path)
    if not (root / "worldserve.json").is_file():
        raise FileNotFoundError(f"{root} is not a model directory (no worldserve.json)")
    meta = json.loads((root / "worldserve.json").read_text())
    missing = [r for r in meta.get("requires", []) if r not in SUPPORTED_REQUIREMENTS]
    if missing:
        raise UnsupportedModelError(
            f"{root}: this {meta.get('family', 'model')} directory needs {', '.join(missing)}, "
            "which this server cannot run yet (see docs/MODELS.md)"
        )
    family = meta.get("family")
    families = registered("family")
    if family in families:
        return families[family](root, meta, device, dtype)
    tcfg = meta.get("transformer")
    if tcfg is None:
        tcfg = json.loads((root / "transformer" / "config.json").read_text()) | meta.get("rollout", {})
    dit = CausalWanConfig.from_dict(tcfg)
    dec_meta = meta.get("decoder", {})
    kind = dec_meta.get("kind", "wan")
    weights = root / "vae" / WEIGHTS
    if kind == "taehv":
        vae_cfg: dict | TAEHVConfig = taehv_config(dec_meta.get("config", TAEHV_DEFAULT))
        weights = root / dec_meta.get("path", weights)  # an absolute path stays as it is
    else:
        vae_cfg = json.loads((root / "vae" / "config.json").read_text())
        vae_cfg = {k: v for k, v in vae_cfg.items() if not k.startswith("_")}
    wcfg = WorldConfig.from_dict(meta["world"])
    if "text_prompts" in meta.get("requires", []):  # converted text-to-video worlds
        wcfg.text_prompts = True
    world = build_world(
        wcfg,
        dit,
        vae_cfg,
        seed=None,
        decoder=kind,
        start_image=start_image_fn(meta.get("start_image"), root),
        plugin=load_plugin(root, meta.get("plugin")),
    )
    load_state(world.transformer, root / "transformer" / WEIGHTS)
    load_state(decoder_module(world.decoder), weights)
    if torch.device(device) == torch.device("cpu") and dtype == torch.float32:
        return world
    dec = wrap_decoder(decoder_module(world.decoder).to(device=device, dtype=dtype), kind)
    return World(
        world.config,
        world.transformer.to(device=device, dtype=dtype),
        dec,
        device=device,
        dtype=dtype,
        start_image=world._start_image,
        plugin=world.plugin,
    )


def _tiny_random(device: torch.device | str, dtype: torch.dtype) -> World:
    return build_world(*tiny_random_configs(), seed=0, device=device, dtype=dtype)


# kind -> name -> loader (see `Kind`). Families add theirs through `register`.
_TABLES: dict[Kind, dict[str, Any]] = {
    "world": {"tiny-random": _tiny_random},
    "family": {},
    "start_image": {"file": file_start_image},
    "plugin": {},
    "decoder": {},
    "input_features": {},
}
_families_loaded = False
_families_lock = threading.RLock()


def register(name: str, loader: Any, kind: Kind = "world") -> None:
    """Register `loader` under `name` in the `kind` table; a name registers once per kind."""
    if kind not in _TABLES:
        raise ValueError(f"unknown registry kind {kind!r}; known: {list(KINDS)}")
    table = _TABLES[kind]
    if name in table and table[name] is not loader:
        raise ValueError(f"{kind} {name!r} is already registered")
    table[name] = loader


def registered(kind: Kind) -> dict[str, Any]:
    """The `kind` table, after every family in `models.families.FAMILIES` has registered."""
    global _families_loaded
    if not _families_loaded:
        from models.families import FAMILIES  # module names only: no family is imported here

        # Another thread waits for the tables to fill; the lock is reentrant for a family that
        # looks a table up while it imports (importlib then skips the module half imported).
        with _families_lock:
            for module in FAMILIES:
                importlib.import_module(module)
            _families_loaded = True
    return _TABLES[kind]


def lookup(kind: Kind, name: object, what: str | None = None) -> Any:
    """What a family registered as `name` in the `kind` table; ValueError naming the known ones
    (`what`: how the message names the entry; default the kind)."""
    table = registered(kind)
    if name not in table:
        raise ValueError(f"unknown {what or kind} {name!r}; known: {sorted(table)}")
    return table[name]


def from_name(name: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> World:
    """Load a registered world by name, or a model directory by path.

    A name that is neither raises `UnknownModelError`, except one written as a path (it has a
    separator, or starts with . or ~), which raises FileNotFoundError: it says the path is missing
    rather than that no world has that name."""
    worlds = registered("world")
    if name in worlds:
        return worlds[name](device, dtype)
    path = Path(name).expanduser()
    if path.is_dir():
        return load_world(path, device, dtype)
    if path.exists():
        raise FileNotFoundError(f"{name} is a file, not a model directory")
    if _looks_like_path(name):
        raise FileNotFoundError(f"model directory {name} does not exist")
    names = ", ".join(sorted(worlds))
    raise UnknownModelError(f"unknown model {name!r}; registered: {names}, or a model directory")


def _looks_like_path(name: str) -> bool:
    separators = {"/", os.sep} | ({os.altsep} if os.altsep else set())
    return name.startswith((".", "~")) or any(s in name for s in separators)


def list_models() -> list[str]:
    """Registered model names."""
    return sorted(registered("world"))
