"""A local Ray cluster of two CPU tiny-world replicas behind one front end: sessions spread over
the replicas, a v1 client sees a single server (open, step, cancel, resume, a forged token), and
a drain moves a session with every chunk bit-identical to an uninterrupted run."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections import Counter, deque
from collections.abc import Iterator

import numpy as np
import pytest

from tests.web.conftest import dial, recv, recv_until, send
from web import messages as m
from web.hub import ServerConfig

ray = pytest.importorskip("ray")

from tests.web.cluster_harness import Running  # noqa: E402
from web.cluster.control import Checkpoint, Cluster, NoRoom, ReplicaSpec  # noqa: E402  (needs ray)
from web.cluster.frontend import FrontEnd  # noqa: E402

W = m.FrameAction(keys=("w",))
D = m.FrameAction(keys=("d",), mouse=(1.0, -2.0))


@pytest.fixture(scope="module")
def running(ray_local: None) -> Iterator[Running]:
    config = ServerConfig(port=0, max_sessions=8)
    spec = ReplicaSpec(models=("tiny-world",), config=config, cpus=0.5)
    with Running(2, spec, config) as running:
        yield running


@pytest.fixture(scope="module")
def front(running: Running) -> FrontEnd:
    assert running.front is not None
    return running.front


def get(front: FrontEnd, path: str) -> dict:
    """GET a JSON path; an admin job's path (drain, remove, add) is waited for: its final state."""
    with urllib.request.urlopen(front.url + path, timeout=120) as reply:
        body = json.loads(reply.read())
    if reply.status != 202:
        return body
    while (state := get(front, body["job"]))["state"] == "running":
        time.sleep(0.1)
    assert state["state"] == "done", state
    return state


async def step_frames(ws, seq: int, actions: list[m.FrameAction]) -> np.ndarray:
    """The frames of chunk seq + 1 (chunks sent again after a resume are dropped, as clients do)."""
    await send(ws, m.Step(seq=seq, actions=actions))
    while True:
        msg = await recv(ws)
        if isinstance(msg, m.Frames) and msg.chunk == seq + 1:
            return np.asarray(msg.data)


def test_sessions_spread_and_a_v1_client_sees_one_server(front: FrontEnd) -> None:
    async def main() -> None:
        sockets, readies = [], []
        for seed in range(4):
            ws = await dial(front)
            await send(ws, m.Open(seed=seed, mode="lockstep", codec="raw"))
            readies.append(await recv(ws))
            sockets.append(ws)
        assert all(isinstance(r, m.Ready) and r.protocol == 1 for r in readies)
        per = sorted(int(r["sessions"]) for r in get(front, "/v1/cluster")["replicas"])
        assert per == [2, 2]  # placed by free device bytes: two each
        ws = sockets[0]
        got = await step_frames(ws, 0, [W])
        assert got.shape[0] > 0
        await send(ws, m.Cancel(seq=2))  # nothing in flight: answered at once with the next chunk
        cancelled = await recv(ws)
        assert isinstance(cancelled, m.Cancelled) and cancelled.chunk == 2
        await ws.close()
        again = await dial(front, f"?resume={readies[0].resume_token}")
        ready = await recv(again)
        assert isinstance(ready, m.Ready) and ready.session_id == readies[0].session_id and ready.chunk == 1
        for s in (again, *sockets[1:]):
            await send(s, m.Close())
            await recv_until(s, m.Closed)
            await s.close()

    asyncio.run(main())
    health = get(front, "/healthz")
    assert health["status"] == "ok" and health["replicas"] == 2 and health["capacity_sessions"] == 16
    with urllib.request.urlopen(front.url + "/metrics", timeout=120) as reply:
        text = reply.read().decode()
    assert 'replica="replica-0"' in text and 'replica="replica-1"' in text
    assert "worldserve_cluster_capacity_sessions 16" in text
    assert get(front, "/v1/models")[0]["id"] == "tiny-world"  # proxied to a replica


