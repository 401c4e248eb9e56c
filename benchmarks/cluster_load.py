"""Cluster load (issue 44, item 5): K sessions over R CPU replicas on Ray behind one front end,
against the same K sessions on one in-process `serve`.

    python benchmarks/cluster_load.py [--model tiny-world] [--sessions 4] [--replicas 2]
                                      [--steps 8] [--seconds 6] [--out FILE]

Runs, each on a fresh server: `single` (one in-process server), `cluster-1` (one replica: the
same engine work as `single`, so the difference is the front end's extra hop) and `cluster-R`.
Each run measures
- lockstep: K clients step in parallel, each awaiting its frames before its next step: step ->
  frames latency p50/p99 and chunks/s per session;
- realtime: K clients act at 20 Hz and ack every chunk: frames/s per session and action ->
  first frame that applied it, p50/p99;
- ping -> pong through the front end and, for the cluster, straight to a replica (the bare
  cost of the hop, no engine work);
- placement: sessions per replica after the K opens;
- drain (R > 1): seconds to move the busiest replica's sessions, and until the last moved client
  has its `ready`.
Besides: the round trip of a Ray actor call carrying one raw tiny-world chunk (4x64x64x3 bytes),
the cost a frame would pay per chunk if the front end pulled frames by actor calls instead.

Every replica and the single server run their engine on one torch thread. This machine has 2 CPU
cores shared with other jobs: R replicas compete for them, so the cluster's absolute throughput
here says little; the hop's cost (cluster-1 vs single, ping) is what carries over to GPUs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from web import codec as wire
from web import messages as m
from web.hub import ServerConfig

if TYPE_CHECKING:
    from web.cluster.control import Cluster

RESULTS = Path(__file__).parent / "results"
KEYS = ["w", "d", "s", "a"]


async def dial(url: str, query: str = "") -> ClientConnection:
    return await ws_connect(url + query, proxy=None, compression=None, max_size=None)


async def recv(ws: ClientConnection) -> m.ServerMessage:
    return wire.parse_server(await asyncio.wait_for(ws.recv(), 120))


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return round(float(np.percentile(values, q)), 2)


async def lockstep(url: str, seed: int, steps: int) -> tuple[list[float], float]:
    """Step -> frames latencies (ms) and the chunks per second of one lockstep session."""
    ws = await dial(url)
    await ws.send(wire.encode(m.Open(seed=seed, mode="lockstep", codec="jpeg")))
    assert isinstance(await recv(ws), m.Ready)
    lat: list[float] = []
    start = time.perf_counter()
    for i in range(steps):
        sent = time.perf_counter()
        await ws.send(wire.encode(m.Step(seq=i, actions=[m.FrameAction(keys=(KEYS[(seed + i) % 4],))])))
        while not isinstance(msg := await recv(ws), m.Frames):
            pass
        lat.append((time.perf_counter() - sent) * 1000)
        await ws.send(wire.encode(m.Ack(chunk=msg.chunk)))
    rate = steps / (time.perf_counter() - start)
    await ws.send(wire.encode(m.Close()))
    await ws.close()
    return lat, rate


async def realtime(url: str, seed: int, seconds: float) -> tuple[list[float], float]:
    """Action -> first frames that applied it (ms), and frames per second, of one realtime session."""
    ws = await dial(url)
    await ws.send(wire.encode(m.Open(seed=seed, mode="realtime", codec="jpeg", max_ahead=2)))
    assert isinstance(await recv(ws), m.Ready)
    sent: dict[int, float] = {}
    lat: list[float] = []
    frames = 0
    end = time.perf_counter() + seconds

    async def act() -> None:
        seq = 0
        while time.perf_counter() < end:
            seq += 1
            sent[seq] = time.perf_counter()
            await ws.send(wire.encode(m.Action(seq=seq, keys=(KEYS[seq // 10 % 4],))))
            await asyncio.sleep(0.05)

    actor = asyncio.create_task(act())
    start = time.perf_counter()
    while time.perf_counter() < end:
        msg = await recv(ws)
        if isinstance(msg, m.Frames):
            frames += msg.count
            now = time.perf_counter()
            for seq in [s for s in sent if msg.action_seq is not None and s <= msg.action_seq]:
                lat.append((now - sent.pop(seq)) * 1000)
            await ws.send(wire.encode(m.Ack(chunk=msg.chunk)))
    fps = frames / (time.perf_counter() - start)
    await actor
    await ws.send(wire.encode(m.Close()))
    await ws.close()
    return lat, fps


async def pings(url: str, n: int = 200) -> list[float]:
    """Ping -> pong round trips (ms) on one socket with no session."""
    ws = await dial(url)
    out = []
    for _ in range(n):
        sent = time.perf_counter()
        await ws.send(wire.encode(m.Ping(t=0.0)))
        await recv(ws)
        out.append((time.perf_counter() - sent) * 1000)
    await ws.close()
    return out


async def load(url: str, sessions: int, steps: int, seconds: float) -> dict:
    """The lockstep and realtime figures of `sessions` parallel clients."""
    alone, _ = await lockstep(url, 50, 2 * steps)  # one session: the hop without contention
    runs = await asyncio.gather(*(lockstep(url, s, steps) for s in range(sessions)))
    step_lat = [x for lat, _ in runs for x in lat[1:]]  # the first step warms its session up
    rt = await asyncio.gather(*(realtime(url, 100 + s, seconds) for s in range(sessions)))
    act_lat = [x for lat, _ in rt for x in lat]
    return {
        "lockstep_alone_step_to_frames_ms": {"p50": pct(alone[1:], 50), "p99": pct(alone[1:], 99)},
        "lockstep": {
            "step_to_frames_ms": {"p50": pct(step_lat, 50), "p99": pct(step_lat, 99)},
            "chunks_per_s_per_session": round(statistics.mean(r for _, r in runs), 2),
        },
        "realtime": {
            "action_to_frame_ms": {"p50": pct(act_lat, 50), "p99": pct(act_lat, 99)},
            "frames_per_s_per_session": round(statistics.mean(f for _, f in rt), 2),
        },
    }


async def single(args: argparse.Namespace) -> dict:
    import torch

    from web.app import load_worlds
    from web.server import Server

    torch.set_num_threads(1)
    worlds = load_worlds([args.model])
    # one load generator opens every session from one address: no per-address cap
    config = ServerConfig(
        port=0, max_sessions=args.sessions + 2, engine_threads=1, max_connections_per_address=0
    )
    async with Server(worlds, config) as server:
        await load(server.ws_url, 1, 3, 1.0)  # warm-up
        figures = await load(server.ws_url, args.sessions, args.steps, args.seconds)
        figures["ping_ms"] = {"p50": pct(p := await pings(server.ws_url), 50), "p99": pct(p, 99)}
    return figures


async def cluster(args: argparse.Namespace, replicas: int) -> dict:
    from web.cluster.control import Cluster, ReplicaSpec
    from web.cluster.frontend import FrontEnd

    config = ServerConfig(port=0, max_sessions=args.sessions + 2, max_connections_per_address=0)
    spec = ReplicaSpec(models=(args.model,), config=config, threads=1, cpus=0.0)
    started = time.perf_counter()
    group = await Cluster.start(replicas, spec, b"b" * 32)
    start_s = time.perf_counter() - started
    front = FrontEnd(group, config)
    await front.start()
    try:
        await load(front.ws_url, 1, 3, 1.0)  # warm-up (every replica gets sessions below)
        opened = [await dial(front.ws_url) for _ in range(args.sessions)]
        for i, ws in enumerate(opened):
            await ws.send(wire.encode(m.Open(seed=i, mode="lockstep", codec="jpeg")))
            await recv(ws)
        placement = {str(x["name"]): int(x["sessions"]) for x in await group.loads()}
        for ws in opened:
            await ws.send(wire.encode(m.Close()))
            await ws.close()
        await asyncio.sleep(0.5)
        figures = await load(front.ws_url, args.sessions, args.steps, args.seconds)
        figures["ping_ms"] = {"p50": pct(p := await pings(front.ws_url), 50), "p99": pct(p, 99)}
        direct = await pings(next(iter(group.urls.values())))
        figures["ping_direct_to_replica_ms"] = {"p50": pct(direct, 50), "p99": pct(direct, 99)}
        figures["placement"] = placement
        figures["replicas_start_s"] = round(start_s, 1)
        if replicas > 1:
            figures["drain"] = await drain_time(front.ws_url, group, args.sessions)
    finally:
        await front.stop()
        await group.stop()
    return figures


async def drain_time(url: str, group: Cluster, sessions: int) -> dict:
    """Seconds to drain the replica holding the most of `sessions` fresh lockstep sessions
    (one chunk each), and until the last moved client has its `ready` from the new replica."""
    opened: dict[str, ClientConnection] = {}
    for i in range(sessions):
        ws = await dial(url)
        await ws.send(wire.encode(m.Open(seed=i, mode="lockstep", codec="jpeg")))
        ready = await recv(ws)
        assert isinstance(ready, m.Ready)
        await ws.send(wire.encode(m.Step(seq=0, actions=[m.FrameAction()])))
        while not isinstance(await recv(ws), m.Frames):
            pass
        opened[ready.session_id] = ws
    loads = await group.loads()
    busiest = str(max(loads, key=lambda x: int(x["sessions"]))["name"])  # type: ignore[call-overload]
    started = time.perf_counter()

    async def resumed(ws: ClientConnection) -> float:
        while not isinstance(await recv(ws), m.Ready):
            pass
        return time.perf_counter() - started

    waits = {sid: asyncio.create_task(resumed(ws)) for sid, ws in opened.items()}
    report = await group.drain(busiest)
    drained = time.perf_counter() - started
    back = [await asyncio.wait_for(waits[sid], 60) for sid in report.moved if sid in waits]
    for sid, task in waits.items():
        if sid not in report.moved:
            task.cancel()
    for ws in opened.values():
        await ws.send(wire.encode(m.Close()))
        await ws.close()
    return {
        "replica": busiest,
        "sessions_moved": len(report.moved),
        "drain_s": round(drained, 3),
        "last_client_ready_s": round(max(back, default=0.0), 3),
    }


def actor_call_ms(n: int = 200) -> dict:
    """Round trip of a Ray actor call that returns one raw tiny-world chunk."""
    import ray

    @ray.remote(num_cpus=0)
    class Echo:
        def chunk(self) -> bytes:
            return bytes(4 * 64 * 64 * 3)

    echo = Echo.remote()
    ray.get(echo.chunk.remote())
    out = []
    for _ in range(n):
        sent = time.perf_counter()
        ray.get(echo.chunk.remote())
        out.append((time.perf_counter() - sent) * 1000)
    ray.kill(echo)
    return {"p50": pct(out, 50), "p99": pct(out, 99)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-world")
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--out", type=Path, default=RESULTS / "cluster_load.json")
    args = parser.parse_args()

    import ray

    out: dict = {"model": args.model, "sessions": args.sessions, "machine": "2 shared CPU cores, no GPU"}
    out["single"] = asyncio.run(single(args))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        out["actor_call_raw_chunk_ms"] = actor_call_ms()
        out["cluster-1"] = asyncio.run(cluster(args, 1))
        if args.replicas > 1:
            out[f"cluster-{args.replicas}"] = asyncio.run(cluster(args, args.replicas))
    finally:
        ray.shutdown()
    alone = "lockstep_alone_step_to_frames_ms"
    out["extra_hop_step_alone_p50_ms"] = round(
        out["cluster-1"][alone]["p50"] - out["single"][alone]["p50"], 2
    )
    out["extra_hop_ping_p50_ms"] = round(
        out["cluster-1"]["ping_ms"]["p50"] - out["single"]["ping_ms"]["p50"], 2
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
