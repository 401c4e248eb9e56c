"""Sessions saved to a state directory and brought back by another manager (a restart), and save
games (`snapshot` bytes opened as a new session): each continues as if never interrupted."""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pytest

from models.actions import FrameAction
from sessions.errors import InvalidInput, RateLimited, SessionNotFound
from sessions.events import FramesEvent
from sessions.manager import OpenParams
from sessions.session import SessionStatus
from sessions.store import StateStore
from tests.sessions.conftest import Inbox, running

STEPS = [[FrameAction(frozenset(k))] if k else [] for k in ({"w"}, {"d"}, set(), {"a"})]


async def _steps(session, inbox: Inbox, steps, first_seq: int = 0) -> list[FramesEvent]:
    have = len(inbox.of(FramesEvent))
    for i, actions in enumerate(steps):
        session.step(first_seq + i, actions)
    return (await inbox.wait_for(FramesEvent, have + len(steps)))[have:]


async def _reference(worlds, model: str, seed: int) -> list[np.ndarray]:
    async with running(worlds) as m:
        s = await m.open(OpenParams(model=model, seed=seed, mode="lockstep"))
        inbox = Inbox()
        s.activate(inbox)
        return [e.frames for e in await _steps(s, inbox, STEPS)]


def test_a_restart_restores_every_session_and_its_token(worlds, tmp_path):
    async def main():
        store = StateStore(tmp_path)
        tokens = {}
        async with running(worlds) as m:
            for model, seed in (("tiny", 3), ("tiny-image", 4)):
                s = await m.open(OpenParams(model=model, seed=seed, mode="lockstep"))
                inbox = Inbox()
                s.activate(inbox)
                first = await _steps(s, inbox, STEPS[:2])
                s.ack(1)  # chunk 2 stays unacked: a resume after the restart sends it again
                tokens[model] = (s.id, s.resume_token, s.last_chunk, s.frames_out, first[1].frames)
            m.by_token(tokens["tiny"][1]).detach()  # one detached, one attached
            rt = await m.open(OpenParams(seed=9))  # realtime: chunks in flight are cancelled
            rt.activate(Inbox())
            saved, missed = await m.persist(store, timeout_s=60)
            assert sorted(saved) == sorted([t[0] for t in tokens.values()] + [rt.id]) and not missed
        assert not any(tmp_path.glob("*token*")) and all(
            t[1] not in p.read_text(errors="ignore") for p in tmp_path.glob("*.json") for t in tokens.values()
        )  # the tokens are not on disk
        async with running(worlds) as m:
            restored, refused = await m.restore_saved(store)
            assert len(restored) == 3 and not refused and not store.entries()
            for model, (sid, token, last, frames_out, unacked) in tokens.items():
                s = m.by_token(token)
                assert (s.id, s.status) == (sid, SessionStatus.DETACHED)
                assert (s.last_chunk, s.frames_out) == (last, frames_out)
                inbox = Inbox()
                (again,) = s.activate(inbox)
                assert again.chunk == 2 and again.resent and np.array_equal(again.frames, unacked)
                got = [e.frames for e in await _steps(s, inbox, STEPS[2:], first_seq=2)]
                assert [e.chunk for e in inbox.of(FramesEvent)] == [last + 1, last + 2]
                want = (await _reference(worlds, model, 3 if model == "tiny" else 4))[2:]
                for x, y in zip(want, got, strict=True):
                    assert np.array_equal(x, y)
            with pytest.raises(SessionNotFound):
                m.by_token("not-a-token")

    asyncio.run(main())


def test_a_damaged_or_foreign_save_is_refused_and_the_others_restore(worlds, tmp_path):
    async def main():
        store = StateStore(tmp_path)
        async with running(worlds) as m:
            a, b = await m.open(OpenParams(mode="lockstep")), await m.open(OpenParams(mode="lockstep"))
            for s in (a, b):
                inbox = Inbox()
                s.activate(inbox)
                await _steps(s, inbox, STEPS[:1])
            await m.persist(store, timeout_s=60)
        data = (tmp_path / f"{a.id}.safetensors").read_bytes()
        (tmp_path / f"{a.id}.safetensors").write_bytes(data[:-5] + bytes(5))
        async with running({"tiny-image": worlds["tiny-image"]}) as m:  # b's model is not loaded
            m.default_model = "tiny-image"
            restored, refused = await m.restore_saved(store)
            assert restored == [] and sorted(refused) == sorted([a.id, b.id])
        reasons = {p.name: p.read_text() for p in (tmp_path / "refused").glob("*.reason.txt")}
        assert "sha256" in reasons[f"{a.id}.reason.txt"]
        assert "not loaded" in reasons[f"{b.id}.reason.txt"]
        assert not store.entries()

    asyncio.run(main())


