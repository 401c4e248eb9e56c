"""Server overhead: a session through the websocket server vs the same session in-process, one run.

In-process: a `SessionManager` on an engine thread in this process; the sink acks every chunk
the moment it commits (no encode, no socket). Websocket: `worldserve serve` in a subprocess and
the async SDK here (encode on the server, msgpack, loopback TCP, decode here), per codec. Both
sides serve the same model, seed and actions; every websocket run is paired with an in-process
run just before it, and the ratio is the median of the paired ratios, so background load drifting
over the run hits both sides of each pair alike.

* chunks/s: a realtime session (credit window `--max-ahead`) acked as chunks arrive, after a
  two-chunk warm-up;
* action-to-frame latency: a lockstep session, `step` sent -> its chunk's frames in hand (p50/p99);
* CPU ms per chunk: the serving process on each path (this process in-process; the server
  process over the websocket), the server's threads other than the engine thread (event loop,
  encode pool: what serving adds), and the client's: overhead that background load barely skews;
* encode ms per frame at 256x256 and 640x360 for each codec, one thread, smooth moving frames
  (`encode` = the encoder alone, `pack` = building and msgpack-encoding the `frames` message;
  wall and `_cpu` time).

    python benchmarks/server_overhead.py [--model tiny-random] [--chunks 30] [--steps 20] [--rounds 3]

Prints and writes benchmarks/results/server_overhead.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.serving import report, start_server
from models.actions import FrameAction
from models.registry import from_name
from sessions.events import FramesEvent, SessionEvent
from sessions.manager import OpenParams, SessionManager
from web import codec as wire
from web import messages as m
from web.app import Runtime
from web.encoders import make_encoder
from web.sdk import connect

RESULTS = Path(__file__).parent / "results"
CODECS: tuple[m.Codec, ...] = ("h264", "jpeg", "raw")
KEYS = ["w", "d"]  # alternate per step so the actions change


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def _cpu_s(stat: Path) -> float:
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    return _cpu_s(Path(f"/proc/{pid}/stat"))


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds so far of each thread of a process, by thread id."""
    return {t.name: _cpu_s(t / "stat") for t in Path(f"/proc/{pid}/task").iterdir()}


# -- in-process ---------------------------------------------------------------------------------


async def inproc_rate(
    manager: SessionManager, model: str, chunks: int, max_ahead: int
) -> tuple[float, float]:
    """Chunks per second of a realtime session whose sink acks every chunk at once, and this
    process's CPU ms per chunk meanwhile."""
    cpu = process_cpu_s(os.getpid())
    session = await manager.open(OpenParams(model=model, seed=0, max_ahead=max_ahead))
    times: list[float] = []
    done = asyncio.Event()

    def sink(event: SessionEvent) -> None:
        if isinstance(event, FramesEvent):
            times.append(time.perf_counter())
            session.ack(event.chunk)
            if len(times) == chunks + 2:
                done.set()

    session.activate(sink)
    await done.wait()
    cpu_ms = (process_cpu_s(os.getpid()) - cpu) * 1000 / len(times)
    await manager.close(session)
    return chunks / (times[-1] - times[1]), cpu_ms


async def inproc_latency(manager: SessionManager, model: str, steps: int) -> list[float]:
    """Milliseconds from `step` to its committed chunk, lockstep, one step at a time."""
    session = await manager.open(OpenParams(model=model, seed=0, mode="lockstep"))
    arrived: asyncio.Queue[FramesEvent] = asyncio.Queue()
    session.activate(lambda e: arrived.put_nowait(e) if isinstance(e, FramesEvent) else None)
    out = []
    for i in range(steps + 1):  # the first chunk is shorter: not measured
        start = time.perf_counter()
        session.step(i, [FrameAction(frozenset({KEYS[i % 2]}))])
        event = await arrived.get()
        session.ack(event.chunk)
        if i:
            out.append((time.perf_counter() - start) * 1000)
    await manager.close(session)
    return out


# -- websocket ----------------------------------------------------------------------------------