def test_the_sdk_steps_reconnects_forks_and_generates_through_the_front_end(front: FrontEnd) -> None:
    from web.errors import ErrorCode, ServerError
    from web.sdk import attach, connect, generate

    async def main() -> None:
        async with connect(front.url, seed=3, mode="lockstep", codec="raw") as ref:
            reference = [await ref.step({"keys": ["w"]}) for _ in range(4)]
        async with connect(front.url, seed=3, mode="lockstep", codec="raw") as s:
            assert np.array_equal(await s.step({"keys": ["w"]}), reference[0])
            assert (await s.cancel()).chunk == 2
            s._ws.transport.abort()  # the network drops
            await asyncio.sleep(0.2)
            assert (await s.reconnect()).chunk == 1
            assert np.array_equal(await s.step({"keys": ["w"]}), reference[1])
            name = s.ready.resume_token.split(".")[0]
            await asyncio.to_thread(get, front, f"/v1/cluster/drain?replica={name}")  # moved meanwhile
            assert np.array_equal(await s.step({"keys": ["w"]}), reference[2])
            token = await s.fork()
            async with attach(front.url, token, codec="raw") as f:
                assert f.ready.chunk == 3 and np.array_equal(await f.step({"keys": ["w"]}), reference[3])
            await front.cluster._call(name, "undrain")
        g = await generate(front.url, chunks=2, actions=[{"keys": ["w"]}] * 2, seed=3, codec="raw")
        assert np.array_equal(g.frames, np.concatenate(reference[:2])) and g.done.chunks == 2
        with pytest.raises(ServerError) as info:
            await generate(front.url, chunks=1, model="nope")
        assert info.value.code is ErrorCode.NOT_FOUND and info.value.fatal

    asyncio.run(main())


def test_a_forged_or_altered_token_is_not_found(front: FrontEnd) -> None:
    async def main() -> None:
        ws = await dial(front)
        await send(ws, m.Open(seed=1, mode="lockstep", codec="raw"))
        token = (await recv(ws)).resume_token
        replica, rand, mac = token.split(".")
        other = "replica-1" if replica == "replica-0" else "replica-0"
        for bad in (f"{other}.{rand}.{mac}", f"{replica}.{rand[::-1]}.{mac}", "anything"):
            probe = await dial(front, f"?resume={bad}")
            error = await recv(probe)
            assert isinstance(error, m.Error) and error.code == "not_found" and error.fatal
            await probe.wait_closed()
            assert probe.close_code == 4404 or probe.close_code >= 1000
        await send(ws, m.Close())
        await recv_until(ws, m.Closed)

    asyncio.run(main())


def test_drain_moves_a_session_with_every_chunk_bit_identical(front: FrontEnd) -> None:
    script = [[W], [D], [W, D, W, D], [D], [W], [D, D, W, W]]

    async def run(drain_after: int | None) -> tuple[list[np.ndarray], int]:
        ws = await dial(front)
        await send(ws, m.Open(seed=7, mode="lockstep", codec="raw"))
        ready = await recv(ws)
        replica = ready.resume_token.split(".")[0]
        frames, readies = [], 0
        for i, actions in enumerate(script):
            if i == drain_after:
                report = await asyncio.to_thread(get, front, f"/v1/cluster/drain?replica={replica}")
                assert list(report["moved"].values()) == [
                    "replica-1" if replica == "replica-0" else "replica-0"
                ]
            await send(ws, m.Step(seq=i, actions=actions))
            while len(frames) < i + 1:  # after a resume, unacked chunks come again: dropped
                msg = await recv(ws)
                readies += isinstance(msg, m.Ready)
                if isinstance(msg, m.Frames) and msg.chunk == len(frames) + 1:
                    frames.append(np.asarray(msg.data))
        await send(ws, m.Close())
        await recv_until(ws, m.Closed)
        return frames, readies

    async def main() -> None:
        plain, plain_readies = await run(None)
        moved, moved_readies = await run(3)
        assert plain_readies == 0 and moved_readies == 1  # the client saw one resume-like `ready`
        assert len(plain) == len(moved) == len(script)
        for a, b in zip(plain, moved, strict=True):
            assert np.array_equal(a, b)
        for name in front.cluster.replicas:
            await front.cluster._call(name, "undrain")

    asyncio.run(main())


