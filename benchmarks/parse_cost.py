"""Parse cost: event-loop time one client message can take, and what hostile ones do to others.

The server parses each message on its event loop, so the time `codec.parse_client` takes on a
message is time every other client waits. Two measurements:

* **per message**: wall time of `parse_client` on hostile and ordinary messages (best and worst
  of `--reps` runs; it is all on one thread, so this is the loop stall), whatever the outcome
  (parsed, or refused with a protocol error);
* **end to end**: `worldserve serve --model tiny-random` of that checkout in a subprocess, one
  client pinging it every 20 ms, and an attacker that sends one hostile message every 0.5 s (a
  1 MB message of a million nested empty arrays, then a 64 KB `generate` of 8000 x 7 actions,
  alternately; each on a fresh connection, since old servers close on the second) — the ping
  latencies (from when each ping was due) with and without the attack.

Run it once per checkout to compare versions (the code under test is imported from `--code`):

    python benchmarks/parse_cost.py --label after
    python benchmarks/parse_cost.py --label before --code /path/to/older/checkout

Prints and writes (merging by label) benchmarks/results/parse_cost.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results" / "parse_cost.json"


def hostile_messages() -> dict[str, dict[str, Any]]:
    """Messages by name (msgpack-ready objects)."""
    inner: list[Any] = [[]] * 10_000
    key = {"keys": ["w"], "mouse": [1.0, 0.0]}
    return {
        "nested_1MB_1M_arrays": {"type": "ping", "t": 1.0, "x": [inner] * 100},
        "generate_64KB_8000x7": {"type": "generate", "chunks": 8000, "actions": [[{}] * 7] * 8000},
        "generate_4065_maps": {"type": "generate", "chunks": 32, "actions": [[{}] * 126] * 32},
        "generate_1000_keyed_chunks": {"type": "generate", "chunks": 1000, "actions": [[key]] * 1000},
        "deep_1000": _deep(1000),
        "step_256_keyed": {"type": "step", "seq": 1, "actions": [key] * 256},
        "step_4_keyed": {"type": "step", "seq": 1, "actions": [key] * 4},
        "action": {"type": "action", "seq": 1, **key},
    }


def _deep(depth: int) -> dict[str, Any]:
    node: Any = []
    for _ in range(depth):
        node = [node]
    return {"type": "step", "seq": 1, "actions": node}


def per_message(reps: int) -> dict[str, dict[str, Any]]:
    import msgpack

    from web import codec
    from web.errors import ProtocolError

    out = {}
    for name, obj in hostile_messages().items():
        data = msgpack.packb(obj)
        times = []
        outcome = "parsed"
        for _ in range(reps):
            start = time.perf_counter()
            try:
                codec.parse_client(data, max_size=1 << 20)
            except ProtocolError as exc:
                outcome = exc.code.value
            times.append((time.perf_counter() - start) * 1000)
        out[name] = {
            "bytes": len(data),
            "outcome": outcome,
            "best_ms": round(min(times), 2),
            "worst_ms": round(max(times), 2),
        }
        best, worst = min(times), max(times)
        print(f"  {name:28s} {len(data):>8d} B  {outcome:14s} best {best:8.2f} ms  worst {worst:8.2f} ms")
    return out


async def end_to_end(code: Path, seconds: float) -> dict[str, Any]:
    import msgpack
    from websockets.asyncio.client import connect

    from web import codec
    from web import messages as m

    hostile = [msgpack.packb(obj) for name, obj in hostile_messages().items() if name in ATTACK]
    serve = ("serve", "--model", "tiny-random", "--port", "0", "--threads", "1")
    server = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "web.cli", *serve),
        cwd=code,
        env={**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": "1"},
        stdout=asyncio.subprocess.PIPE,
    )
    assert server.stdout is not None
    url = ""
    while not url:
        line = (await server.stdout.readline()).decode()
        if not line:
            raise RuntimeError("the server did not start")
        if "sessions at " in line:
            url = line.split("sessions at ")[1].split()[0]

    async def dial():
        return await connect(url, proxy=None, compression=None, max_size=None)

    async def pings(duration: float) -> list[float]:
        """Ping every 20 ms; each latency counts from when the ping was due (a stalled server
        delays the pings after it too, and that counts)."""
        ws = await dial()
        latencies = []
        due = time.perf_counter()
        end = due + duration
        while due < end:
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            await ws.send(codec.encode(m.Ping(t=0.0)))
            await ws.recv()
            latencies.append((time.perf_counter() - due) * 1000)
            due = max(due + 0.02, time.perf_counter() - 0.02)
        await ws.close()
        return latencies

    async def attack(duration: float) -> int:
        sockets = []
        sent = 0
        end = time.perf_counter() + duration
        while time.perf_counter() < end:
            ws = await dial()
            sockets.append(ws)
            await ws.send(hostile[sent % len(hostile)])
            sent += 1
            await asyncio.sleep(0.5)
        for ws in sockets:
            with contextlib.suppress(Exception):
                await ws.close()
        return sent

    try:
        quiet = await pings(seconds)
        attacked, sent = await asyncio.gather(pings(seconds), attack(seconds))
    finally:
        server.terminate()
        await server.wait()

    def summary(latencies: list[float]) -> dict[str, float]:
        return {
            "n": len(latencies),
            "p50_ms": round(statistics.median(latencies), 2),
            "p99_ms": round(sorted(latencies)[int(0.99 * (len(latencies) - 1))], 2),
            "max_ms": round(max(latencies), 2),
        }

    out = {"quiet": summary(quiet), "attacked": summary(attacked), "hostile_messages_sent": sent}
    print(f"  ping latency quiet    {out['quiet']}")
    print(f"  ping latency attacked {out['attacked']} ({sent} hostile messages, one per 0.5 s)")
    return out


ATTACK = ("nested_1MB_1M_arrays", "generate_64KB_8000x7")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--label", default="after", help="key of this run in the JSON")
    parser.add_argument("--code", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    sys.path.insert(0, str(args.code.resolve()))
    import torch

    torch.set_num_threads(1)
    print(f"parse cost of {args.code} ({args.label})")
    result = {
        "code": str(args.code.resolve()),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "per_message": per_message(args.reps),
        "end_to_end": asyncio.run(end_to_end(args.code.resolve(), args.seconds)),
    }
    merged = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    merged[args.label] = result
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(merged, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
