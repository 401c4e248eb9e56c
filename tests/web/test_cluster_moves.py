"""A move the control gave up (its take_over call failed or timed out) leaves each session on
one replica only: `Replica.discard` closes what the target restored and makes a take_over still
under way drop the rest. A replica here is the actor's class around a real server, no Ray."""

from __future__ import annotations

import asyncio

from tests.web.conftest import dial, recv, send, serving
from web import messages as m
from web.cluster.replica import Replica
from web.hub import ServerConfig


def replica_on(server) -> Replica:
    replica = Replica("replica-1", [], ServerConfig(), b"k" * 32)
    replica.server = server
    return replica


async def handed_over(server, count: int) -> dict[str, bytes]:
    for seed in range(count):
        ws = await dial(server)
        await send(ws, m.Open(seed=seed, mode="lockstep", codec="raw"))
        assert isinstance(await recv(ws), m.Ready)
    return await server.hand_over()


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