def test_a_realtime_session_streams_on_through_a_drain_with_no_chunk_missing(front: FrontEnd) -> None:
    async def main() -> None:
        ws = await dial(front)
        await send(ws, m.Open(seed=5, mode="realtime", codec="jpeg", max_ahead=2))
        ready = await recv(ws)
        replica = ready.resume_token.split(".")[0]
        chunks: list[int] = []
        readies = 0
        drain = None
        while len(chunks) < 10:
            msg = await recv(ws)
            readies += isinstance(msg, m.Ready)
            if isinstance(msg, m.Frames):
                if msg.chunk not in chunks:
                    chunks.append(msg.chunk)
                await send(ws, m.Ack(chunk=msg.chunk))
                await send(ws, m.Action(seq=msg.chunk, keys=("w",)))
                if len(chunks) == 3 and drain is None:
                    drain = asyncio.create_task(
                        asyncio.to_thread(get, front, f"/v1/cluster/drain?replica={replica}")
                    )
        report = await drain
        assert len(report["moved"]) == 1 and readies == 1
        assert chunks == list(range(1, 11))  # none missing, none twice
        await send(ws, m.Close())
        await recv_until(ws, m.Closed)
        await front.cluster._call(replica, "undrain")

    asyncio.run(main())


def test_a_replica_is_added_and_removed_while_serving(front: FrontEnd) -> None:
    async def main() -> None:
        added = (await asyncio.to_thread(get, front, "/v1/cluster/add"))["replica"]
        assert added == "replica-2"
        sockets = []
        for seed in range(3):
            ws = await dial(front)
            await send(ws, m.Open(seed=seed, mode="lockstep", codec="raw"))
            assert isinstance(await recv(ws), m.Ready)
            sockets.append(ws)
        loads = (await asyncio.to_thread(get, front, "/v1/cluster"))["replicas"]
        assert sorted((x["name"], x["sessions"]) for x in loads) == [
            ("replica-0", 1),
            ("replica-1", 1),
            ("replica-2", 1),
        ]
        report = await asyncio.to_thread(get, front, f"/v1/cluster/remove?replica={added}")
        assert len(report["moved"]) == 1 and not report["kept"]
        assert sorted(front.cluster.replicas) == ["replica-0", "replica-1"]
        for ws in sockets:
            assert (await step_frames(ws, 0, [W])).shape[0] > 0  # the moved one too
            await send(ws, m.Close())
            await recv_until(ws, m.Closed)

    asyncio.run(main())


def test_a_replica_with_no_room_is_refused_at_once(front: FrontEnd) -> None:
    greedy = Cluster(ReplicaSpec(models=("tiny-world",), config=ServerConfig(), cpus=1000.0), b"k" * 32)
    with pytest.raises(NoRoom, match="1000 CPU"):
        asyncio.run(greedy.add())
    assert greedy.replicas == {}


def test_a_dead_replicas_session_resumes_elsewhere_from_its_checkpoint(front: FrontEnd) -> None:
    script = [[W], [D], [W, D, W, D], [D], [W]]

    async def main() -> None:
        plain = []
        ws = await dial(front)
        await send(ws, m.Open(seed=11, mode="lockstep", codec="raw"))
        await recv(ws)
        for i, actions in enumerate(script):
            plain.append(await step_frames(ws, i, actions))
        await send(ws, m.Close())
        await recv_until(ws, m.Closed)

        ws = await dial(front)
        await send(ws, m.Open(seed=11, mode="lockstep", codec="raw"))
        ready = await recv(ws)
        got = [await step_frames(ws, i, actions) for i, actions in enumerate(script[:3])]
        while getattr(front.cluster.vault.get(ready.session_id), "chunk", 0) < 3:
            await asyncio.sleep(0.1)  # checkpointed at chunk 3
        name = ready.resume_token.split(".")[0]
        ray.kill(front.cluster.replicas[name], no_restart=True)
        again = await recv(ws)  # the relay found the session on the other replica
        assert isinstance(again, m.Ready) and again.chunk == 3 and again.session_id == ready.session_id
        got += [await step_frames(ws, i, actions) for i, actions in enumerate(script[3:], start=3)]
        for a, b in zip(plain, got, strict=True):
            assert np.array_equal(a, b)
        # The dead replica comes back under its name, empty, and the next new session goes
        # there (the failed-over one still lives on the other).
        deadline = time.monotonic() + 120
        while name not in front.cluster.replicas:
            assert time.monotonic() < deadline, "the dead replica was not restarted"
            await asyncio.sleep(0.2)
        loads = {x["name"]: x for x in (await asyncio.to_thread(get, front, "/v1/cluster"))["replicas"]}
        assert sorted(loads) == ["replica-0", "replica-1"] and loads[name]["sessions"] == 0
        fresh = await dial(front)
        await send(fresh, m.Open(seed=2, mode="lockstep", codec="raw"))
        assert (await recv(fresh)).resume_token.split(".")[0] == name
        assert (await step_frames(fresh, 0, [W])).shape[0] > 0
        for s in (ws, fresh):
            await send(s, m.Close())
            await recv_until(s, m.Closed)

    asyncio.run(main())


