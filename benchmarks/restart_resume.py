"""SIGTERM, restart, resume (issue 43, item 2): N lockstep sessions on `worldserve serve
--state-dir DIR`, half of them detached and half attached when the server gets SIGTERM; a second
server on the same directory restores them, each client resumes with its token and steps on; the
frames after the restart must equal, bit for bit, those of an uninterrupted run of the same seed
and actions (opened on the second server afterwards).

Every step is awaited before the next one is sent, one session at a time, so every chunk runs in
a batch of one (frames are bit-identical only for the same batch layout: docs/ENGINE.md,
"Reproducibility").

    python benchmarks/restart_resume.py [--model tiny-world] [--sessions 16] [--before 3]
                                        [--after 3] [--out FILE]

Reports: whether every session continued bit for bit, how many were saved and restored, the
seconds from SIGTERM to the first server's exit (the save) and from the second's start to its
"serving" line (loading + restore), and the bytes in the state directory.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.serving import report, start_server
from web import codec as wire
from web import messages as m

RESULTS = Path(__file__).parent / "results"
KEYS = ["w", "d", "s", "a"]


def script(session: int, steps: int) -> list[list[m.FrameAction]]:
    """Session `session`'s actions: a walk that changes from step to step and between sessions."""
    return [[m.FrameAction(keys=(KEYS[(session + i) % len(KEYS)],))] for i in range(steps)]


async def dial(host: str, query: str = "") -> ClientConnection:
    return await ws_connect(f"ws://{host}/v1/session{query}", proxy=None, compression=None, max_size=None)


async def recv(ws: ClientConnection) -> m.ServerMessage:
    return wire.parse_server(await asyncio.wait_for(ws.recv(), 120))


async def step(ws: ClientConnection, seq: int, actions: list[m.FrameAction]) -> np.ndarray:
    """One lockstep step, awaited and acked; its raw frames."""
    await ws.send(wire.encode(m.Step(seq=seq, actions=actions)))
    while True:
        msg = await recv(ws)
        if isinstance(msg, m.Frames):
            await ws.send(wire.encode(m.Ack(chunk=msg.chunk)))
            assert isinstance(msg.data, np.ndarray)
            return msg.data
        if isinstance(msg, m.Error):
            raise RuntimeError(f"step {seq}: {msg.code}: {msg.message}")


async def open_session(host: str, model: str, seed: int) -> tuple[ClientConnection, m.Ready]:
    ws = await dial(host)
    await ws.send(wire.encode(m.Open(model=model, seed=seed, mode="lockstep", codec="raw")))
    ready = await recv(ws)
    assert isinstance(ready, m.Ready), ready
    return ws, ready


async def before_stop(host: str, model: str, n: int, before: int) -> list[tuple[m.Ready, ClientConnection]]:
    """Open n sessions and run `before` steps in each; odd ones are detached (socket dropped)."""
    out = []
    for i in range(n):
        ws, ready = await open_session(host, model, 100 + i)
        for seq, actions in enumerate(script(i, before)):
            await step(ws, seq, actions)
        if i % 2:
            ws.transport.abort()  # the network goes away: detached
        out.append((ready, ws))
    return out


async def after_restart(host: str, model: str, readies: list[m.Ready], before: int, after: int) -> dict:
    """Resume each session, run `after` more steps; then the same seeds uninterrupted."""
    resumed, problems = [], []
    for i, ready in enumerate(readies):
        ws = await dial(host, f"?resume={ready.resume_token}&codec=raw")
        again = await recv(ws)
        if not isinstance(again, m.Ready) or again.session_id != ready.session_id or again.chunk != before:
            problems.append(f"session {i}: resume answered {again}")
            resumed.append(None)
            continue
        frames = [await step(ws, before + j, a) for j, a in enumerate(script(i, before + after)[before:])]
        resumed.append(frames)
        await ws.send(wire.encode(m.Close()))
    equal = 0
    for i, got in enumerate(resumed):
        ws, _ = await open_session(host, model, 100 + i)
        frames = [await step(ws, seq, a) for seq, a in enumerate(script(i, before + after))][before:]
        await ws.send(wire.encode(m.Close()))
        if got is not None and all(np.array_equal(x, y) for x, y in zip(frames, got, strict=True)):
            equal += 1
        elif got is not None:
            problems.append(f"session {i}: frames differ after the restart")
    return {"equal": equal, "problems": problems}


def run(model: str, sessions: int, before: int, after: int, state_dir: Path, threads: int = 1) -> dict:
    """The whole scenario (see the module docstring); returns the figures."""
    extra = ["--state-dir", str(state_dir), "--max-sessions", str(max(16, sessions))]
    extra += ["--detach-ttl", "600", "--persist-timeout", "60"]
    proc, host = start_server(model, threads, *extra)
    try:
        opened = asyncio.run(before_stop(host, model, sessions, before))
        t0 = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        status = proc.wait(120)
        save_s = time.perf_counter() - t0
    finally:
        proc.kill()
    saved_bytes = sum(p.stat().st_size for p in state_dir.glob("*.safetensors"))
    saved = len(list(state_dir.glob("*.json")))
    t0 = time.perf_counter()
    proc, host = start_server(model, threads, *extra)
    start_s = time.perf_counter() - t0
    try:
        result = asyncio.run(after_restart(host, model, [r for r, _ in opened], before, after))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    return {
        "model": model,
        "sessions": sessions,
        "detached_at_stop": sessions // 2,
        "steps_before": before,
        "steps_after": after,
        "first_exit_status": status,
        "saved": saved,
        "state_bytes": saved_bytes,
        "sigterm_to_exit_s": round(save_s, 2),
        "restart_to_serving_s": round(start_s, 2),
        "bit_identical": result["equal"],
        "problems": result["problems"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-world")
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--before", type=int, default=3)
    parser.add_argument("--after", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "restart_resume.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        figures = run(args.model, args.sessions, args.before, args.after, Path(tmp))
    for k, v in figures.items():
        print(f"{k}: {v}")
    report(args.out, "restart_resume", **figures)


if __name__ == "__main__":
    main()
