"""Real frames of the default world, for the codec tests (rendered once per test process)."""

import functools

import numpy as np
import torch


@functools.cache
def default_world_frames() -> np.ndarray:
    """32 frames of the default world (`tiny-world`, 64x64 pixel art) as the model renders them:
    8 chunks under held keys (the Engine queues at most 8), through the Engine. Read-only."""
    from models.actions import FrameAction
    from models.registry import DEFAULT_MODEL, from_name
    from models.world import Conditioning
    from runtime.engine import Engine
    from runtime.requests import ChunkCommitted, ChunkRequest

    world = from_name(DEFAULT_MODEL)
    engine = Engine({world.config.id: world}, max_batch=1)
    engine.add_stream("s", world.config.id, Conditioning(seed=3))
    for key in "ddssaaww":
        engine.submit(ChunkRequest("s", engine.new_request_id(), actions=[FrameAction(frozenset({key}))] * 4))
    parts: dict[int, np.ndarray] = {}
    with torch.no_grad():
        while engine.has_work():
            for out in engine.step():
                assert isinstance(out, ChunkCommitted)
                parts[out.frame0] = out.frames
    frames = np.concatenate([parts[k] for k in sorted(parts)])
    frames.flags.writeable = False  # shared between tests
    return frames