async def ws_rate(
    url: str, server_pid: int, codec: m.Codec, chunks: int, max_ahead: int
) -> tuple[float, ...]:
    """Chunks per second of a realtime session over the websocket, acked as they arrive, and CPU
    ms per chunk meanwhile: the server process, the server minus its engine thread (its busiest
    thread: what serving adds), and this (client) process."""
    times: list[float] = []
    before, client_cpu = thread_cpu_s(server_pid), process_cpu_s(os.getpid())
    async with connect(url, seed=0, codec=codec, max_ahead=max_ahead) as s:
        async for _ in s.chunks():
            times.append(time.perf_counter())
            if len(times) == chunks + 2:
                after = thread_cpu_s(server_pid)
                client_ms = (process_cpu_s(os.getpid()) - client_cpu) * 1000 / len(times)
                break
    used = [after[t] - before.get(t, 0.0) for t in after]
    server_ms, serving_ms = sum(used) * 1000 / len(times), (sum(used) - max(used)) * 1000 / len(times)
    return chunks / (times[-1] - times[1]), server_ms, serving_ms, client_ms


async def ws_latency(url: str, codec: m.Codec, steps: int, think_ms: float = 0.0) -> list[float]:
    """Milliseconds from sending `step` to holding its decoded frames; `think_ms`: the client
    waits this long after each chunk before its next step (a policy's forward, a game's frame)."""
    out = []
    async with connect(url, seed=0, codec=codec, mode="lockstep") as s:
        for i in range(steps + 1):
            start = time.perf_counter()
            await s.step({"keys": [KEYS[i % 2]]})
            if i:
                out.append((time.perf_counter() - start) * 1000)
            if think_ms:
                await asyncio.sleep(think_ms / 1000)
    return out


# -- encoders -----------------------------------------------------------------------------------


