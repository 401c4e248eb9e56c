"""A session's whole state as one object: written, checked and read back.

`Snapshot` is what the owner of the sessions' device state (runtime/memory.py, `DeviceMemory`)
captures and installs: the filled part of the session's pool row, its decoder cache and plug-in
state (`World.export_state`), its counters and action log, plus what the sessions layer keeps of
it (`session`: JSON, `arrays`: numpy, e.g. the start image and retained chunks). Its manifest
names the model and a hash of its weights (`World.weights_hash`), and a checksum of every tensor.

One byte format, used for a save game on the wire and for a file under `serve --state-dir`: a
safetensors file whose metadata holds the manifest as JSON under "worldserve". `decode` refuses
(`SnapshotError`, with a `reason`) bytes that are not such a file, whose tensors do not match the
checksum, or that another format version wrote; `check_world` refuses a snapshot of a model that
is not loaded or whose weights differ.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from models.actions import FrameAction

if TYPE_CHECKING:
    from models.world import World

FORMAT = "worldserve.snapshot/1"
META_KEY = "worldserve"  # safetensors metadata key holding the manifest


class SnapshotError(ValueError):
    """A snapshot that cannot be installed. `reason`: "damaged" (not a snapshot, or its bytes
    changed), "version" (another format), "model" (its model is not loaded), "weights" (its
    model's weights differ from the loaded ones), "unfit" (its tensors do not fit the world)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class Snapshot:
    """One session's state: JSON (`manifest`) and tensors on the host."""

    model_id: str
    weights: str  # `World.weights_hash` of the world it ran on
    world: dict[str, Any]  # `World.export_state` JSON: counters, seed, decoder and plug-in layout
    tensors: dict[str, torch.Tensor]  # `World.export_state` tensors
    action_log: list[list[FrameAction]] = field(default_factory=list)
    session: dict[str, Any] = field(default_factory=dict)  # the sessions layer's own record
    arrays: dict[str, np.ndarray] = field(default_factory=dict)  # ... and its arrays

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors and arrays."""
        own = sum(t.numel() * t.element_size() for t in self.tensors.values())
        return own + sum(a.nbytes for a in self.arrays.values())


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _action_json(a: FrameAction) -> dict[str, Any]:
    return {
        "keys": sorted(a.keys),
        "mouse": list(a.mouse),
        "vector": None if a.vector is None else list(a.vector),
    }


def _action(d: dict[str, Any]) -> FrameAction:
    vector = d.get("vector")
    return FrameAction(
        frozenset(d["keys"]),
        (float(d["mouse"][0]), float(d["mouse"][1])),
        None if vector is None else tuple(float(v) for v in vector),
    )


def encode(snap: Snapshot) -> bytes:
    """The snapshot as safetensors bytes with its manifest (and checksum) in the metadata."""
    tensors = {f"world.{k}": v for k, v in snap.tensors.items()}
    tensors |= {f"session.{k}": torch.from_numpy(np.ascontiguousarray(v)) for k, v in snap.arrays.items()}
    manifest = {
        "format": FORMAT,
        "model": snap.model_id,
        "weights": snap.weights,
        "world": snap.world,
        "action_log": [[_action_json(a) for a in chunk] for chunk in snap.action_log],
        "session": snap.session,
        "sha256": tensors_digest(tensors),
    }
    return st_save(tensors, metadata={META_KEY: json.dumps(manifest, separators=(",", ":"))})


def read_manifest(data: bytes) -> dict[str, Any]:
    """The manifest of snapshot bytes without reading the tensors (`SnapshotError` "damaged")."""
    try:
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + n])
        return json.loads(header["__metadata__"][META_KEY])
    except Exception as exc:
        raise SnapshotError("damaged", f"not a worldserve snapshot: {type(exc).__name__}: {exc}") from exc


def decode(data: bytes) -> Snapshot:
    """Inverse of `encode`, checked: `SnapshotError` "damaged" when the bytes are not a snapshot
    or the tensors do not match the checksum, "version" for another format."""
    manifest = read_manifest(data)
    if manifest.get("format") != FORMAT:
        raise SnapshotError(
            "version", f"snapshot format {manifest.get('format')!r}; this server reads {FORMAT!r}"
        )
    try:
        tensors = st_load(data)
    except Exception as exc:
        raise SnapshotError("damaged", f"snapshot tensors unreadable: {type(exc).__name__}: {exc}") from exc
    if tensors_digest(tensors) != manifest.get("sha256"):
        raise SnapshotError("damaged", "snapshot checksum mismatch: its bytes were damaged")
    try:
        return Snapshot(
            model_id=str(manifest["model"]),
            weights=str(manifest["weights"]),
            world=dict(manifest["world"]),
            tensors={k[6:]: v for k, v in tensors.items() if k.startswith("world.")},
            action_log=[[_action(a) for a in chunk] for chunk in manifest["action_log"]],
            session=dict(manifest["session"]),
            arrays={k[8:]: v.numpy() for k, v in tensors.items() if k.startswith("session.")},
        )
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise SnapshotError("damaged", f"snapshot manifest incomplete: {type(exc).__name__}: {exc}") from exc


def check_world(snap: Snapshot, worlds: dict[str, World]) -> World:
    """The loaded world the snapshot runs on (`SnapshotError` "model" or "weights" otherwise)."""
    world = worlds.get(snap.model_id)
    if world is None:
        raise SnapshotError(
            "model", f"snapshot of model {snap.model_id!r}, which is not loaded; loaded: {sorted(worlds)}"
        )
    if world.weights_hash() != snap.weights:
        raise SnapshotError(
            "weights",
            f"snapshot of model {snap.model_id!r} with other weights (hash {snap.weights[:12]}..., "
            f"loaded {world.weights_hash()[:12]}...)",
        )
    return world
