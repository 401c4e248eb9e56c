"""Read checkpoint files (safetensors or torch pickles) without trusting pickled code."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from models.convert.keymap import ConversionError


def read_state(path: Path, pick: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint file.

    ``.safetensors`` loads as is. A torch pickle (``.pt``/``.pth``/``.bin``) loads with
    ``weights_only=True`` (no code runs) and memory-mapped; if it is a dict of state dicts, the
    first key of `pick` present is taken (Self-Forcing: ``generator_ema`` before ``generator``).
    """
    if not path.is_file():
        raise ConversionError(f"{path}: no such file")
    if path.suffix == ".safetensors":
        with safe_open(str(path), "pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is not iterable
    obj = None
    for mmap in (True, False):  # mmap needs the zipfile format; older pickles load without it
        try:
            obj = torch.load(str(path), map_location="cpu", weights_only=True, mmap=mmap)
            break
        except Exception as exc:  # torch raises several types for non-checkpoints
            if not mmap:
                raise ConversionError(f"{path}: not a safetensors file or torch checkpoint ({exc})") from exc
    if not isinstance(obj, dict):
        raise ConversionError(f"{path}: expected a dict of tensors, found {type(obj).__name__}")
    for key in pick:
        if isinstance(obj.get(key), dict):
            obj = obj[key]
            break
    else:
        nested = sorted(k for k, v in obj.items() if isinstance(v, dict))
        if nested:
            raise ConversionError(f"{path}: a dict of state dicts {nested}; expected one of {list(pick)}")
    bad = sorted(k for k, v in obj.items() if not isinstance(v, torch.Tensor))
    if bad:
        raise ConversionError(f"{path}: entries that are not tensors: {bad[:8]}")
    return dict(obj)


def list_keys(path: Path, pick: tuple[str, ...] = ()) -> list[str]:
    """The tensor names of a checkpoint file (safetensors: read from the header only)."""
    if path.suffix == ".safetensors" and path.is_file():
        with safe_open(str(path), "pt") as f:
            return list(f.keys())
    return list(read_state(path, pick))  # torch pickles load memory-mapped
