"""Deterministic serving (`Engine(deterministic=True)`, `serve --deterministic`): a session's
frames do not depend on which sessions share its batch, nor on where it sits in it."""

from __future__ import annotations

import numpy as np
import pytest

from models.actions import FrameAction
from models.registry import from_name
from models.world import Conditioning
from runtime.engine import Engine
from runtime.requests import ChunkCommitted, ChunkRequest

SCRIPT = [[FrameAction(frozenset(k))] for k in (("w",), ("d",), (), ("a", "s"), ("d",), ())]


def _frames(world, mates: int, last: bool = False, mate_seed: int = 100, **kw) -> np.ndarray:
    """Session "s" (seed 7) stepped through SCRIPT beside `mates` others, all submitted together."""
    engine = Engine({world.config.id: world}, max_batch=8, max_streams=16, **kw)
    others = [f"m{i}" for i in range(mates)]
    order = [*others, "s"] if last else ["s", *others]
    for sid in order:
        seed = 7 if sid == "s" else mate_seed + int(sid[1:])
        engine.add_stream(sid, world.config.id, Conditioning(seed=seed))
    frames = []
    for actions in SCRIPT:
        for sid in order:
            engine.submit(ChunkRequest(sid, engine.new_request_id(), actions=actions))
        while engine.has_work():
            for out in engine.step():
                assert isinstance(out, ChunkCommitted), out
                if out.stream_id == "s":
                    frames.append(out.frames)
    engine.close()
    return np.concatenate(frames)


@pytest.mark.parametrize("model", ["tiny-random", "tiny-world"])
def test_a_deterministic_session_is_the_same_alone_and_beside_any_mates(model):
    world = from_name(model)
    alone = _frames(world, 0, deterministic=True)
    assert np.array_equal(alone, _frames(world, 7, deterministic=True))
    assert np.array_equal(alone, _frames(world, 3, last=True, mate_seed=300, deterministic=True))
    # and it is the session the plain engine serves alone (one forward of one)
    plain_alone = _frames(world, 0)
    assert np.abs(alone.astype(int) - plain_alone.astype(int)).max() <= 1
