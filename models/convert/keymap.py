"""Apply an explicit key map with full checking (the one place conversions copy tensors)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

Shape = tuple[int, ...]
SHOWN = 12  # keys listed per problem kind in an error message


class ConversionError(ValueError):
    """A checkpoint does not match the layout a converter expects (lists every problem)."""


@dataclass
class KeyMap:
    """source key -> target key, plus source keys that are dropped on purpose (with the reason)."""

    rename: dict[str, str] = field(default_factory=dict)
    ignored: dict[str, str] = field(default_factory=dict)

    def update(self, other: KeyMap) -> None:
        """Merge another map into this one (keys must not collide)."""
        clash = (set(self.rename) & set(other.rename)) | (
            set(self.rename.values()) & set(other.rename.values())
        )
        if clash:
            raise ValueError(f"key maps overlap: {sorted(clash)[:SHOWN]}")
        self.rename |= other.rename
        self.ignored |= other.ignored


def shape_of(value: torch.Tensor | Shape) -> Shape:
    """The shape of a tensor, or a shape given directly."""
    return tuple(value.shape) if isinstance(value, torch.Tensor) else tuple(value)


def check(
    source: Mapping[str, torch.Tensor | Shape], keymap: KeyMap, target: Mapping[str, Shape], what: str
) -> None:
    """Raise `ConversionError` naming every missing, unexpected and mis-shaped key, or return."""
    unexpected = sorted(k for k in source if k not in keymap.rename and k not in keymap.ignored)
    produced = {keymap.rename[k]: k for k in source if k in keymap.rename}
    not_in_target = sorted(dst for dst in produced if dst not in target)
    missing_src = sorted(src for src, dst in keymap.rename.items() if dst in target and src not in source)
    missing = sorted(dst for dst in target if dst not in produced)
    mis = [
        f"{src} {shape_of(source[src])} -> {dst} {tuple(target[dst])}"
        for dst, src in sorted(produced.items())
        if dst in target and shape_of(source[src]) != tuple(target[dst])
    ]
    problems = []
    if missing:
        hint = f" (source keys {_clip(missing_src)})" if missing_src else ""
        problems.append(f"missing {len(missing)}: {_clip(missing)}{hint}")
    if unexpected:
        problems.append(f"unexpected {len(unexpected)}: {_clip(unexpected)}")
    if not_in_target:
        problems.append(f"mapped to names the model lacks {len(not_in_target)}: {_clip(not_in_target)}")
    if mis:
        problems.append(f"mis-shaped {len(mis)}: {_clip(mis)}")
    if problems:
        raise ConversionError(f"{what}: " + "; ".join(problems))


def apply(
    source: Mapping[str, torch.Tensor], keymap: KeyMap, target: Mapping[str, Shape], what: str
) -> dict[str, torch.Tensor]:
    """Check, then return the renamed tensors (contiguous; dtype unchanged)."""
    check(source, keymap, target, what)
    return {keymap.rename[k]: v.contiguous() for k, v in source.items() if k in keymap.rename}


def module_shapes(module: torch.nn.Module) -> dict[str, Shape]:
    """Key -> shape of a module's state dict (build the module on the meta device: no memory)."""
    return {k: tuple(v.shape) for k, v in module.state_dict().items()}


def strip_prefix(state: Mapping[str, torch.Tensor | Shape], prefix: str, what: str) -> dict:
    """Drop `prefix` from every key; every key must carry it."""
    bad = sorted(k for k in state if not k.startswith(prefix))
    if bad:
        raise ConversionError(f"{what}: keys without the {prefix!r} prefix: {_clip(bad)}")
    return {k[len(prefix) :]: v for k, v in state.items()}


def _clip(items: list[str]) -> str:
    more = f" ... and {len(items) - SHOWN} more" if len(items) > SHOWN else ""
    return ", ".join(items[:SHOWN]) + more