def test_a_replica_that_dies_in_a_loop_is_restarted_a_bounded_number_of_times(
    running: Running, caplog: pytest.LogCaptureFixture
) -> None:
    assert running.front is not None
    cluster = running.front.cluster
    name = sorted(cluster.replicas)[-1]
    for _ in range(cluster.spec.restarts):  # as if it had died this often within the window
        cluster._crashes.setdefault(name, deque()).append(time.monotonic())

    async def kill() -> None:
        ray.kill(cluster.replicas[name], no_restart=True)
        # ray.kill returns before the actor is gone: until then it still answers `load` (alive),
        # as a relay's or the checkpoint round's next suspicion would find it later.
        for _ in range(100):
            await cluster.suspect(name)
            if name not in cluster.replicas:
                return
            await asyncio.sleep(0.1)

    with caplog.at_level("ERROR", logger="web.cluster.control"):
        running.call(kill())
    assert name not in cluster.replicas and name not in cluster._restarting
    assert any("not restarted" in r.getMessage() for r in caplog.records)
    # Back as before for the tests after this one (`_restart` waits for Ray to free the name).
    running.call(cluster._restart(name))
    assert name in cluster.replicas
    cluster._crashes.pop(name)


def test_thirty_two_sessions_spread_over_the_replicas_and_each_steps(cluster_front: Running) -> None:
    """The issue's load: 32 sessions opened at once through one front end on two replicas (24
    sessions each) are spread over both, and every one steps."""
    front = cluster_front.front
    assert front is not None
    names = sorted(front.cluster.replicas)

    async def one(seed: int) -> tuple[str, np.ndarray]:
        ws = await dial(front)
        await send(ws, m.Open(seed=seed, mode="lockstep", codec="raw"))
        ready = await recv(ws)
        assert isinstance(ready, m.Ready), ready
        frames = await step_frames(ws, 0, [W])
        await send(ws, m.Close())
        await recv_until(ws, m.Closed)
        return ready.resume_token.split(".")[0], frames

    async def main() -> list[tuple[str, np.ndarray]]:
        return await asyncio.gather(*(one(seed) for seed in range(32)))

    got = asyncio.run(main())
    per = Counter(name for name, _ in got)
    assert sorted(per) == names and min(per.values()) >= 8, per
    assert all(frames.shape == (3, 32, 32, 3) for _, frames in got)


def test_a_fork_its_replica_has_no_room_for_is_made_on_another_with_the_same_frames(
    front: FrontEnd,
) -> None:
    script = [[W], [D], [W, D, W, D], [D], [W]]

    async def fork_frames(ws, seq: int) -> tuple[str, list[np.ndarray]]:
        await send(ws, m.Fork(seq=seq))
        forked = (await recv_until(ws, m.Forked))[-1]
        copy = await dial(front, f"?resume={forked.resume_token}&codec=raw")
        ready = await recv(copy)
        assert isinstance(ready, m.Ready) and ready.chunk == 2 and ready.session_id == forked.session_id
        frames = [await step_frames(copy, i, a) for i, a in enumerate(script[2:], start=2)]
        await send(copy, m.Close())
        await recv_until(copy, m.Closed)
        return forked.resume_token.split(".")[0], frames

    async def load(name: str) -> dict:
        loads = (await asyncio.to_thread(get, front, "/v1/cluster"))["replicas"]
        return next(x for x in loads if x["name"] == name)

    async def main() -> None:
        ws = await dial(front)
        await send(ws, m.Open(seed=7, mode="lockstep", codec="raw"))
        home = (await recv(ws)).resume_token.split(".")[0]
        for i, actions in enumerate(script[:2]):
            await step_frames(ws, i, actions)
        where, same = await fork_frames(ws, 10)  # room at home: a fork there
        assert where == home
        others: dict[str, list] = {}
        while (await load(home))["sessions"] < 8:  # fill its replica (the others fill too)
            filler = await dial(front)
            await send(filler, m.Open(seed=1, mode="lockstep", codec="raw"))
            others.setdefault((await recv(filler)).resume_token.split(".")[0], []).append(filler)
        other = "replica-1" if home == "replica-0" else "replica-0"
        if (await load(other))["sessions"] >= 8:  # make room for the fork there
            await send(others[other].pop(), m.Close())
            while (await load(other))["sessions"] >= 8:
                await asyncio.sleep(0.05)
        where, moved = await fork_frames(ws, 11)  # no room at home: state copied to the other
        assert where == other
        for a, b in zip(same, moved, strict=True):
            assert np.array_equal(a, b)
        for s in (ws, *(f for fs in others.values() for f in fs)):
            await send(s, m.Close())
            await recv_until(s, m.Closed)

    asyncio.run(main())


