"""Overload fairness: K lockstep websocket clients against one server, each sending a step,
waiting for its frames, then sending the next, for T seconds (issue 39, item 2).

The server is `worldserve serve` in a subprocess (benchmarks/serving.py), so the clients' own
event loop and parsing do not share the server's loop and GIL; the clients all run here, on one
event loop, and neither decode their frames nor think between steps (the worst case for the
scheduler: every session always has a step outstanding). A step sent before the deadline is
always awaited, so a session left waiting at the end still counts with its full latency.

Reports, over all sessions:

* chunks per session (min, max, max/min): the issue's target is max/min <= 1.5;
* step-to-frames seconds (`step` sent -> its `frames` in hand): p50, p90, p99, max, p99/p50
  (target p99/p50 <= 3);
* queue wait per chunk: the server's `frames.timings.queue` (submit -> the step that ran it)
  and /metrics' `worldserve_queue_wait_seconds` (submit -> batch) at the end;
* chunks/s the server delivered in all and in the second half of the run, and the rate the
  engine measured then (`worldserve_chunk_rate` at the deadline: what realtime admission
  counts on).

    python benchmarks/overload.py [--sessions 64] [--seconds 90] [--model tiny-world]
                                  [--server-root DIR] [--serve-arg=--flag ...]

`--server-root` runs the server from another checkout (e.g. main, for a before/after).
Prints and writes benchmarks/results/overload.json (or --out).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.serving import report, start_server
from web import codec as wire
from web import messages as m

RESULTS = Path(__file__).parent / "results"
KEYS = ["w", "d", "s", "a"]  # the sessions walk around: actions change from step to step


@dataclass
class Client:
    """One lockstep session's record."""

    latencies: list[float] = field(default_factory=list)  # seconds, step sent -> frames in hand
    arrived: list[float] = field(default_factory=list)  # perf_counter() when each chunk came
    queue_ms: list[float] = field(default_factory=list)  # frames.timings.queue of each chunk
    errors: list[str] = field(default_factory=list)