def test_a_save_game_opens_as_a_new_session_that_continues_exactly(worlds):
    async def main():
        async with running(worlds) as m:
            s = await m.open(OpenParams(model="tiny-image", seed=4, mode="lockstep"))
            inbox = Inbox()
            s.activate(inbox)
            await _steps(s, inbox, STEPS[:2])
            data, chunk = await m.snapshot(s)
            assert chunk == 2
            want = [e.frames for e in await _steps(s, inbox, STEPS[2:], first_seq=2)]
            copy = await m.restore(data)
            assert copy.id != s.id and copy.resume_token and copy.resume_token != s.resume_token
            assert copy.last_chunk == 2 and copy.mode == "lockstep" and m.by_token(copy.resume_token) is copy
            other = Inbox()
            copy.activate(other)
            got = [e.frames for e in await _steps(copy, other, STEPS[2:])]
            for x, y in zip(want, got, strict=True):
                assert np.array_equal(x, y)
            # The action log (replay) comes with the world: the copy's is the original's.
            assert await copy.action_log() == await s.action_log()
            assert (await copy.action_log())[0] == 1 and len((await copy.action_log())[1]) == len(STEPS)
            with pytest.raises(InvalidInput, match="damaged"):
                await m.restore(data[:100])

    asyncio.run(main())


def test_a_step_during_a_snapshot_is_rate_limited(worlds):
    async def main():
        async with running(worlds) as m:
            s = await m.open(OpenParams(mode="lockstep"))
            inbox = Inbox()
            s.activate(inbox)
            s.step(0, [])
            taking = asyncio.ensure_future(m.snapshot(s))
            await asyncio.sleep(0)
            with pytest.raises(RateLimited, match="snapshot"):
                s.step(1, [])
            await taking
            s.step(2, [])
            await inbox.wait_for(FramesEvent, 2)

    asyncio.run(main())


def test_a_running_oneshot_is_not_saved(worlds, tmp_path):
    async def main():
        async with running(worlds) as m:
            run = asyncio.ensure_future(m.generate(OpenParams(), [], 50, lambda ev: None))
            while not len(m):
                await asyncio.sleep(0.01)
            saved, missed = await m.persist(StateStore(tmp_path), timeout_s=30)
            assert saved == [] and missed == [] and not list(tmp_path.iterdir())
            run.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await run

    asyncio.run(main())


def test_sessions_not_saved_in_time_are_listed_in_the_log(worlds, tmp_path, caplog):
    async def main():
        async with running(worlds) as m:
            a, b = await m.open(OpenParams(mode="lockstep")), await m.open(OpenParams(mode="lockstep"))
            a.activate(Inbox())
            b.activate(Inbox())
            with caplog.at_level("WARNING"):
                saved, missed = await m.persist(StateStore(tmp_path), timeout_s=0)
            assert saved == [] and sorted(missed) == sorted([a.id, b.id])
            line = next(r.message for r in caplog.records if "not saved within" in r.message)
            assert a.id in line and b.id in line
            assert not StateStore(tmp_path).entries()

    asyncio.run(main())


def test_a_save_game_with_a_forged_session_record_is_refused_and_leaves_nothing(worlds):
    async def main():
        async with running(worlds) as m:
            s = await m.open(OpenParams(mode="lockstep"))
            s.activate(Inbox())
            rec, arrays = s.record()
            data = await m.engine.snapshot_stream(s.id, {**rec, "mode": "sideways"}, arrays)
            with pytest.raises(InvalidInput, match="mode"):
                await m.restore(data)
            await asyncio.sleep(0.1)  # the refused stream's removal runs on the engine thread
            assert len(m) == 1 and m.engine_bytes() == (await m.engine.info(s.id)).session_bytes

    asyncio.run(main())