def smooth_frames(n: int, height: int, width: int) -> np.ndarray:
    """(n, H, W, 3) uint8: gradients and a moving soft disc (what trained worlds look like)."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    out = np.empty((n, height, width, 3), np.uint8)
    for t in range(n):
        base = np.stack(
            [60 + 120 * x / width, 50 + 150 * y / height, 128 + 50 * np.sin((x + y) / 40 + t / 5)], -1
        )
        cy, cx = height * (0.5 + 0.3 * np.sin(t / 7)), width * (0.2 + 0.6 * t / n)
        disc = np.clip((min(height, width) / 6 - np.hypot(y - cy, x - cx)) / 6, 0, 1)[..., None]
        out[t] = (base * (1 - disc) + np.array([210, 190, 110]) * disc).clip(0, 255).astype(np.uint8)
    return out


def encode_ms(codec: m.Codec, height: int, width: int, frames: int = 120, chunk: int = 4) -> dict[str, float]:
    """Milliseconds per frame to encode, and to pack the `frames` message, on this one thread:
    wall time, and CPU time (what the frame costs, whatever else the machine runs)."""
    video = smooth_frames(frames, height, width)
    encoder = make_encoder(codec, width, height, 30.0)
    encoder.encode_chunk(video[:chunk])  # warm-up (H.264: the first IDR)
    wall = {"encode": 0.0, "pack": 0.0}
    cpu = {"encode": 0.0, "pack": 0.0}
    size = 0
    for i in range(0, frames, chunk):
        part = video[i : i + chunk]
        t0, c0 = time.perf_counter(), time.thread_time()
        out = encoder.encode_chunk(part)
        t1, c1 = time.perf_counter(), time.thread_time()
        msg = m.Frames(chunk=1 + i, frame0=i, count=len(part), codec=codec, key=out.key, data=out.data)
        size += len(wire.encode(msg))
        t2, c2 = time.perf_counter(), time.thread_time()
        wall["encode"] += t1 - t0
        wall["pack"] += t2 - t1
        cpu["encode"] += c1 - c0
        cpu["pack"] += c2 - c1
    return {
        **{k: round(v * 1000 / frames, 3) for k, v in wall.items()},
        **{f"{k}_cpu": round(v * 1000 / frames, 3) for k, v in cpu.items()},
        "kib_per_frame": round(size / frames / 1024, 1),
    }


# -- main ---------------------------------------------------------------------------------------


async def measure(args: argparse.Namespace, url: str, server_pid: int) -> dict:
    """Every websocket measurement is paired with an in-process one right before it, so that the
    ratio compares two runs under the same background load."""
    world = from_name(args.model)
    model = world.spec.id
    runtime = Runtime.start({model: world}, threads=args.threads)
    codecs = args.codecs
    names = ["inproc", *codecs]
    rates: dict[str, list[float]] = {n: [] for n in names}
    ratios: dict[str, list[float]] = {c: [] for c in codecs}
    cpu: dict[str, list[float]] = {n: [] for n in names}  # server-side CPU ms per chunk
    client_cpu: dict[str, list[float]] = {c: [] for c in codecs}
    serving_cpu: dict[str, list[float]] = {c: [] for c in codecs}
    latencies: dict[str, list[float]] = {n: [] for n in names}
    try:
        await inproc_rate(runtime.manager, model, 4, args.max_ahead)  # warm-up: first-use costs
        for c in codecs:
            await ws_rate(url, server_pid, c, 4, args.max_ahead)
        for r in range(args.rounds):
            for c in codecs:
                base, base_cpu = await inproc_rate(runtime.manager, model, args.chunks, args.max_ahead)
                rate, server_ms, serving_ms, client_ms = await ws_rate(
                    url, server_pid, c, args.chunks, args.max_ahead
                )
                rates["inproc"].append(base)
                cpu["inproc"].append(base_cpu)
                rates[c].append(rate)
                ratios[c].append(rate / base)
                cpu[c].append(server_ms)
                client_cpu[c].append(client_ms)
                serving_cpu[c].append(serving_ms)
                latencies["inproc"] += await inproc_latency(runtime.manager, model, args.steps)
                latencies[c] += await ws_latency(url, c, args.steps)
                print(f"round {r + 1}/{args.rounds} {c}: in-process {base:.2f}/s, websocket {rate:.2f}/s")
    finally:
        await runtime.stop()
    paths = {}
    for name in names:
        paths[name] = {
            "chunks_per_s": round(statistics.median(rates[name]), 3),
            "chunks_per_s_runs": [round(x, 3) for x in rates[name]],
            "server_cpu_ms_per_chunk": round(statistics.median(cpu[name]), 2),
            "step_latency_ms_p50": round(percentile(latencies[name], 50), 2),
            "step_latency_ms_p99": round(percentile(latencies[name], 99), 2),
        }
        if name in ratios:
            paths[name]["ratio_to_inproc"] = round(statistics.median(ratios[name]), 3)
            paths[name]["ratio_to_inproc_runs"] = [round(x, 3) for x in ratios[name]]
            paths[name]["server_cpu_ratio_to_inproc"] = round(
                statistics.median(cpu[name]) / statistics.median(cpu["inproc"]), 3
            )
            paths[name]["serving_cpu_ms_per_chunk"] = round(statistics.median(serving_cpu[name]), 2)
            paths[name]["client_cpu_ms_per_chunk"] = round(statistics.median(client_cpu[name]), 2)
    return {
        "model": model,
        "fps": world.spec.fps,
        "size": [world.spec.width, world.spec.height],
        "paths": paths,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny-random")
    parser.add_argument("--chunks", type=int, default=30, help="chunks per throughput measurement")
    parser.add_argument("--steps", type=int, default=20, help="lockstep steps per latency measurement")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-ahead", type=int, default=4, help="realtime credit window, chunks")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, both sides")
    parser.add_argument("--codecs", nargs="+", default=list(CODECS), choices=CODECS, help="websocket codecs")
    parser.add_argument("--out", type=Path, default=RESULTS / "server_overhead.json")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the engine thread runs on --threads (`EngineThread`), as the server's does

    proc, url = start_server(args.model, args.threads)
    try:
        served = asyncio.run(measure(args, url, proc.pid))
    finally:
        proc.terminate()
        proc.wait(60)
    encode = {f"{w}x{h}": {c: encode_ms(c, h, w) for c in CODECS} for w, h in ((256, 256), (640, 360))}
    report(
        args.out,
        "server_overhead",
        torch_threads=args.threads,
        chunks=args.chunks,
        steps=args.steps,
        rounds=args.rounds,
        max_ahead=args.max_ahead,
        **served,
        encode_ms_per_frame=encode,
    )


if __name__ == "__main__":
    main()
