"""The core on a CUDA device: world state stays resident, results match the CPU.

Marked `gpu`: excluded from the default run; `pytest -m gpu` on a machine with CUDA.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.registry import build_world, tiny_random_configs
from models.world import Conditioning
from runtime.engine import Engine
from runtime.requests import ChunkCommitted, ChunkRequest, DebugHooks
from tests.runtime.conftest import keys, snapshot

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def state_tensors(engine: Engine, sid: str) -> list[torch.Tensor]:
    st = engine.runner.streams[sid].state
    feats = [f for f in st.decoder.feats if isinstance(f, torch.Tensor)]
    pool = engine.world_of(sid).transformer.pool
    return [*pool.row_view(st.row).values(), pool.text_len, *feats]


def run(engine: Engine, sid: str, actions) -> ChunkCommitted:
    engine.submit(ChunkRequest(sid, engine.new_request_id(), actions=actions))
    out = []
    while engine.has_work():
        out += engine.step()
    (o,) = out
    return o


def test_world_state_is_resident_and_matches_cpu():
    cpu = build_world(*tiny_random_configs(), seed=0)
    gpu = build_world(*tiny_random_configs(), seed=0, device="cuda")
    ec, eg = Engine({"tiny-random": cpu}), Engine({"tiny-random": gpu})
    for e in (ec, eg):
        e.add_stream("s", "tiny-random", Conditioning(seed=1))
    for a in (keys("w"), keys("d"), keys()):
        fc, fg = run(ec, "s", a).frames, run(eg, "s", a).frames
        # Noise is drawn on the CPU, so both devices roll out the same world; kernels differ.
        assert np.abs(fc.astype(int) - fg).max() <= 3
        assert all(t.device.type == "cuda" for t in state_tensors(eg, "s"))


def test_cancel_on_cuda_is_exact():
    gpu = build_world(*tiny_random_configs(), seed=0, device="cuda")
    e = Engine({"tiny-random": gpu})
    e.add_stream("s", "tiny-random", Conditioning(seed=2), DebugHooks(fail_at_chunk=2))
    run(e, "s", keys("w"))
    before = snapshot(e, "s")
    failed = run(e, "s", keys("d"))
    assert type(failed).__name__ == "ChunkFailed"
    after = snapshot(e, "s")
    assert before["counters"] == after["counters"]
    for name in before["kv"]:
        assert torch.equal(before["kv"][name], after["kv"][name])


def test_pipelined_decode_on_a_side_stream_equals_serial():
    """Decode on the side stream overlapping the next chunks' denoise: the same frames as the
    serial engine on the same pool layout, and a cancel of everything in flight is exact."""
    outs = {}
    for pipelined in (False, True):
        e = Engine({"tiny-random": build_world(*tiny_random_configs(), seed=0, device="cuda")}, pipeline=True)
        e.runner.pipeline = pipelined
        for sid in "ab":
            e.add_stream(sid, "tiny-random", Conditioning(seed=ord(sid)))
        for j in range(6):
            for sid in "ab":
                e.submit(ChunkRequest(sid, e.new_request_id(), actions=keys("wasd"[j % 4])))
        got = []
        while e.has_work():
            got += e.step()
        outs[pipelined] = {(o.stream_id, o.chunk): o.frames for o in got}
    assert outs[False].keys() == outs[True].keys() and len(outs[True]) == 12
    for key, frames in outs[False].items():
        assert np.abs(frames.astype(int) - outs[True][key]).max() <= 1
