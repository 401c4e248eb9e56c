"""Moves between replicas: one the control gave up (its take_over call failed or timed out) leaves
each session on one replica only (`Replica.discard` closes what the target restored and makes a
take_over still under way drop the rest), and a moved session keeps its client's codec. A
replica here is the actor's class around a real server, no Ray."""

from __future__ import annotations

import asyncio
from typing import get_args

from tests.web.conftest import dial, recv, send, serving
from web import messages as m
from web.cluster.replica import Replica
from web.hub import CODECS, ServerConfig


def replica_on(server) -> Replica:
    replica = Replica("replica-1", [], ServerConfig(), b"k" * 32)
    replica.server = server
    return replica


async def handed_over(server, count: int) -> dict[str, bytes]:
    for seed in range(count):
        ws = await dial(server)
        await send(ws, m.Open(seed=seed, mode="lockstep", codec="raw"))
        assert isinstance(await recv(ws), m.Ready)
    return await replica_on(server).hand_over()


def test_a_discard_during_a_take_over_leaves_no_session_on_the_target(worlds) -> None:
    async def main() -> None:
        async with serving(worlds) as source, serving(worlds) as target:
            handed = await handed_over(source, 3)
            replica = replica_on(target)
            moving = asyncio.create_task(replica.take_over(handed))
            await asyncio.sleep(0)  # the take_over is under way (its first restore has begun)
            await replica.discard(list(handed))
            assert await moving == []
            assert [s.id for s in target.manager.sessions() if not s.status.is_finished] == []
            source.keep(list(handed))  # and they go on where they were
            assert sorted(s.id for s in source.manager.sessions() if not s.status.is_finished) == sorted(
                handed
            )

    asyncio.run(main())


def test_a_discard_after_a_take_over_closes_what_it_restored(worlds) -> None:
    async def main() -> None:
        async with serving(worlds) as source, serving(worlds) as target:
            handed = await handed_over(source, 2)
            replica = replica_on(target)
            assert sorted(await replica.take_over(handed)) == sorted(handed)
            await replica.discard(list(handed))
            assert [s.id for s in target.manager.sessions() if not s.status.is_finished] == []
            assert await replica.take_over(handed) == []  # a late retry of the same move: refused

    asyncio.run(main())


def test_a_moved_session_resumed_naming_no_codec_keeps_its_clients_codec(worlds) -> None:
    """As on one server, a resume that names no codec gets the codec the session was attached
    with, also after a drain or a failover moved it (its snapshot carries it; it was jpeg, the
    default, before)."""

    async def main() -> None:
        async with serving(worlds) as source, serving(worlds) as target:
            ws = await dial(source)
            await send(ws, m.Open(seed=3, mode="lockstep", codec="raw"))
            ready = await recv(ws)
            assert isinstance(ready, m.Ready)
            handed = await replica_on(source).hand_over()
            assert await replica_on(target).take_over(handed) == list(handed)
            source.let_go(list(handed))
            back = await dial(target, f"?resume={ready.resume_token}")
            again = await recv(back)
            assert isinstance(again, m.Ready) and again.codec.name == "raw"
            await send(back, m.Step(seq=0, actions=[m.FrameAction(keys=("d",))]))
            frames = await recv(back)
            assert isinstance(frames, m.Frames) and frames.codec == "raw"

    asyncio.run(main())


def test_a_session_resumed_after_a_restart_naming_no_codec_keeps_its_clients_codec(worlds, tmp_path) -> None:
    """The same across a restart of one server with a state directory (the saved session's
    snapshot carries the codec; PROTOCOL.md: "default: the codec the session had")."""

    async def main() -> None:
        async with serving(worlds, state_dir=tmp_path) as first:
            ws = await dial(first)
            await send(ws, m.Open(seed=3, mode="lockstep", codec="raw"))
            ready = await recv(ws)
            assert isinstance(ready, m.Ready)
        async with serving(worlds, state_dir=tmp_path) as second:
            back = await dial(second, f"?resume={ready.resume_token}")
            again = await recv(back)
            assert isinstance(again, m.Ready) and again.codec.name == "raw"

    asyncio.run(main())


def test_the_hubs_codec_names_are_the_protocols() -> None:
    assert get_args(m.Codec) == CODECS