def _env(root: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


async def recv(ws, timeout: float) -> m.ServerMessage:
    return wire.parse_server(await asyncio.wait_for(ws.recv(), timeout))


async def session(
    addr: str,
    codec: m.Codec,
    seed: int,
    opened: asyncio.Queue[None],
    start: asyncio.Event,
    deadline: list[float],
    out: Client,
) -> None:
    """Open a lockstep session, report it on `opened`, wait for `start`, then step and await
    frames until the deadline."""
    from websockets.asyncio.client import connect

    try:
        ws = await connect(f"ws://{addr}/v1/session", proxy=None, compression=None, max_size=None)
        await ws.send(wire.encode(m.Open(seed=seed, mode="lockstep", codec=codec)))
        first = await recv(ws, 120)
    except Exception as exc:
        out.errors.append(f"open: {exc!r}"[:200])
        opened.put_nowait(None)
        return
    opened.put_nowait(None)
    if not isinstance(first, m.Ready):
        out.errors.append(f"open: {first!r}"[:200])
        return
    async with ws:
        await start.wait()
        seq = 0
        while time.perf_counter() < deadline[0]:
            seq += 1
            sent = time.perf_counter()
            await ws.send(wire.encode(m.Step(seq=seq, actions=[{"keys": [KEYS[(seed + seq // 4) % 4]]}])))
            while True:
                msg = await recv(ws, 600)
                if isinstance(msg, m.Frames):
                    now = time.perf_counter()
                    out.latencies.append(now - sent)
                    out.arrived.append(now)
                    out.queue_ms.append(float(msg.timings.get("queue", float("nan"))))
                    await ws.send(wire.encode(m.Ack(chunk=msg.chunk)))
                    break
                if isinstance(msg, m.Error):
                    out.errors.append(f"{msg.code}: {msg.message}"[:200])
                    if msg.fatal:
                        return
                    break
        await ws.send(wire.encode(m.Close()))


def scrape_metrics(addr: str) -> dict[str, object]:
    """From the server's /metrics: the lockstep queue-wait histogram (count, sum, buckets) so
    far and the engine's measured chunk rate (what realtime admission would count on)."""
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict[str, object] = {}
    for kind, value in re.findall(
        r'^worldserve_queue_wait_seconds_(count|sum)\{mode="lockstep",model="[^"]+"\} (\S+)$', text, re.M
    ):
        out[f"queue_wait_{kind}"] = float(value)
    buckets = re.findall(
        r'^worldserve_queue_wait_seconds_bucket\{le="([^"]+)",mode="lockstep"[^}]*\} (\S+)$', text, re.M
    )
    if buckets:
        out["queue_wait_buckets"] = {le: float(v) for le, v in buckets}
    rate = re.findall(r"^worldserve_chunk_rate\{[^}]*\} (\S+)$", text, re.M)
    if rate:
        out["measured_chunk_rate"] = round(float(rate[0]), 2)
    return out


def pct(values: np.ndarray, q: float) -> float:
    return round(float(np.percentile(values, q)), 3)


async def run(args: argparse.Namespace, addr: str) -> dict:
    clients = [Client() for _ in range(args.sessions)]
    opened: asyncio.Queue[None] = asyncio.Queue()
    start = asyncio.Event()
    deadline = [float("inf")]
    tasks = [
        asyncio.create_task(session(addr, args.codec, i, opened, start, deadline, c))
        for i, c in enumerate(clients)
    ]
    for _ in clients:  # every session opened (or failed to) before the clock starts
        await opened.get()
    began = time.perf_counter()
    deadline[0] = began + args.seconds
    start.set()
    # /metrics at the deadline, while every session still has a step outstanding
    await asyncio.sleep(args.seconds)
    metrics = await asyncio.to_thread(scrape_metrics, addr)
    await asyncio.gather(*tasks)
    wall = time.perf_counter() - began
    # delivered under full load: the chunks that came in the second half before the deadline
    half = began + args.seconds / 2
    late = sum(1 for c in clients for t in c.arrived if half <= t < deadline[0])
    metrics["delivered_chunk_rate_2nd_half"] = round(late / (deadline[0] - half), 2)
    return summarize(clients, wall) | {"metrics": metrics}


def summarize(clients: list[Client], wall: float) -> dict:
    chunks = np.array([len(c.latencies) for c in clients])
    lat = np.concatenate([c.latencies for c in clients]) if chunks.sum() else np.zeros(1)
    queue = np.concatenate([c.queue_ms for c in clients]) / 1000 if chunks.sum() else np.zeros(1)
    p50, p99 = pct(lat, 50), pct(lat, 99)
    return {
        "sessions": len(clients),
        "seconds": round(wall, 1),
        "chunks": int(chunks.sum()),
        "chunks_per_s": round(float(chunks.sum()) / wall, 2),
        "chunks_per_session": {
            "min": int(chunks.min()),
            "max": int(chunks.max()),
            "max_over_min": round(float(chunks.max()) / max(1, int(chunks.min())), 3),
            "all": chunks.tolist(),
        },
        "step_to_frames_s": {
            "p50": p50,
            "p90": pct(lat, 90),
            "p99": p99,
            "max": round(float(lat.max()), 3),
            "p99_over_p50": round(p99 / p50, 3) if p50 else None,
        },
        "queue_wait_s": {
            "p50": pct(queue, 50),
            "p90": pct(queue, 90),
            "p99": pct(queue, 99),
            "max": round(float(queue.max()), 3),
        },
        "errors": sorted({e for c in clients for e in c.errors})[:10],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=90.0)
    parser.add_argument("--model", default="tiny-world")
    parser.add_argument("--codec", default="jpeg", choices=["jpeg", "h264", "raw"])
    parser.add_argument("--max-batch", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="the server's engine threads")
    parser.add_argument("--server-root", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--serve-arg", action="append", default=[], help="one more `serve` argument")
    parser.add_argument("--out", type=Path, default=RESULTS / "overload.json")
    args = parser.parse_args()
    extra = ["--max-sessions", str(args.sessions), "--max-connections", str(args.sessions + 8)]
    extra += ["--max-connections-per-address", "0"]  # every client comes from 127.0.0.1
    extra += ["--max-batch", str(args.max_batch), *args.serve_arg]
    proc, addr = start_server(
        args.model, args.threads, *extra, root=args.server_root, env=_env(args.server_root)
    )
    try:
        result = asyncio.run(run(args, addr))
    finally:
        proc.terminate()
        proc.wait(30)
    git = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=args.server_root, capture_output=True, text=True
    )
    report(
        args.out, "overload", server_commit=git.stdout.strip(), server_args=extra, codec=args.codec, **result
    )


if __name__ == "__main__":
    main()
