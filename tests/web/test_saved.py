"""Over the wire: a server stopped with a state directory saves its sessions and the next one
restores them (resume tokens keep working, frames continue bit for bit); `snapshot` / `restore`
save games; damaged or foreign save games are refused with a clear error."""

from __future__ import annotations

import asyncio

import numpy as np
from websockets.exceptions import ConnectionClosed

from tests.web.conftest import dial, recv, recv_until, run, send, serving
from web import messages as m

W = m.FrameAction(keys=("w",))
D = m.FrameAction(keys=("d",))
SCRIPT = [[W], [D], [W], [D]]


async def _open(server, seed: int, model: str = "tiny"):
    ws = await dial(server)
    await send(ws, m.Open(model=model, seed=seed, mode="lockstep", codec="raw"))
    ready = await recv(ws)
    assert isinstance(ready, m.Ready), ready
    return ws, ready


async def _step(ws, seq: int, actions) -> m.Frames:
    await send(ws, m.Step(seq=seq, actions=actions))
    (frames,) = [x for x in await recv_until(ws, m.Frames) if isinstance(x, m.Frames)]
    await send(ws, m.Ack(chunk=frames.chunk))
    return frames


async def _closed_code(ws) -> tuple[int | None, list]:
    seen = []
    try:
        while True:
            seen.append(await recv(ws, timeout=30))
    except ConnectionClosed as exc:
        return exc.rcvd.code if exc.rcvd is not None else None, seen


async def _reference(worlds, model: str, seed: int) -> list[np.ndarray]:
    async with serving(worlds) as server:
        ws, _ = await _open(server, seed, model)
        return [(await _step(ws, i, a)).data for i, a in enumerate(SCRIPT)]


def test_a_stopped_server_saves_its_sessions_and_the_next_one_resumes_them(worlds, tmp_path) -> None:
    async def main():
        cases = {"live": ("tiny", 3), "detached": ("tiny-image", 5)}
        tokens = {}
        async with serving(worlds, state_dir=tmp_path) as server:
            sockets = {}
            for name, (model, seed) in cases.items():
                ws, ready = await _open(server, seed, model)
                for i, a in enumerate(SCRIPT[:2]):
                    await _step(ws, i, a)
                tokens[name] = ready
                sockets[name] = ws
            await sockets["detached"].close()  # a close frame but no `close` message: detached
            await asyncio.sleep(0.2)
        code, seen = await _closed_code(sockets["live"])
        assert code == 1001 and not any(isinstance(x, m.Closed) for x in seen)  # no `closed`: resumable
        assert len(list(tmp_path.glob("*.safetensors"))) == 2
        async with serving(worlds, state_dir=tmp_path) as server:
            for name, (model, seed) in cases.items():
                ready = tokens[name]
                ws = await dial(server, f"?resume={ready.resume_token}&codec=raw")
                again = await recv(ws)
                assert isinstance(again, m.Ready) and again.session_id == ready.session_id
                assert again.chunk == 2 and again.resume_token == ready.resume_token
                got = [(await _step(ws, i, a)).data for i, a in enumerate(SCRIPT[2:], start=2)]
                want = (await _reference(worlds, model, seed))[2:]
                for x, y in zip(want, got, strict=True):
                    assert np.array_equal(x, y)
            assert not list(tmp_path.glob("*.safetensors"))  # restored entries leave the directory

    run(main())


def test_a_damaged_save_is_refused_by_name_and_the_others_restore(worlds, tmp_path, caplog) -> None:
    async def main():
        async with serving(worlds, state_dir=tmp_path) as server:
            a, ready_a = await _open(server, 1)
            b, ready_b = await _open(server, 2)
            for ws in (a, b):
                await _step(ws, 0, [W])
        path = tmp_path / f"{ready_a.session_id}.safetensors"
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x55
        path.write_bytes(bytes(data))
        with caplog.at_level("ERROR"):
            async with serving(worlds, state_dir=tmp_path) as server:
                gone = await dial(server, f"?resume={ready_a.resume_token}")
                err = await recv(gone)
                assert isinstance(err, m.Error) and err.code == "not_found"
                ws = await dial(server, f"?resume={ready_b.resume_token}&codec=raw")
                assert (await recv(ws)).session_id == ready_b.session_id
                assert (await _step(ws, 1, [D])).chunk == 2
        assert any(ready_a.session_id in r.message and "sha256" in r.message for r in caplog.records)
        assert (tmp_path / "refused" / f"{ready_a.session_id}.safetensors").exists()

    run(main())


