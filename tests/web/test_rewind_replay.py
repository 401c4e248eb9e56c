"""`rewind` over the wire, the session log route and `worldserve replay LOG` (tiny-world): the
log of a served session, rewinds included, re-renders offline to the very frames it was served."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import numpy as np
import pytest

from models.registry import from_name
from tests.web.conftest import dial, recv, recv_until, run, send, serving
from web import messages as m
from web.cli import main
from web.replaylog import load_log, render
from web.sessionlog import SessionLog

KEYS = [("d",), ("w",), (), ("a", "w"), ("s",), ("d",), ("space",)]


@pytest.fixture(scope="module")
def tiny_world():
    return {"tiny-world": from_name("tiny-world")}


def step(seq: int, keys: tuple[str, ...]) -> m.Step:
    return m.Step(seq=seq, actions=(m.FrameAction(keys=keys, mouse=(0.5 * seq, -1.0)),))


async def fetch(url: str, token: str | None = None) -> tuple[int, bytes]:
    def get() -> tuple[int, bytes]:
        req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    return await asyncio.get_running_loop().run_in_executor(None, get)


def test_rewind_over_the_wire_and_the_log_replays_bit_identically(tiny_world, tmp_path) -> None:
    async def main_() -> tuple[list[m.Frames], SessionLog]:
        async with serving(tiny_world, default_model="tiny-world", retention=3, token="secret") as server:
            ws = await dial(server)
            await send(ws, m.Open(mode="lockstep", codec="raw", seed=3, token="secret"))
            (ready,) = await recv_until(ws, m.Ready)
            served: dict[int, m.Frames] = {}
            for seq in range(5):
                await send(ws, step(seq, KEYS[seq]))
                f = await recv(ws)
                assert isinstance(f, m.Frames)
                served[f.chunk] = f
            # back to chunk 3: ready with that chunk's last frame, then a new timeline from 4
            await send(ws, m.Rewind(seq=10, chunk=3))
            back = await recv(ws)
            assert isinstance(back, m.Ready) and back.chunk == 3 and back.session_id == ready.session_id
            assert np.array_equal(back.frame, served[3].data[-1])
            await send(ws, step(11, KEYS[3]))
            again = await recv(ws)
            assert isinstance(again, m.Frames) and again.chunk == 4 and again.frame0 == served[4].frame0
            assert np.array_equal(again.data, served[4].data)  # the same actions: the same frames
            for seq in (12, 13):
                await send(ws, step(seq, KEYS[seq - 7]))
                f = await recv(ws)
                served[f.chunk] = f
            # out of the retention (now at 6, 3 back is 3): not_retained, and the session goes on
            await send(ws, m.Rewind(seq=20, chunk=2))
            err = await recv(ws)
            assert isinstance(err, m.Error) and err.code == "not_retained" and not err.fatal and err.seq == 20
            url = f"{server.url}/v1/sessions/{ready.session_id}/log"
            assert (await fetch(url))[0] == 401
            assert (await fetch(url, "wrong"))[0] == 401
            assert (await fetch(f"{server.url}/v1/sessions/nope/log", "secret"))[0] == 404
            status, body = await fetch(url, "secret")
            assert status == 200
            await ws.close()
            return [served[c] for c in sorted(served)], SessionLog.model_validate(json.loads(body))

    served, log = run(main_())
    assert [c.chunk for c in log.chunks] == [1, 2, 3, 4, 5, 6]
    assert log.model == "tiny-world" and log.seed == 3 and log.start_image.kind == "seed"
    assert (log.retention, log.dropped, log.mode) == (3, 0, "lockstep")
    assert log.chunks[4].actions[0].keys == KEYS[5] and log.chunks[4].actions[0].mouse == (6.0, -1.0)

    # offline, in-process: the same frames, bit for bit
    from sessions.events import FramesEvent

    replayed: list[np.ndarray] = []
    run(render(tiny_world, log, lambda e: replayed.append(e.frames) if isinstance(e, FramesEvent) else None))
    assert len(replayed) == 6
    assert all(np.array_equal(a, s.data) for a, s in zip(replayed, served, strict=True))

    # and through the CLI, raw frames to an .npz
    path = tmp_path / "log.json"
    path.write_text(log.model_dump_json())
    assert load_log(path) == log
    out = tmp_path / "frames.npz"
    assert main(["replay", str(path), "--out", str(out), "--device", "cpu", "--dtype", "float32"]) == 0
    assert np.array_equal(np.load(out)["frames"], np.concatenate([s.data for s in served]))
    video = tmp_path / "replay.mp4"
    assert main(["replay", str(path), "--out", str(video), "--device", "cpu"]) == 0
    assert video.stat().st_size > 0


def test_a_log_that_is_not_one_is_refused_in_one_line(tmp_path, capsys) -> None:
    bad = tmp_path / "log.json"
    bad.write_text('{"version": 1}')
    assert main(["replay", str(bad), "--out", str(tmp_path / "x.mp4")]) == 2
    assert "not a worldserve session log" in capsys.readouterr().err


def test_a_realtime_session_log_replays_bit_identically(tiny_world) -> None:
    """Realtime chunks take whatever input the buffer holds at their start; the log records what
    each frame applied, so the replay (lockstep steps) gives the served frames."""

    async def main_() -> tuple[list[m.Frames], SessionLog]:
        async with serving(tiny_world, default_model="tiny-world", retention=2) as server:
            ws = await dial(server)
            await send(ws, m.Open(mode="realtime", codec="raw", seed=8, max_ahead=1))
            (ready,) = await recv_until(ws, m.Ready)
            served: list[m.Frames] = []
            for seq in range(4):
                await send(ws, m.Action(seq=seq, keys=KEYS[seq], mouse=(1.5, -0.25)))
                f = (await recv_until(ws, m.Frames))[-1]
                served.append(f)
                await send(ws, m.Ack(chunk=f.chunk))
            await send(ws, m.Pause(seq=10))
            await asyncio.sleep(0.5)  # a chunk in flight at the pause still commits
            while True:
                try:
                    late = await recv(ws, timeout=0.5)
                except TimeoutError:
                    break
                if isinstance(late, m.Frames):
                    served.append(late)
            status, body = await fetch(f"{server.url}/v1/sessions/{ready.session_id}/log")
            assert status == 200  # no server token: no token needed
            await ws.close()
            return served, SessionLog.model_validate(json.loads(body))

    served, log = run(main_())
    assert log.mode == "realtime" and [c.chunk for c in log.chunks] == [f.chunk for f in served]
    from sessions.events import FramesEvent

    replayed: list[np.ndarray] = []
    run(render(tiny_world, log, lambda e: replayed.append(e.frames) if isinstance(e, FramesEvent) else None))
    assert len(replayed) == len(served)
    assert all(np.array_equal(a, s.data) for a, s in zip(replayed, served, strict=True))


def test_a_busy_deterministic_servers_log_replays_bit_identically() -> None:
    """`serve --deterministic`: a session stepped beside three others (one batch) gives frames
    that its log, replayed alone, gives again bit for bit (tiny-random: batch mates move a plain
    engine's frames by a level here and there)."""
    worlds = {"tiny-random": from_name("tiny-random")}
    from sessions.events import FramesEvent

    async def main_() -> tuple[list[np.ndarray], SessionLog]:
        async with serving(worlds, default_model="tiny-random", deterministic=True, max_batch=4) as server:
            sockets = [await dial(server) for _ in range(4)]
            ids = []
            for i, ws in enumerate(sockets):
                await send(ws, m.Open(mode="lockstep", codec="raw", seed=20 + i))
                ids.append((await recv_until(ws, m.Ready))[-1].session_id)
            served: list[np.ndarray] = []
            for seq in range(4):
                for ws in sockets:  # all four outstanding together: one batch
                    await send(ws, step(seq, KEYS[seq]))
                got = [await recv(ws) for ws in sockets]
                served.append(got[0].data)
            status, body = await fetch(f"{server.url}/v1/sessions/{ids[0]}/log")
            assert status == 200
            for ws in sockets:
                await ws.close()
            return served, SessionLog.model_validate(json.loads(body))

    served, log = run(main_())
    assert log.deterministic_batch == 4
    replayed: list[np.ndarray] = []
    run(render(worlds, log, lambda e: replayed.append(e.frames) if isinstance(e, FramesEvent) else None))
    assert all(np.array_equal(a, b) for a, b in zip(replayed, served, strict=True)) and len(replayed) == 4
