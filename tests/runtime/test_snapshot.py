"""A session's whole state as one snapshot: captured by the device-state owner, installed in
another engine, it continues bit for bit; damaged bytes and other weights are refused by name."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from models.registry import from_name, load_world
from models.world import Conditioning
from runtime.engine import Engine
from runtime.snapshot import SnapshotError, decode, read_manifest
from tests.fixtures.golden.served import write_matrix_game_dir
from tests.runtime.conftest import committed, keys, small_world

BEFORE = [keys("w"), keys("d"), keys("a", "space")]
AFTER = [keys("s"), keys(), keys("d", "w")]


def _engine(world, **kw) -> Engine:
    return Engine({world.config.id: world}, **kw)


def _saved_and_continued(world, seed: int = 5, before=BEFORE, after=AFTER, image=None, **kw):
    """(frames of an uninterrupted run after BEFORE, frames of a restored run, both engines)."""
    model = world.config.id
    a = _engine(world, **kw)
    a.add_stream("s", model, Conditioning(seed=seed, image=image))
    for act in before:
        committed(a, "s", act)
    data = a.snapshot_stream("s", {"note": "kept"}, {"image": np.arange(12, dtype=np.uint8).reshape(2, 2, 3)})
    b = _engine(world, **kw)
    info, session, arrays = b.restore_stream("r", data)
    assert (info.chunks, info.video_frames) == (a.info("s").chunks, a.info("s").video_frames)
    assert session == {"note": "kept"} and np.array_equal(arrays["image"], np.arange(12).reshape(2, 2, 3))
    assert len(b.runner.streams["r"].action_log) == len(before)
    want = [committed(a, "s", act).frames for act in after]
    got = [committed(b, "r", act).frames for act in after]
    return want, got, a, b, data


@pytest.mark.parametrize("carry", [(), (0, 1)], ids=["wan-vae", "plugin-state"])
def test_a_restored_session_continues_bit_for_bit(carry):
    want, got, a, b, _ = _saved_and_continued(small_world(carry=carry, name="snap"))
    for x, y in zip(want, got, strict=True):
        assert np.array_equal(x, y)
    a.close()
    b.close()


def test_a_pipelined_engine_restores_into_its_ring_with_slack_bit_for_bit():
    want, got, a, b, _ = _saved_and_continued(small_world(name="snap"), pipeline=True)
    for x, y in zip(want, got, strict=True):
        assert np.array_equal(x, y)
    a.close()
    b.close()


def test_a_matrix_game_shaped_world_with_its_image_conditioning_continues_bit_for_bit(tmp_path):
    world = load_world(write_matrix_game_dir(tmp_path))
    image = np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    want, got, a, b, data = _saved_and_continued(world, before=[None, None], after=[None, None], image=image)
    assert any(k.startswith("world.extra.") for k in _tensor_names(data))  # image cond, action ring
    for x, y in zip(want, got, strict=True):
        assert np.array_equal(x, y)
    a.close()
    b.close()


def _tensor_names(data: bytes) -> list[str]:
    n = int.from_bytes(data[:8], "little")
    return [k for k in json.loads(data[8 : 8 + n]) if k != "__metadata__"]


def test_tiny_world_with_its_atlas_continues_bit_for_bit():
    world = from_name("tiny-world")
    want, got, a, b, data = _saved_and_continued(world)
    assert read_manifest(data)["world"]["plugin"] == {"atlas": True}
    for x, y in zip(want, got, strict=True):
        assert np.array_equal(x, y)
    a.close()
    b.close()


def test_damaged_bytes_are_refused_and_the_engine_goes_on():
    world = small_world(name="snap")
    a = _engine(world)
    a.add_stream("s", "snap", Conditioning(seed=1))
    committed(a, "s", keys("w"))
    data = bytearray(a.snapshot_stream("s", {}, {}))
    data[-3] ^= 0xFF  # a tensor byte
    with pytest.raises(SnapshotError, match="checksum") as exc:
        a.restore_stream("r", bytes(data))
    assert exc.value.reason == "damaged"
    with pytest.raises(SnapshotError) as exc:
        decode(b"\x05\x00\x00\x00\x00\x00\x00\x00{not")
    assert exc.value.reason == "damaged"
    assert "r" not in a.runner.streams and len(a.memory) == 1
    committed(a, "s", keys("d"))  # the live session is untouched
    a.close()


def test_a_snapshot_of_other_weights_is_refused_by_name():
    world = small_world(name="snap")
    a = _engine(world)
    a.add_stream("s", "snap", Conditioning(seed=1))
    committed(a, "s", keys("w"))
    data = a.snapshot_stream("s", {}, {})
    other = small_world(name="snap")
    with torch.no_grad():
        next(other.transformer.parameters()).add_(1e-3)
    b = _engine(other)
    with pytest.raises(SnapshotError, match="other weights") as exc:
        b.restore_stream("r", data)
    assert exc.value.reason == "weights" and len(b.memory) == 0
    elsewhere = _engine(small_world(name="another"))
    with pytest.raises(SnapshotError, match="not loaded") as exc:
        elsewhere.restore_stream("r", data)
    assert exc.value.reason == "model"
    a.close()


def test_a_restore_that_does_not_fit_the_budget_takes_nothing():
    world = small_world(name="snap")
    a = _engine(world, max_streams=1)
    a.add_stream("s", "snap", Conditioning(seed=1))
    committed(a, "s", keys("w"))
    data = a.snapshot_stream("s", {}, {})
    from runtime.errors import CapacityError

    with pytest.raises(CapacityError):
        a.restore_stream("r", data)
    assert len(a.memory) == 1 and "r" not in a.runner.streams
    a.close()