def test_a_save_game_restores_as_a_new_session_that_continues_exactly(v1) -> None:
    async def main():
        async with v1() as server:
            ws, ready = await _open(server, 7, "tiny-image")
            for i, a in enumerate(SCRIPT[:2]):
                await _step(ws, i, a)
            await send(ws, m.Snapshot(seq=10))
            saved = await recv(ws)
            assert isinstance(saved, m.Saved) and saved.seq == 10 and saved.chunk == 2
            want = [(await _step(ws, i, a)).data for i, a in enumerate(SCRIPT[2:], start=2)]

            other = await dial(server)
            await send(other, m.Restore(data=saved.data, codec="raw"))
            back = await recv(other)
            assert isinstance(back, m.Ready) and back.session_id != ready.session_id
            assert back.resume_token != ready.resume_token and back.chunk == 2 and back.frame is not None
            got = [(await _step(other, i, a)).data for i, a in enumerate(SCRIPT[2:])]
            for x, y in zip(want, got, strict=True):
                assert np.array_equal(x, y)

            damaged = await dial(server)
            await send(damaged, m.Restore(data=saved.data[:-7] + bytes(7)))
            err = await recv(damaged)
            assert isinstance(err, m.Error) and err.code == "invalid_field" and err.fatal
            assert "damaged" in err.message and err.message.startswith("data:")
            await send(ws, m.Step(seq=9, actions=[m.FrameAction()]))  # the others go on
            assert isinstance(await recv(ws), m.Frames)

    run(main())


def test_a_save_game_past_the_cap_is_too_large_and_the_session_goes_on(worlds) -> None:
    async def main():
        async with serving(worlds, max_snapshot=1000) as server:
            ws, _ = await _open(server, 1)
            await _step(ws, 0, [W])
            await send(ws, m.Snapshot(seq=3))
            err = await recv(ws)
            assert isinstance(err, m.Error) and err.code == "too_large" and not err.fatal and err.seq == 3
            assert (await _step(ws, 4, [D])).chunk == 2

    run(main())


def test_only_a_restore_may_exceed_the_message_limit(worlds) -> None:
    async def main():
        async with serving(worlds, max_message=4096, max_snapshot=1 << 20) as server:
            ws = await dial(server)
            await send(ws, m.Open(seed=1, image=np.zeros((64, 64, 3), np.uint8)))  # 12 KiB
            err = await recv(ws)
            assert isinstance(err, m.Error) and err.code == "too_large" and err.fatal
            live, _ = await _open(server, 2)
            await _step(live, 0, [W])
            await send(live, m.Snapshot(seq=1))
            saved = await recv(live)
            assert isinstance(saved, m.Saved) and len(saved.data) > 4096
            other = await dial(server)
            await send(other, m.Restore(data=saved.data))
            assert isinstance(await recv(other), m.Ready)  # a save game past the message limit

    run(main())


def test_a_resume_brings_an_offloaded_session_back_and_busy_only_when_nothing_can_move(worlds) -> None:
    from runtime.memory import budget_for, world_costs

    one = budget_for({n: world_costs(w, 0) for n, w in worlds.items()}, 1)  # no rewind history (retention=0)

    async def main():
        async with serving(worlds, device_memory=one, host_memory=1 << 30, retention=0) as server:
            a, ready_a = await _open(server, 1)
            first = await _step(a, 0, [W])
            a.transport.abort()  # detached
            await asyncio.sleep(0.2)
            b, _ = await _open(server, 2)  # the device holds one: a moves to host memory
            assert server.manager.offloaded(server.manager.by_token(ready_a.resume_token)) == "host"
            metrics = await asyncio.to_thread(_get, server.url + "/metrics")
            assert 'worldserve_sessions_by_residence{where="host"} 1.0' in metrics
            busy = await dial(server, f"?resume={ready_a.resume_token}")
            err = await recv(busy)  # b is attached: nothing can leave the device
            assert isinstance(err, m.Error) and err.code == "busy" and err.fatal
            await send(b, m.Close())
            await recv_until(b, m.Closed)
            again = await dial(server, f"?resume={ready_a.resume_token}&codec=raw")
            back = await recv(again)
            assert isinstance(back, m.Ready) and back.chunk == first.chunk
            assert (await _step(again, 1, [D])).chunk == 2

    run(main())


def _get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()


def test_the_sdk_keeps_a_save_game_and_opens_it_again(worlds) -> None:
    from web.sdk import connect, restore

    async def main():
        async with serving(worlds) as server:
            async with connect(server.url, seed=6, mode="lockstep", codec="raw") as s:
                await s.step({"keys": ["w"]})
                data = await s.snapshot()
                want = await s.step({"keys": ["d"]})
            copy = await restore(server.url, data, codec="raw")
            try:
                assert copy.ready.chunk == 1
                assert np.array_equal(await copy.step({"keys": ["d"]}), want)
            finally:
                await copy.close()

    run(main())


def test_the_sync_client_keeps_a_save_game_and_opens_it_again(worlds) -> None:
    from web.sdk import Client

    async def main():
        async with serving(worlds) as server:

            def play() -> None:
                with Client(server.url, seed=6) as world:
                    world.step({"keys": ["w"]})
                    data = world.snapshot()
                    want = world.step({"keys": ["d"]})
                with Client(server.url, restore=data) as copy:
                    assert copy.ready.chunk == 1
                    assert np.array_equal(copy.step({"keys": ["d"]}), want)

            await asyncio.to_thread(play)

    run(main())
