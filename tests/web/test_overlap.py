"""`--overlap-decode on` seen from outside: realtime chunks arrive in order with contiguous
frames, a cancel is exact, and lockstep frames equal a serial server's (issue 9, item 6)."""

from __future__ import annotations

import itertools

import numpy as np

from tests.runtime.conftest import small_world
from tests.web.conftest import dial, recv, recv_until, run, send, serving
from web import messages as m


def test_realtime_chunks_flow_in_order_and_cancel_is_exact_when_pipelined() -> None:
    worlds = {"tiny": small_world()}  # its own world: a pipelined pool has a chunk of ring slack

    async def main() -> None:
        async with serving(worlds, overlap_decode=True) as server:
            ws = await dial(server)
            await send(ws, m.Open(mode="realtime", codec="raw", seed=3))
            await recv_until(ws, m.Ready)
            await send(ws, m.Action(seq=1, keys=("d",)))
            got = []
            while len(got) < 6:
                msg = await recv(ws)
                if isinstance(msg, m.Frames):
                    got.append(msg)
                    await send(ws, m.Ack(chunk=msg.chunk))
            assert [f.chunk for f in got] == list(range(1, 7))
            assert all(b.frame0 == a.frame0 + a.count for a, b in itertools.pairwise(got))
            await send(ws, m.Pause(seq=2))
            await send(ws, m.Cancel(seq=3))
            tail = await recv_until(ws, m.Cancelled)
            cancelled = tail[-1]
            frames = [x for x in tail if isinstance(x, m.Frames)]
            last = frames[-1].chunk if frames else got[-1].chunk
            assert cancelled.chunk == last + 1  # the first chunk that did not commit
            await ws.close()

    run(main())


def test_lockstep_frames_equal_a_serial_server() -> None:
    async def play(overlap: bool) -> list[np.ndarray]:
        async with serving({"tiny": small_world()}, overlap_decode=overlap) as server:
            ws = await dial(server)
            await send(ws, m.Open(mode="lockstep", codec="raw", seed=9))
            await recv_until(ws, m.Ready)
            out = []
            for seq, key in enumerate("wwddssaa"):
                await send(ws, m.Step(seq=seq, actions=(m.FrameAction(keys=(key,)),)))
                frames = await recv(ws)
                assert isinstance(frames, m.Frames) and frames.chunk == seq + 1
                out.append(frames.data)
            await ws.close()
            return out

    serial, piped = run(play(False)), run(play(True))
    for a, b in zip(serial, piped, strict=True):
        # the pipelined ring is a chunk longer: float sums differ in order once it wraps
        assert np.abs(a.astype(int) - b).max() <= 1