def test_placement_goes_where_there_is_room_when_pending_placements_fill_every_replica() -> None:
    """A session placed on replica-1 is in its figures before its `ready` settled it: counted
    twice, replica-1 looks full, yet it is the only one with room."""
    cluster = Cluster(ReplicaSpec(models=(), config=ServerConfig()), b"k" * 32)
    figures = {"max_sessions": 16, "session_bytes": 100, "used_bytes": 0, "draining": False, "dead": False}
    loads = [
        {**figures, "name": "replica-0", "sessions": 16, "free_bytes": 900},
        {**figures, "name": "replica-1", "sessions": 15, "free_bytes": 500},
    ]

    async def answered() -> list[dict]:
        return loads

    cluster.loads = answered  # type: ignore[method-assign]
    cluster._pending["replica-1"] = 1
    assert asyncio.run(cluster.place()) == "replica-1"


class FakeReplica:
    """A replica handle whose methods answer as `Replica`'s do through Ray (``.remote`` returns
    an awaitable), recording what it was asked."""

    def __init__(self, name: str, engine_dead: bool) -> None:
        self.name, self.engine_dead, self.taken = name, engine_dead, {}

        async def load() -> dict:
            figures = {"max_sessions": 16, "session_bytes": 100, "used_bytes": 0, "draining": False}
            return {**figures, "name": name, "sessions": 1, "free_bytes": 900, "dead": self.engine_dead}

        async def checkpoints(since: dict) -> tuple | None:
            return None if self.engine_dead else ([], {})

        async def take_over(batch: dict) -> list[str]:
            self.taken.update(batch)
            return list(batch)

        for method in (load, checkpoints, take_over):
            setattr(self, method.__name__, type("Method", (), {"remote": staticmethod(method)})())


def test_a_replica_whose_engine_thread_died_fails_over_and_is_restarted() -> None:
    """Its process lives, so Ray sees nothing wrong: the checkpoint round hears the engine died,
    and its sessions come back on another replica from their checkpoints, as for a dead process,
    and the replica is started again."""
    cluster = Cluster(ReplicaSpec(models=(), config=ServerConfig()), b"k" * 32)
    broken, healthy = FakeReplica("replica-0", engine_dead=True), FakeReplica("replica-1", engine_dead=False)
    cluster.replicas = {"replica-0": broken, "replica-1": healthy}  # type: ignore[dict-item]
    cluster.vault["s1"] = Checkpoint("replica-0", 6, b"snapshot")
    restarted: list[str] = []

    async def add(name: str | None = None) -> str:
        restarted.append(str(name))
        return str(name)

    async def loads() -> list[dict]:
        return [await r.load.remote() for r in cluster.replicas.values()]  # type: ignore[attr-defined]

    cluster.add = add  # type: ignore[method-assign]
    cluster.loads = loads  # type: ignore[method-assign]

    async def main() -> None:
        await cluster.checkpoint("replica-1")  # a healthy replica's round changes nothing
        assert set(cluster.replicas) == {"replica-0", "replica-1"} and healthy.taken == {}
        await cluster.checkpoint("replica-0")
        while cluster._restarting:
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert healthy.taken == {"s1": b"snapshot"}
    assert cluster.vault["s1"].replica == "replica-1"
    assert restarted == ["replica-0"]
